"""The recovery recipe's settings (``recipes/finetune.py``), typed: YAML and ``key=value`` overrides are read into
these dataclasses, so an unknown key, a value of the wrong type or out of range is refused by name before any model
loads. The ``training`` section is transformers' own ``TrainingArguments``, checked by building one.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from transformers import TrainingArguments

from ..calibration.calibrate import CalibrationConfig
from ..modules import DEFAULT_METHOD, METHODS
from ..precision import PRECISIONS
from ..settings import read_overrides, read_settings, read_yaml_file, unknown_setting
from ..surgery import DEFAULT_ROLES, ConversionError, check_selection, split_roles
from ..validation import ValidationError, check_number, first_line, shown
from ..evaluation.norm_sensitivity import load_order
from . import hand_overs
from .loss_terms import TERMS
from .hand_overs.progressive import ORDERS
from .hand_overs.taper import SCHEDULES

# set by the recipe from its own settings: output_dir, seed, learning_rate (lr.base)
OWNED_TRAINING_ARGUMENTS = ("output_dir", "seed", "learning_rate")
# the Trainer's own push uploads all of output_dir (optimizer states, summary.json, training_args.bin with the
# token); the recipe's push_to_hub uploads the final checkpoint alone
HUB_TRAINING_ARGUMENTS = re.compile(r"push_to_hub.*|hub_.*")


def _at_least(value, name: str, minimum: float, whole: bool = False) -> None:
    if value is None:
        return
    check_number(value, name, minimum=minimum)
    if whole and value != int(value):
        raise ValidationError(f"{name} must be a whole number, got {value!r}")


@dataclass
class DistillSettings:
    """loss = (1 - weight) * CE + weight * (logit KL + hidden * layer-wise + embedding * (1 - embedding cosine)
    + scale * scale error at ``scale_at``, the final norm's input or every converted norm's
    (``hf_normswap.training.scale_anchor``) + the terms added as files of ``training/loss_terms``, each weighted
    by ``terms.KEY``: a number, or ``{weight: W, OPTION: VALUE}``)."""

    weight: float = 0.5
    temperature: float = 1.0
    logits: bool = True
    hidden: float = 0.0
    sink_weight: float = 0.0
    embedding: float = 0.0
    scale: float = 0.0
    scale_at: str = "final"  # final | all
    terms: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        # above 1, (1 - weight) * CE turns negative and training pushes cross-entropy up
        check_number(self.weight, "distill.weight", minimum=0, maximum=1)
        _at_least(self.temperature, "distill.temperature", 1e-6)
        for name in ("hidden", "sink_weight", "embedding", "scale"):
            _at_least(getattr(self, name), f"distill.{name}", 0)
        if self.scale_at not in ("final", "all"):
            raise ValidationError(f"distill.scale_at {self.scale_at!r} is unknown: choose final or all")
        if self.scale and not self.weight:
            raise ValidationError("distill.scale is a term of the distillation loss, which distill.weight 0 turns "
                                  "off: set distill.weight > 0 or distill.scale=0")
        self._check_terms()

    def _check_terms(self) -> None:
        """``terms``: every key a term added as a file, with a weight of at least 0 and the options it takes."""
        own = {kind.key for kind in TERMS.values() if kind.own_setting}
        for key, given in (self.terms or {}).items():
            if key not in TERMS or key in own:
                added = sorted(set(TERMS) - own)
                raise ValidationError(f"distill.terms.{key} is not a loss term added to training/loss_terms ("
                                      f"{', '.join(added) or 'none is'}); the built-in ones are distill's own keys")
            weight = given.get("weight", 0.0) if isinstance(given, dict) else given
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise ValidationError(f"distill.terms.{key} must be a weight, or {{weight: W, OPTION: VALUE}}, got "
                                      f"{shown(given)}")
            check_number(weight, f"distill.terms.{key}", minimum=0)
            _, options = TERMS[key].setting(self)
            problem = TERMS[key].check(weight, options)
            if problem:
                raise ValidationError(problem)
            if weight and not self.weight:
                raise ValidationError(f"distill.terms.{key} is a term of the distillation loss, which distill.weight "
                                      f"0 turns off: set distill.weight > 0 or distill.terms.{key}=0")

    @property
    def active_terms(self) -> tuple[type, ...]:
        """The kinds of loss term this run trains with (the logit terms always; a term weighted 0 is off), for the
        memory plan: what each holds in a step (``LossTerm.memory``)."""
        return tuple(kind for kind in TERMS.values() if kind.setting(self)[0] > 0)

    @property
    def hidden_states(self) -> bool:
        """Whether a term that is on reads every block's output (the forwards then return the teacher's)."""
        return any(kind.hidden_states for kind in self.active_terms)


@dataclass
class LearningRates:
    """``base`` for the weights; ``shape`` for log alpha / log beta and ``gamma`` for the norms' scale and bias
    (None: ``base``)."""

    base: float = 1.0e-4
    shape: float | None = None
    gamma: float | None = None

    def __post_init__(self):
        for name in ("base", "shape", "gamma"):
            _at_least(getattr(self, name), f"lr.{name}", 0)


@dataclass
class ProgressiveSettings:
    """Convert the norms a few at a time during training (``hf_normswap.training.hand_overs.progressive``)."""

    enabled: bool = False
    order: str = "depth"  # depth | reverse_depth | role | PATH.json (`normswap sensitivity --json`)
    every: int = 20
    ramp: int | None = None
    start: int = 0
    group: int = 1
    role_order: list[str] | None = None

    def __post_init__(self):
        _at_least(self.every, "progressive.every", 1, whole=True)
        _at_least(self.ramp, "progressive.ramp", 0, whole=True)
        _at_least(self.start, "progressive.start", 0, whole=True)
        _at_least(self.group, "progressive.group", 1, whole=True)

    def check_order(self) -> None:
        """The order, and its map file read, before any load: the schedule is built after the model loads (by
        ``progressive.enabled``, or the taper in stages, ``taper.schedule: progressive``)."""
        if self.order.endswith(".json"):
            try:
                load_order(self.order)
            except ValueError as error:
                raise ValidationError(f"progressive.order: {first_line(error)}") from None
        elif self.order not in ORDERS:
            raise ValidationError(f"progressive.order {self.order!r} is unknown: choose {', '.join(ORDERS)} or a "
                                  "sensitivity map .json (`normswap sensitivity --json`)")


@dataclass
class TaperSettings:
    """Blend each converted norm with its original, ``g`` falling from 1 to 0 over ``fraction`` of the run
    (``hf_normswap.training.hand_overs.taper``); 0: off."""

    fraction: float = 0.0
    schedule: str = "cosine"  # cosine | linear | progressive (stages in progressive.order, one after another)

    def __post_init__(self):
        check_number(self.fraction, "taper.fraction", minimum=0, maximum=1)
        if self.schedule not in SCHEDULES:
            raise ValidationError(f"taper.schedule {self.schedule!r} is unknown: choose {', '.join(SCHEDULES)}")


@dataclass
class HandOverSettings:
    """How the norms pass from the original's to the converted modules during training (``training.hand_overs``):
    ``kind`` none, progressive (a few at a time, the ``progressive`` section), taper (every norm blended, the
    ``taper`` section) or a kind added as a file of ``training/hand_overs``, whose settings are ``options``.
    ``progressive.enabled: true`` and ``taper.fraction > 0`` name theirs too; a run has one at most."""

    kind: str = "none"
    options: dict[str, Any] = field(default_factory=dict)

    def chosen(self, progressive, taper, trainable: str):
        """The run's hand-over (``hand_overs.HandOver``) or None; ValidationError, in one line, where it cannot
        be (two at once, with LoRA, its settings)."""
        hand_over = hand_overs.chosen(self.kind, progressive, taper, self.options, trainable)
        self.kind = hand_over.key if hand_over else hand_overs.NONE
        return hand_over


@dataclass
class LoraSettings:
    """peft LoRA adapters (``trainable: lora``); the element-wise modules train in full."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"

    def __post_init__(self):
        _at_least(self.r, "lora.r", 1, whole=True)


