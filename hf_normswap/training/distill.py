"""Fine-tuning a converted model with the transformers ``Trainer``: distillation loss, parameter groups, what trains.

Calibration fits each element-wise module to its source norm one at a time; what is left is the error the modules
make together, which only training on the network's output removes. :class:`NormSwapTrainer` keeps the Trainer's
machinery (DDP / FSDP / DeepSpeed through accelerate, checkpoints, resume, logging) and changes three things:

- ``compute_loss``: causal-LM cross-entropy plus, optionally, KL divergence to a frozen copy of the original
  model (knowledge distillation, Hinton et al. 2015: soft targets at temperature ``T``, scaled by ``T^2``);
- ``create_optimizer``: the element-wise modules' parameters get their own groups (no weight decay; a separate
  learning rate for the shape parameter alpha / beta and for gamma / bias), because the shape parameter lives on a
  log scale and wants a much larger step than the weights around it;
- ``log``: ``eval_loss`` is also logged as ``eval_perplexity``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Trainer, TrainerCallback

from ..modules import ElementwiseNorm
from .head_loss import DEFAULT_CHUNK, head_bypassed, head_is_plain, head_loss
from .layerwise import embedding_cosine_error, relative_hidden_error
from . import sharding

TRAINABLE = ("norms", "all", "lora")


def _norm_parameters(model: nn.Module):
    """``(name as model.named_parameters() gives it, module, name within the module)`` of every element-wise norm
    parameter, so that this works through peft and DDP wrappers."""
    for module_name, module in model.named_modules():
        if isinstance(module, ElementwiseNorm):
            for param_name, _ in module.named_parameters(recurse=False):
                yield (f"{module_name}.{param_name}" if module_name else param_name), module, param_name


def norm_parameter_names(model: nn.Module) -> dict[str, str]:
    """``{parameter name: "shape" | "gamma" | "bias"}`` for every element-wise norm parameter in ``model``; a scalar
    extra of the element function (``ElementwiseNorm.squash_extras``, Derf's shift) is an offset, so a "bias"."""
    return {name: "shape" if param_name.startswith("log_") else "gamma" if param_name == "weight" else "bias"
            for name, _, param_name in _norm_parameters(model)}


def shape_lr_factors(model: nn.Module) -> dict[str, float]:
    """``{shape parameter name: multiplier of the shape learning rate}`` (``ElementwiseNorm.lr_factor``: 2 for
    ELN's log beta, 1 for DyT's log alpha)."""
    return {name: module.lr_factor(param_name) for name, module, param_name in _norm_parameters(model)
            if param_name.startswith("log_")}


def set_trainable(model: nn.Module, which: str) -> int:
    """``"norms"``: only the element-wise modules' parameters train; ``"all"``: every parameter. Returns the count.

    (``"lora"`` is :func:`apply_lora`, which wraps the model.)
    """
    if which not in ("norms", "all"):
        raise ValueError(f"trainable must be one of {TRAINABLE}, got {which!r}")
    norm_names = norm_parameter_names(model)
    for name, param in model.named_parameters():
        param.requires_grad_(which == "all" or name in norm_names)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def apply_lora(model: nn.Module, *, r: int = 16, alpha: int = 32, dropout: float = 0.0,
               target_modules: list[str] | str = "all-linear"):
    """Wrap ``model`` with peft LoRA adapters; the element-wise modules train in full (peft ``modules_to_save``).

    The norm modules are small, and they are what changed: adapters alone would leave alpha / beta at their
    calibrated values. ``merge_lora`` undoes the wrapping for saving.
    """
    from peft import LoraConfig, get_peft_model

    norm_modules = sorted({name for name, m in model.named_modules() if isinstance(m, ElementwiseNorm)})
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                        modules_to_save=norm_modules,  # matched by name suffix
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def merge_lora(model: nn.Module) -> nn.Module:
    """The plain model with LoRA weights merged in and the trained norm copies put back in place."""
    if not hasattr(model, "merge_and_unload"):
        return model
    return model.merge_and_unload()


def parameter_groups(model: nn.Module, *, lr: float, weight_decay: float, shape_lr: float | None = None,
                     gamma_lr: float | None = None, decay_names: set[str] | None = None) -> list[dict]:
    """Optimizer groups: element-wise shape parameters (at ``shape_lr`` times :func:`shape_lr_factors`), their
    gamma and bias (both without weight decay, each with its own learning rate), then the rest split by
    ``decay_names`` as the Trainer does. Empty groups are dropped."""
    kinds, factors = norm_parameter_names(model), shape_lr_factors(model)
    groups = {key: [] for key in ("gamma", "decay", "no_decay")}
    shape_groups: dict[int, list] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        kind = kinds.get(name)
        if kind == "shape":
            shape_groups.setdefault(factors[name], []).append(param)
        elif kind in ("gamma", "bias"):
            groups["gamma"].append(param)
        elif decay_names is not None and name in decay_names:
            groups["decay"].append(param)
        else:
            groups["no_decay"].append(param)
    settings = {"gamma": dict(lr=gamma_lr or lr, weight_decay=0.0),
                "decay": dict(lr=lr, weight_decay=weight_decay),
                "no_decay": dict(lr=lr, weight_decay=0.0)}
    shape = [{"params": params, "name": "shape", "lr": (shape_lr or lr) * factor, "weight_decay": 0.0}
             for factor, params in shape_groups.items()]
    return shape + [{"params": params, "name": key, **settings[key]} for key, params in groups.items() if params]


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
                      mask: torch.Tensor | None = None, chunk: int = 1024) -> torch.Tensor:
    """``T^2 * KL(softmax(teacher / T) || softmax(student / T))``, averaged over positions (``mask`` selects them).

    Computed in fp32 over chunks of positions, so a 50k-token vocabulary does not need three full-size copies.
    """
    vocab = student_logits.shape[-1]
    student, teacher = student_logits.reshape(-1, vocab), teacher_logits.reshape(-1, vocab)
    if mask is not None:
        keep = mask.reshape(-1).bool()
        student, teacher = student[keep], teacher[keep]
    if student.shape[0] == 0:
        return student_logits.sum() * 0.0
    total = student.new_zeros((), dtype=torch.float32)
    for start in range(0, student.shape[0], chunk):
        s = F.log_softmax(student[start:start + chunk].float() / temperature, dim=-1)
        t = F.log_softmax(teacher[start:start + chunk].float() / temperature, dim=-1)
        total = total + F.kl_div(s, t, log_target=True, reduction="sum")
    return total / student.shape[0] * temperature ** 2


