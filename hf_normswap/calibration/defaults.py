"""The calibration a conversion gets when it names none: small, cheap, and needing no dataset and no network.

Without calibration, the analytic start leaves a pretrained model unusable (perplexity ratios beyond 1e100 on
SmolLM2), and the command users type first names no data. So ``convert`` and ``sensitivity`` calibrate by default:

- a model that can sample (a causal language model with its tokenizer) on its own samples (``generated``), a few
  short sequences drawn once and cached, with the block strategy at a few steps a block;
- an encoder (no language-model head, so nothing to sample) on the offline text shipped with Python
  (``builtin``), with the encoder strategy at fewer steps;
- a model without a tokenizer on nothing: the start measured from one forward pass on random token ids
  (``input_scales.measured_start``), which ``convert`` takes for a missing calibration.

What each costs and gives is in BENCHMARKS.md, "Default conversion".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..data.generated import SamplingSettings
from ..model_inputs import ends_in_hidden_states, model_device, text_config
from .calibrate import CalibrationConfig

NONE = "none"  # ``--calib none``: no calibration, the analytic start
SAMPLES = "generated:length={length},batch_size={batch}"  # 16 sequences of 128 tokens (or the context) a batch
TEXT = "builtin"


@dataclass(frozen=True)
class Default:
    """One default calibration: its data, its size and its strategy's step counts."""

    data: str
    what: str  # how the one line names the data
    num_blocks: int
    block_len: int
    strategy: str
    steps: dict
    # a model on CUDA: the larger budget a GPU runs in about the CPU default's time (sequences a sampling batch,
    # num_blocks and steps replaced), e.g. 128 samples at 80 / 240 steps: 19.5x against 36.9x on the CPU
    on_cuda: dict = field(default_factory=dict)

    def budget(self, model: nn.Module) -> dict:
        """``batch`` (samples a generate call), ``num_blocks`` and the steps for ``model``'s device."""
        budget = dict(batch=16, num_blocks=self.num_blocks, **self.steps)
        if model_device(model).type == "cuda":
            budget.update(self.on_cuda)
        return budget

    def spec(self, model: nn.Module, num_blocks: int | None = None, block_len: int | None = None) -> str:
        """The data spec for ``model``: ``num_blocks`` samples (the budget's ``batch`` at most a generate call) of
        ``block_len`` tokens (the default's), within its context."""
        block_len = block_len or self.block_len
        budget = self.budget(model)
        context = getattr(text_config(model), "max_position_embeddings", None) or block_len
        return self.data.format(length=min(block_len, context), batch=min(num_blocks or budget["num_blocks"],
                                                                          budget["batch"]))

    def config(self, model: nn.Module, tokenizer, **settings) -> CalibrationConfig:
        """The :class:`CalibrationConfig`; ``settings`` (the user's own choices) win over the default's."""
        budget = self.budget(model)
        steps = {key: value for key, value in budget.items() if key not in ("batch", "num_blocks")}
        chosen = dict(data=self.spec(model, settings.get("num_blocks"), settings.get("block_len")),
                      num_blocks=budget["num_blocks"], block_len=self.block_len, strategy=self.strategy,
                      **(steps if settings.get("strategy") in (None, self.strategy) else {}))
        chosen.update({key: value for key, value in settings.items() if value is not None})
        return CalibrationConfig(tokenizer=tokenizer, **chosen)

    def line(self, config: CalibrationConfig) -> str:
        return (f"calibrating on {config.num_blocks} {self.what}; --calib DATA for your own text, --calib none for "
                "the analytic start")


DEFAULTS = {
    "samples": Default(SAMPLES, "samples of the original", num_blocks=16, block_len=128, strategy="block",
                       steps={"block_steps": 20, "tune_steps": 60},
                       on_cuda={"batch": 128, "num_blocks": 128, "tune_blocks": 128, "block_steps": 80,
                                "tune_steps": 240}),
    "text": Default(TEXT, "paragraphs of the offline text", num_blocks=16, block_len=128, strategy="encoder",
                    steps={"tune_steps": 100}),
}


def can_sample(model: nn.Module) -> bool:
    """Whether ``model`` can draw the default samples: decoder-only, with a language-model head, ``generate`` and
    the context for them."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    try:
        SamplingSettings.from_spec(DEFAULTS["samples"].spec(model)).check_model(model)
    except ValueError:
        return False
    return True


def default_for(model: nn.Module, tokenizer) -> Default | None:
    """The default calibration of ``model``: its own samples, the offline text for an encoder, or None (no
    tokenizer, or a model that is neither: the measured start)."""
    if tokenizer is None:
        return None
    if can_sample(model):
        return DEFAULTS["samples"]
    if ends_in_hidden_states(model):
        return DEFAULTS["text"]
    return None


def default_calibration(model: nn.Module, tokenizer, **settings) -> tuple[CalibrationConfig | None, str | None]:
    """(the calibration a conversion that names none gets, the line that says so), or (None, None) for the
    measured start; ``settings`` are :class:`CalibrationConfig` fields the caller chose (None: the default's)."""
    default = default_for(model, tokenizer)
    if default is None:
        return None, None
    config = default.config(model, tokenizer, **settings)
    return config, default.line(config)