@dataclass
class FinalEvaluation:
    """The evaluation against the original before and after training (``hf_normswap.evaluate``)."""

    max_tokens: int | None = 8192
    max_length: int | None = 512
    batch_size: int | None = None
    # after training, the fit-for-use report (``evaluation.fit_for_use``): lm-eval tasks (names or local task YAMLs) on
    # both models, ``limit`` / ``num_fewshot`` as lm-eval means them; ``tails``: the per-token loss tails, the
    # ratio by position up to max_length and the repetition check
    tasks: str | list[str] | None = None
    limit: float | None = None
    num_fewshot: int | None = None
    tails: bool = False

    def __post_init__(self):
        for name in ("max_tokens", "max_length", "batch_size"):
            _at_least(getattr(self, name), f"final_eval.{name}", 1, whole=True)
        if self.limit is not None and not (isinstance(self.limit, (int, float)) and self.limit > 0):
            raise ValidationError(f"final_eval.limit must be positive (examples per task, or a fraction below 1), "
                                  f"got {self.limit!r}")
        _at_least(self.num_fewshot, "final_eval.num_fewshot", 0, whole=True)

    @property
    def task_names(self) -> str | None:
        """``tasks`` as the command line's ``--tasks`` reads them (comma-separated), None for none."""
        return ",".join(self.tasks) if isinstance(self.tasks, list) else self.tasks or None

    def arguments(self) -> dict:
        """The settings given, as ``evaluation.perplexity.PerplexitySettings`` and ``evaluate_embeddings`` take them."""
        return {k: getattr(self, k) for k in ("max_tokens", "max_length", "batch_size") if getattr(self, k) is not None}