def freeze_embeddings(model: nn.Module) -> int:
    """Stop training the input embeddings and the output head (one matrix when tied): in SmolLM2 they are a fifth
    of the parameters, and the head's weight gradient is one of the step's largest matmuls. Returns the count of
    parameters that still train."""
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        if module is not None:
            module.requires_grad_(False)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# Rates that transformers' attention code reads as plain floats (``dropout=0.0 if not self.training else
# self.attention_dropout``) rather than through an ``nn.Dropout`` module: the names its modelling files use.
DROPOUT_RATES = ("attention_dropout", "dropout", "dropout_p", "dropout_prob", "attn_dropout", "attn_drop")


def disable_dropout(model: nn.Module) -> int:
    """Set every dropout rate of ``model`` to 0 for training, as TRL's ``disable_dropout_in_model`` does, and
    attention rates held as floats too. The student is fitted to the original's exact outputs: with dropout each step
    fits a randomly thinned network instead, which held all-MiniLM-L6-v2 (0.1 in its config) at a cosine of 0.97
    (BENCHMARKS.md, "MiniLM"). The config is left as it is, so a saved checkpoint keeps its dropout for later training.
    Returns how many rates were above 0."""
    changed = 0
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            changed += module.p > 0
            module.p = 0.0
        for name in DROPOUT_RATES:
            rate = vars(module).get(name)
            if isinstance(rate, float):
                changed += rate > 0
                setattr(module, name, 0.0)
    return changed


