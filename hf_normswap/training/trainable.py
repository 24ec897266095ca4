"""What a recovery trains: the converted modules' parameters (``norms``), all weights, or LoRA adapters beside
them; the element-wise modules' parameters in their own optimizer groups (no weight decay, a learning rate for the
shape parameter, which lives on a log scale and wants a much larger step than the weights around it, and one for
gamma / bias); dropout off, embeddings frozen on request."""

from __future__ import annotations

from torch import nn

from ..modules import ElementwiseNorm


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
    from peft import LoraConfig, get_peft_model  # lazy: peft is optional (hf-normswap[finetune]), slow to import

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


def group_learning_rates(optimizer) -> dict[str, float]:
    """``{"learning_rate/NAME": rate}`` for each optimizer group: the Trainer's own ``learning_rate`` is the first
    group's only, which here is the shape parameters' (often 100x the base rate)."""
    rates, counts = {}, {}
    for group in optimizer.param_groups:
        name = group.get("name", "group")
        counts[name] = counts.get(name, 0) + 1
        rates[f"learning_rate/{name}" + (f" {counts[name]}" if counts[name] > 1 else "")] = group["lr"]
    return rates


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