def _of_type(value, hint) -> bool:
    """Whether ``value`` fits a TrainingArguments field's annotation (a type not known here passes: TrainingArguments'
    own checks see it)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_of_type(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if hint in (list, tuple) or origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(_of_type(v, args[0]) for v in value if args)
    if hint is dict or origin is dict:
        return isinstance(value, dict)
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float, str):
        numbers = (int, float) if hint is float else (hint,)
        return isinstance(value, numbers) and not isinstance(value, bool)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, (str, hint))
    return True


def _training_value_problem(key: str, value, hint) -> str | None:
    """Why a ``training.*`` value would fail only once training starts (a TypeError, a ZeroDivisionError, a
    RuntimeError for a reporting integration not installed), after the slow loading and calibration; None if fine."""
    if hint is not None and not _of_type(value, hint):
        kinds = " or ".join(sorted({getattr(a, "__name__", str(a)) for a in typing.get_args(hint) or (hint,)}))
        return f"must be {kinds.replace('NoneType', 'null')}, got {shown(value)}"
    if key in COUNTS and value is not None and value < 1:
        return f"must be at least 1, got {shown(value)}"
    if key == "report_to" and value not in (None, "none", "all"):
        # lazy: looked up at the call, where tests swap it (monkeypatch on transformers.integrations)
        from transformers.integrations import get_available_reporting_integrations

        missing = [n for n in ([value] if isinstance(value, str) else value)
                   if n not in (*get_available_reporting_integrations(), "none")]
        if missing:
            return f"names {missing[0]}, which is not installed here: install it, or set training.report_to=none"
    return None


# TrainingArguments' counts that divide or size a batch: 0 fails as a ZeroDivisionError once training starts
COUNTS = ("gradient_accumulation_steps", "per_device_train_batch_size", "per_device_eval_batch_size")


def _training_defaults() -> dict:
    return {"max_steps": 100, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
            "lr_scheduler_type": "cosine", "warmup_steps": 10, "weight_decay": 0.0, "max_grad_norm": 1.0,
            "logging_steps": 5, "eval_strategy": "steps", "eval_steps": 25, "save_strategy": "steps",
            "save_steps": 25, "save_total_limit": 2, "report_to": "none"}


@dataclass
class RecipeConfig:
    """Every setting of ``recipes/finetune.py``; the defaults are an offline run on the packaged SmolLM2."""

    model: str = "offline:smollm2"  # the original to convert, or an already converted checkpoint
    original: str | None = None  # the original when ``model`` is already converted (teacher and reference)
    method: str = DEFAULT_METHOD
    roles: str | list[str] | None = None  # the norms the recipe converts, by role (a list or comma-separated; None:
    # convert's default): [mlp_input, final] keeps the attention's input norms
    calibration: CalibrationConfig = field(default_factory=lambda: CalibrationConfig(num_blocks=16, block_len=512))
    train_data: str | list[str] = "builtin:calibration"  # a list: a mix, equal shares of the tokens (train_sources)
    streaming: bool = False  # read train_data (a Hub dataset) lazily, tokenized and packed on the fly
    eval_data: str = "builtin:evaluation"
    block_len: int = 256  # training sequence length (packed; a sentence encoder: its longest)
    max_train_tokens: int | None = None  # cap on the training text
    train_tokens: int | None = None  # tokens to train on in total, over every process and launch (sets max_steps)
    eval_blocks: int = 8  # blocks of eval_data for the Trainer's periodic evaluation
    final_eval: FinalEvaluation = field(default_factory=FinalEvaluation)
    trainable: Literal["norms", "all", "lora"] = "norms"
    lora: LoraSettings = field(default_factory=LoraSettings)
    distill: DistillSettings = field(default_factory=DistillSettings)
    precision: str = "auto"  # auto | fp32 | bf16 (autocast, fp32 master weights); auto times both here
    head_chunk: int = 256  # tokens per chunk through the output head in the distillation loss (0: all at once)
    step_tokens: int | None = None  # tokens a step over all processes, batch from the memory plan (CUDA: 65,536)
    compile: bool | None = None  # compile each block of the student and the original (None: on CUDA)
    freeze_embeddings: bool = False
    shard_teacher: bool = True  # under FSDP2, shard the frozen original too (false: each process reads it, whole)
    lr: LearningRates = field(default_factory=LearningRates)
    progressive: ProgressiveSettings = field(default_factory=ProgressiveSettings)
    taper: TaperSettings = field(default_factory=TaperSettings)
    hand_over: HandOverSettings = field(default_factory=HandOverSettings)  # kind: none | progressive | taper | ...
    first_scale_handover: float = 0.25  # share of the run at its end over which a linear position 0 joins the rest
    max_minutes: float | None = None  # wall-clock budget of this launch; stops with a checkpoint
    resume: bool = True  # go on from the last checkpoint in output_dir (false: a new run)
    output_dir: str = "out/finetune"
    save_dir: str | None = None  # default: OUTPUT/final
    push_to_hub: str | None = None  # Hub repo id for the final checkpoint
    threads: int | None = None  # torch threads per process
    seed: int = 0
    training: dict[str, Any] = field(default_factory=_training_defaults)  # TrainingArguments fields

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValidationError(f"method {self.method!r} is unknown: choose from {', '.join(METHODS)}")
        if self.precision not in PRECISIONS:
            raise ValidationError(f"precision {self.precision!r} is unknown: choose {', '.join(PRECISIONS[:-1])} or "
                                  f"{PRECISIONS[-1]}")
        for name in ("model", "eval_data", "output_dir"):
            if not getattr(self, name):
                raise ValidationError(f"{name} must be a non-empty string")
        if not all(self.train_sources) or isinstance(self.train_data, list) and len(self.train_data) < 2:
            raise ValidationError("train_data must be a text source, or a list of two or more to mix, e.g. "
                                  "train_data=[generated, wikitext:wikitext-103-raw-v1]")
        cut_off = [s for s in self.train_sources if re.fullmatch(r"\w+=.*", s) and not Path(s).exists()]
        if isinstance(self.train_data, list) and cut_off:
            raise ValidationError(f"train_data: {cut_off[0]!r} is an option cut off its source by the list's comma: "
                                  "quote a source with several options, e.g. "
                                  "train_data=['generated:length=256,batch_size=128', PATH]")
        for name in ("block_len", "eval_blocks"):
            _at_least(getattr(self, name), name, 1, whole=True)
        for name in ("max_train_tokens", "train_tokens", "threads"):
            _at_least(getattr(self, name), name, 1, whole=True)
        if self.threads is not None and self.threads > (os.cpu_count() or 1):  # torch would try to start them all
            raise ValidationError(f"threads must be at most {os.cpu_count()} (the CPUs of this machine), got "
                                  f"{self.threads}")
        _at_least(self.max_minutes, "max_minutes", 0)
        check_number(self.first_scale_handover, "first_scale_handover", minimum=0, maximum=1)
        _at_least(self.head_chunk, "head_chunk", 0, whole=True)
        _at_least(self.step_tokens, "step_tokens", 1, whole=True)
        _at_least(self.seed, "seed", 0, whole=True)
        if not self.roles_to_convert:
            raise ValidationError("roles names no role: leave it unset (convert's default) or name some, e.g. "
                                  "roles=[mlp_input,final]")
        try:
            check_selection(self.roles_to_convert, None, None)
        except ConversionError as error:
            raise ValidationError(f"roles: {error}") from None
        if self.calibration.tokenizer is not None:  # the recipe calibrates with the model's own tokenizer
            raise ValidationError("calibration.tokenizer is not a setting of the recipe: it calibrates with the "
                                  "model's own tokenizer; remove calibration.tokenizer")
        try:  # the strategy, precision, device and cache limit, before the model loads
            self.calibration.resolved()
        except ValueError as error:
            raise ValidationError(f"calibration: {error}", getattr(error, "setting", None)) from None
        if self.streaming and isinstance(self.train_data, list):
            raise ValidationError("streaming reads one Hub dataset: name one train_data, or set streaming=false to mix")
        if self.streaming and self.max_train_tokens is not None:
            raise ValidationError("a stream is read up to train_tokens (or training.max_steps); drop max_train_tokens")
        self.hand_over.chosen(self.progressive, self.taper, self.trainable)
        output = Path(self.output_dir).absolute()
        if self.save_path.absolute() in (output, *output.parents, output / "calibrated"):
            raise ValidationError(f"save_dir {self.save_dir} is output_dir, holds it or its calibrated/: the final "
                                  "checkpoint needs a folder of its own; leave save_dir unset (OUTPUT/final)")
        self._check_training()

    @property
    def roles_to_convert(self) -> tuple[str, ...]:
        """The roles of the norms the recipe converts: ``roles``, or convert's default when unset."""
        return DEFAULT_ROLES if self.roles is None else split_roles(self.roles)

    def _check_training(self) -> None:
        known = {f.name for f in dataclasses.fields(TrainingArguments) if f.init} - set(OWNED_TRAINING_ARGUMENTS)
        hints = typing.get_type_hints(TrainingArguments)
        merged = {**_training_defaults(), **self.training}
        for key, value in merged.items():  # YAML 1.1 reads an unquoted `no` as false
            if key.endswith("_strategy") and value is False:
                merged[key] = "no"
        for key in merged:
            if key not in known:
                raise unknown_setting(key, known, "training.")
            problem = _training_value_problem(key, merged[key], hints.get(key))
            if problem:
                raise ValidationError(f"training.{key} {problem}")
            if HUB_TRAINING_ARGUMENTS.fullmatch(key):
                raise ValidationError(f"training.{key} is refused: the Trainer would upload all of output_dir "
                                      "(optimizer states, training_args.bin holding the token); set push_to_hub: "
                                      "OWNER/NAME to push the final checkpoint alone, with the token of HF_TOKEN")

        class Checked(TrainingArguments):
            """TrainingArguments' checks of its fields (scheduler and optimizer names ...) without the device set-up
            that building one also does: that starts accelerate's distributed state, which the recipe creates
            itself once it runs, with its own choice of CPU."""

            _setup_devices = None

        try:
            Checked(output_dir=self.output_dir, seed=self.seed, learning_rate=self.lr.base, **merged)
        except (ValueError, TypeError) as error:
            raise ValidationError(f"training: {first_line(error)}") from None
        self.training = merged

    @property
    def train_sources(self) -> list[str]:
        """The text sources of ``train_data``: one, or the several of a mix."""
        return list(self.train_data) if isinstance(self.train_data, list) else [self.train_data]

    @property
    def save_path(self) -> Path:
        return Path(self.save_dir or Path(self.output_dir) / "final")

    def to_dict(self) -> dict:
        """The settings as plain values (``summary.json``, the run's own record: run-time settings included), without
        the calibration's tokenizer, an object."""
        out = dataclasses.asdict(self)
        out["calibration"].pop("tokenizer", None)
        return out


def read_recipe_config(path: str | None, overrides: list[str]) -> RecipeConfig:
    """A YAML file (or the defaults) updated by ``key=value`` overrides (dotted keys reach into sections, values are
    read as YAML), read by the one settings reader (``hf_normswap.settings``); ValidationError names the file, the
    override or the setting that is wrong."""
    layers = [read_yaml_file(path)] if path else []
    return read_settings(RecipeConfig, *layers, read_overrides(overrides))