def _forwards(model: nn.Module, teacher: nn.Module, inputs: dict, *, head_chunk: int, hidden_states: bool):
    """``(student outputs, teacher outputs, heads)`` of one batch, the teacher's under no_grad. ``head_chunk`` > 0:
    both output heads bypassed (:func:`hf_normswap.head_loss.head_bypassed`): ``.logits`` hold the hidden states
    that enter them and ``heads`` is ``(student head, teacher head)``; 0: full logits, ``heads`` None."""
    extra = {"output_hidden_states": True} if hidden_states else {}
    teacher_inputs = dict(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"), **extra)
    if not head_chunk:
        outputs = model(**inputs, **extra)
        with torch.no_grad():
            return outputs, teacher(**teacher_inputs), None
    with head_bypassed(_unwrapped(model)) as head:
        outputs = model(**{k: v for k, v in inputs.items() if k != "labels"}, **extra)
    with torch.no_grad(), head_bypassed(teacher) as teacher_head:
        return outputs, teacher(**teacher_inputs), (head, teacher_head)


def _logit_terms(outputs, reference, heads, inputs: dict, *, distill_weight: float, temperature: float,
                 logits: bool, head_chunk: int):
    """``((1 - w) * CE + w * KD, CE, KD)`` of :func:`_forwards`' outputs (KD left out when ``logits`` is false)."""
    mask = inputs.get("attention_mask")
    zero = torch.zeros((), device=inputs["input_ids"].device)
    kd_weight = distill_weight if logits else 0.0
    if heads is not None:
        if not (1.0 - distill_weight or kd_weight):  # hidden states alone: nothing goes through the heads
            return zero, zero, zero
        return head_loss(outputs.logits, heads[0].weight, inputs["labels"], teacher_hidden=reference.logits,
                         teacher_weight=heads[1].weight, kd_mask=mask, ce_weight=1.0 - distill_weight,
                         kd_weight=kd_weight, temperature=temperature, chunk=head_chunk)
    ce = getattr(outputs, "loss", None)
    if ce is None and distill_weight < 1:
        raise ValueError("the model computes no loss of its own (a sentence encoder): set distill weight 1")
    ce = zero if ce is None else ce
    kd = distillation_loss(outputs.logits, reference.logits, temperature, mask) if logits else zero
    return (1.0 - distill_weight) * ce + distill_weight * kd, ce, kd


def distillation_step(model: nn.Module, teacher: nn.Module | None, inputs: dict, *, distill_weight: float,
                      temperature: float = 1.0, head_chunk: int = 0):
    """``(loss, ce, kd)`` of one batch: ``(1 - w) * CE + w * KD`` with the teacher's forward under no_grad.
    ``head_chunk`` > 0: from hidden states, chunked over tokens (no B x T x V logits); 0: from full logits."""
    outputs, reference, heads = _forwards(model, teacher, inputs, head_chunk=head_chunk, hidden_states=False)
    return _logit_terms(outputs, reference, heads, inputs, distill_weight=distill_weight, temperature=temperature,
                        logits=True, head_chunk=head_chunk)


def layerwise_step(model: nn.Module, teacher: nn.Module, inputs: dict, *, distill_weight: float,
                   temperature: float = 1.0, logits: bool = True, hidden_weight: float = 1.0,
                   sink_weight: float = 0.0, embedding_weight: float = 0.0, head_chunk: int = 0):
    """``(loss, ce, kd, hidden, embedding)``: ``(1 - w) * CE + w * (KD + h * H + e * E)`` with H the layer-wise loss
    (:func:`hf_normswap.layerwise.relative_hidden_error`) and E the pooled-embedding cosine error
    (:func:`hf_normswap.layerwise.embedding_cosine_error`); KD is left out when ``logits`` is false. A model without a
    loss of its own (a sentence encoder) needs ``w = 1``. ``head_chunk`` as :func:`distillation_step`."""
    outputs, reference, heads = _forwards(model, teacher, inputs, head_chunk=head_chunk, hidden_states=True)
    head_part, ce, kd = _logit_terms(outputs, reference, heads, inputs, distill_weight=distill_weight,
                                     temperature=temperature, logits=logits, head_chunk=head_chunk)
    mask = inputs.get("attention_mask")
    zero = torch.zeros((), device=inputs["input_ids"].device)
    hidden = relative_hidden_error(outputs.hidden_states, reference.hidden_states, mask, sink_weight) \
        if hidden_weight > 0 else zero
    embedding = embedding_cosine_error(outputs.hidden_states[-1], reference.hidden_states[-1], mask) \
        if embedding_weight > 0 else zero
    return head_part + distill_weight * (hidden_weight * hidden + embedding_weight * embedding), ce, kd, hidden, \
        embedding


def training_loss(model: nn.Module, teacher: nn.Module, inputs: dict, *, distill_weight: float,
                  temperature: float = 1.0, logits: bool = True, hidden_weight: float = 0.0, sink_weight: float = 0.0,
                  embedding_weight: float = 0.0, head_chunk: int = 0):
    """``(loss, ce, kd, hidden, embedding)`` of one batch as :class:`NormSwapTrainer` trains (``distill_weight`` > 0):
    the layer-wise step when there is a hidden-state term (the models' hidden states are needed), else the
    distillation step; ``head_chunk`` > 0: CE and KD through the chunked head loss."""
    if hidden_weight > 0 or embedding_weight > 0:
        return layerwise_step(model, teacher, inputs, distill_weight=distill_weight, temperature=temperature,
                              logits=logits, hidden_weight=hidden_weight, sink_weight=sink_weight,
                              embedding_weight=embedding_weight, head_chunk=head_chunk)
    loss, ce, kd = distillation_step(model, teacher, inputs, distill_weight=distill_weight, temperature=temperature,
                                     head_chunk=head_chunk)
    return loss, ce, kd, torch.zeros(()), torch.zeros(())


def training_step_precision(precision: str, student: nn.Module, teacher: nn.Module, inputs: dict, *,
                            device: torch.device | str = "cpu", head_chunk: int = DEFAULT_CHUNK, **loss_settings):
    """``precision`` ('auto' | 'fp32' | 'bf16') for training ``student``; ``auto`` times the training step
    (:func:`training_loss` with ``loss_settings``, or the model's own loss when ``distill_weight`` is 0, then
    backward) on the batch ``inputs`` (``input_ids``, optionally ``attention_mask``) in fp32 and under bf16
    autocast (:func:`precision.choose_precision`)."""
    from ..model_inputs import ends_in_hidden_states
    from ..precision import choose_precision

    if precision != "auto":
        return choose_precision(precision)
    student.to(device).train()
    teacher.to(device)
    inputs = {k: v.to(device) for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
    if not ends_in_hidden_states(teacher):
        inputs["labels"] = inputs["input_ids"]
    distilled = loss_settings.get("distill_weight", 0) > 0
    chunk = head_chunk_for(student, teacher, head_chunk) if distilled else 0

    def step():
        loss = training_loss(student, teacher, inputs, head_chunk=chunk, **loss_settings)[0] if distilled \
            else student(**inputs).loss
        loss.backward()
        student.zero_grad(set_to_none=True)

    return choose_precision("auto", step, device=device, repetitions=2)


def head_chunk_for(model: nn.Module, teacher: nn.Module, requested: int) -> int:
    """``requested`` when both output heads are plain linear maps (:func:`head_is_plain`), else 0 (full logits)."""
    return int(requested) if requested and head_is_plain(model) and head_is_plain(teacher) else 0


def without_autocast_wrapper(model: nn.Module) -> nn.Module:
    """``model`` with the autocast wrapper that accelerate sets on its forward under bf16 taken off (an instance
    attribute over the class's method), so that it is evaluated and saved as it reloads. accelerate's own
    ``unwrap_model(keep_fp32_wrapper=False)`` also strips transformers' forward decorators: hidden states go missing."""
    model.__dict__.pop("forward", None)
    model.__dict__.pop("_original_forward", None)
    return model


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (whose output head is the one to bypass)."""
    return getattr(model, "module", model)


class NormSwapTrainer(Trainer):
    """``Trainer`` with cross-entropy + distillation from a frozen ``teacher`` and element-wise norm parameter groups.

    ``distill_weight`` w: loss = (1 - w) * CE + w * (KD + h * H + e * E) (w = 0: plain fine-tuning, no teacher
    forward), with ``hidden_weight`` h and H the layer-wise loss (:func:`hf_normswap.layerwise.relative_hidden_error`,
    the first position weighted by ``sink_weight``), ``embedding_weight`` e and E the pooled-embedding cosine error
    (:func:`hf_normswap.layerwise.embedding_cosine_error`); ``logits=False`` drops KD (hidden states alone). The
    teacher is moved to the training device and never wrapped for DDP, so every process holds its own copy; it runs
    under the student's autocast (bf16 when the Trainer's ``bf16`` is set). ``head_chunk`` tokens at a time go
    through the output head (:mod:`hf_normswap.head_loss`) when both heads are plain linear maps (a sentence
    encoder has none); 0: full logits.

    Under FSDP2 (:mod:`hf_normswap.training.sharding`; on CPU too, where accelerate would fall back to DDP) the
    student is sharded by accelerate when training starts, and the teacher here at once when ``shard_teacher``
    (else every process holds it whole); the shard units are logged when training begins.
    """

    def __init__(self, *args, teacher: nn.Module | None = None, distill_weight: float = 0.0,
                 temperature: float = 1.0, logits: bool = True, hidden_weight: float = 0.0, sink_weight: float = 0.0,
                 embedding_weight: float = 0.0, shape_lr: float | None = None, gamma_lr: float | None = None,
                 head_chunk: int = DEFAULT_CHUNK, shard_teacher: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        if distill_weight > 0 and teacher is None:
            raise ValueError("distill_weight > 0 needs the original model as teacher")
        self.teacher = teacher
        self.distill_weight = float(distill_weight)
        self.temperature = float(temperature)
        self.logits, self.hidden_weight, self.sink_weight = bool(logits), float(hidden_weight), float(sink_weight)
        self.embedding_weight = float(embedding_weight)
        hidden_terms = self.hidden_weight > 0 or self.embedding_weight > 0
        if not self.logits and not hidden_terms:
            raise ValueError("distillation without logits needs hidden_weight or embedding_weight > 0")
        self.shape_lr, self.gamma_lr = shape_lr, gamma_lr
        distilled = teacher is not None and self.distill_weight > 0
        self.teacher_sharded = self.fsdp2 and distilled and shard_teacher
        # loaded once a node, the teacher is on the meta device outside the main process until it is sharded
        from_main = self.teacher_sharded and sharding.loads_once()
        if distilled:
            (self.teacher if from_main else self.teacher.to(self.args.device)).eval().requires_grad_(False)
            self.loss_is_scaled_for_ga = False  # compute_loss returns a per-batch mean: let the Trainer divide
        # decided here, before accelerate wraps the forward in autocast: the check compares fp32 logits exactly; by
        # the main process's forward where the others hold models on the meta device
        from_main_forward = distilled and sharding.loads_once() and self.accelerator.num_processes > 1
        measured = distilled and (self.accelerator.is_main_process or not from_main_forward)
        chunk = [head_chunk_for(self.model, teacher, int(head_chunk or 0)) if measured else 0]
        if from_main_forward:
            from accelerate.utils import broadcast_object_list

            chunk = broadcast_object_list(chunk)
        self.head_chunk = chunk[0]
        self._component_sums = dict.fromkeys(self.COMPONENTS, 0.0) | {"count": 0}
        if self.fsdp2:
            sharding.vectors_for_scalars(self.model)  # before the optimizer is made on its parameters
            if from_main:
                sharding.shard_from_main(self.teacher, self.accelerator.is_main_process, self.args.device)
            elif self.teacher_sharded:
                sharding.shard(self.teacher)
            self.add_callback(sharding.ShardingLog(self.teacher if distilled else None))

    @property
    def fsdp2(self) -> bool:
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        return plugin is not None and plugin.fsdp_version == 2

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if sharding.adopt_fsdp2_on_cpu(self.accelerator):  # accelerate would run DDP here (module doc)
            self.is_fsdp_enabled = True

    COMPONENTS = ("ce_loss", "kd_loss", "hidden_loss", "embedding_loss")

    def create_optimizer(self, model=None):
        opt_model = self.model if model is None else model
        if self.optimizer is None:
            groups = parameter_groups(opt_model, lr=self.args.learning_rate, weight_decay=self.args.weight_decay,
                                      shape_lr=self.shape_lr, gamma_lr=self.gamma_lr,
                                      decay_names=set(self.get_decay_parameter_names(opt_model)))
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            optimizer_kwargs.pop("lr", None)  # each group carries its own
            self.optimizer = optimizer_cls(groups, lr=self.args.learning_rate, **optimizer_kwargs)
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.distill_weight == 0 or not model.training:  # evaluation: plain cross-entropy, for perplexity
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        with self.accelerator.autocast():  # the teacher and the head loss as the student's forward (bf16 or not)
            loss, *components = training_loss(model, self.teacher, inputs, distill_weight=self.distill_weight,
                                              temperature=self.temperature, logits=self.logits,
                                              hidden_weight=self.hidden_weight, sink_weight=self.sink_weight,
                                              embedding_weight=self.embedding_weight, head_chunk=self.head_chunk)
        if self.teacher_sharded:  # its root kept its gathered weights for the head loss until here (its blocks
            self.teacher.reshard()  # free theirs after their forward)
        for key, value in zip(self.COMPONENTS, components):
            self._component_sums[key] += float(value.detach())
        self._component_sums["count"] += 1
        return (loss, None) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "eval_loss" in logs:
            logs["eval_perplexity"] = math.exp(min(logs["eval_loss"], 700.0))
        if "loss" in logs and self._component_sums["count"]:
            count = self._component_sums.pop("count")
            for key in self.COMPONENTS:
                logs[key] = round(self._component_sums[key] / count, 6)
            self._component_sums = dict.fromkeys(self.COMPONENTS, 0.0) | {"count": 0}
        if "loss" in logs and self.optimizer is not None:
            logs.update(group_learning_rates(self.optimizer))
        super().log(logs, start_time)


def group_learning_rates(optimizer) -> dict[str, float]:
    """``{"learning_rate/NAME": rate}`` for each optimizer group: the Trainer's own ``learning_rate`` is the first
    group's only, which here is the shape parameters' (often 100x the base rate)."""
    rates, counts = {}, {}
    for group in optimizer.param_groups:
        name = group.get("name", "group")
        counts[name] = counts.get(name, 0) + 1
        rates[f"learning_rate/{name}" + (f" {counts[name]}" if counts[name] > 1 else "")] = group["lr"]
    return rates


class WallClockStop(TrainerCallback):
    """Stop (and save a checkpoint) once ``minutes`` of training have passed in this launch: a time budget that
    holds whatever the machine's speed, where ``max_steps`` would have to be guessed."""

    def __init__(self, minutes: float):
        self.seconds = minutes * 60
        self.start = None

    def on_train_begin(self, args, state, control, **kwargs):
        import time

        self.start = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        import time

        over = self.start is not None and time.monotonic() - self.start > self.seconds
        if torch.distributed.is_available() and torch.distributed.is_initialized():  # all ranks stop at one step
            flag = torch.tensor(float(over), device=args.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            over = bool(flag.item())
        if over:
            control.should_training_stop = True
            control.should_save = True
        return control
