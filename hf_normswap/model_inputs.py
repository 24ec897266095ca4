"""Model inputs and outputs: the device a loaded model's inputs go to, small random inputs any supported model accepts
(for probing roles and smoke tests), what kind of model it is (:class:`ModelFacts`), the main tensor of an output,
and a forward pass without a KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .offload import first_weight_device, is_offloaded

PROBE_SEQUENCES, PROBE_LENGTH = 4, 64


def model_device(model: nn.Module) -> torch.device:
    """Where the model's inputs go: the device of its input embeddings, else of its first parameter (every part of
    a model loaded by ``normswap`` sits on one device; a model placed by hand may not); for weights left on disk
    (``offload.py``), where they are brought to compute."""
    try:
        embeddings = model.get_input_embeddings()
        device = embeddings.weight.device
    except (AttributeError, NotImplementedError):
        embeddings, device = model, next(model.parameters()).device
    if device.type == "meta":
        return first_weight_device(embeddings) or first_weight_device(model) or device
    return device


def text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def context_length(model: nn.Module) -> int | None:
    """The positions the model's config gives it (``n_positions`` / ``max_position_embeddings`` / ``n_ctx``)."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, attr, None)
        if value is not None:
            return int(value)
    return None


def check_context(lengths: dict, model: nn.Module, name: str = "the model") -> None:
    """Every length of ``lengths`` (setting or flag -> tokens; None: unset) within the model's context: a longer one
    indexes past its position table, an IndexError (or a silent cut) after all the work before it. The one check of
    a length against the context, for every setting that gives one; ValueError naming the setting and the model."""
    context = context_length(model)
    for key, length in lengths.items():
        if length is not None and context is not None and length > context:
            raise ValueError(f"{key} {length} is longer than the context of {name} ({context} tokens); give at most "
                             f"{context}")


def dummy_inputs(model: nn.Module, batch: int = 2, seq_len: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs for ``model(**inputs)`` built from its config: token ids, pixels or audio features as it expects.

    Raises ``ValueError`` for an input type it does not know.
    """
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    device = model_device(model)
    float_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    main = getattr(model, "main_input_name", "input_ids")
    inputs: dict[str, torch.Tensor] = {}
    if main == "input_ids":
        vocab = getattr(text_config(model), "vocab_size", None) or 100
        inputs["input_ids"] = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    elif main == "pixel_values":
        size = getattr(config, "image_size", 224)
        size = size if isinstance(size, int) else size[0]
        channels = getattr(config, "num_channels", 3)
        inputs["pixel_values"] = torch.randn(batch, channels, size, size, generator=generator)
    elif main == "input_features":
        frames = 2 * getattr(config, "max_source_positions", 1500)
        inputs["input_features"] = torch.randn(batch, config.num_mel_bins, frames, generator=generator)
    else:
        raise ValueError(f"no dummy input for main input {main!r}")
    if getattr(config, "is_encoder_decoder", False):
        start = getattr(config, "decoder_start_token_id", None) or 0
        inputs["decoder_input_ids"] = torch.full((batch, seq_len), start, dtype=torch.long)
        inputs["decoder_input_ids"][:, 1:] = torch.randint(
            0, text_config(model).vocab_size, (batch, seq_len - 1), generator=generator
        )
    return {k: v.to(device=device, dtype=float_dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


def probe_ids(model: nn.Module, sequences: int = PROBE_SEQUENCES, length: int = PROBE_LENGTH,
              seed: int = 0) -> dict[str, torch.Tensor]:
    """Random token ids from the model's vocabulary, BOS first where it has one, on the model's device (a model
    of images or audio: random pixels or features, :func:`dummy_inputs`)."""
    if getattr(model, "main_input_name", "input_ids") != "input_ids":
        return dummy_inputs(model, batch=sequences, seed=seed)
    config = text_config(model)
    embeddings = model.get_input_embeddings()
    vocab = getattr(embeddings, "num_embeddings", None) or config.vocab_size
    length = min(length, (getattr(config, "max_position_embeddings", None) or 2 * length) // 2)  # RoBERTa offsets
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sequences, length), generator=generator)
    pad = getattr(config, "pad_token_id", None)
    if isinstance(pad, int):  # a padding id would be an input the model never sees unmasked
        ids[ids == pad] = (pad + 1) % vocab
    bos = getattr(config, "bos_token_id", None)
    if isinstance(bos, int) and 0 <= bos < vocab:
        ids[:, 0] = bos
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if getattr(model.config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids
    return {key: value.to(model_device(model)) for key, value in inputs.items()}


def is_causal_lm(model: nn.Module) -> bool:
    """A decoder-only model that predicts the next token (by its class name, or because it can generate): it reads
    contiguous token blocks and is scored by perplexity. Encoder-decoder models are not: they read sentences."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    can_generate = getattr(model, "can_generate", None)
    looks_causal = any(k in type(model).__name__ for k in ("CausalLM", "LMHead"))
    return looks_causal or (callable(can_generate) and can_generate())


def is_encoder(model: nn.Module) -> bool:
    """A model that encodes text but predicts no next token (BERT, MiniLM): scored by its embeddings instead."""
    return not getattr(getattr(model, "config", None), "is_encoder_decoder", False) and not is_causal_lm(model)


def ends_in_hidden_states(model: nn.Module) -> bool:
    """Whether the model has no output head (a sentence encoder such as MiniLM): its output is hidden states, so
    calibration, the sensitivity map and the recipe compare embeddings instead of logits."""
    head = getattr(model, "get_output_embeddings", None)
    return head is not None and head() is None


@dataclass(frozen=True)
class ModelFacts:
    """What a stage asks of a loaded model before it runs it, read in one place: where its inputs go, whether it
    predicts the next token, whether it ends in hidden states (no output head), whether weights stay on disk."""

    device: torch.device
    causal_lm: bool
    hidden_states: bool
    on_disk: bool

    @classmethod
    def read(cls, model: nn.Module) -> ModelFacts:
        """The facts read off ``model`` where it is now (they go stale if it moves)."""
        return cls(device=model_device(model), causal_lm=is_causal_lm(model),
                   hidden_states=ends_in_hidden_states(model), on_disk=is_offloaded(model))


def first_tensor(output) -> torch.Tensor:
    """The main tensor of a module or model output (logits, last hidden state, or the first tuple element)."""
    if isinstance(output, torch.Tensor):
        return output
    for key in ("logits", "last_hidden_state"):
        value = getattr(output, key, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, (tuple, list)):
        return first_tensor(output[0])
    if hasattr(output, "to_tuple"):
        return first_tensor(output.to_tuple()[0])
    raise TypeError(f"no tensor in output of type {type(output).__name__}")


def forward_without_cache(model: nn.Module, batch: dict):
    """``model(**batch)`` without a KV cache, which calibration never reuses."""
    kwargs = {"use_cache": False} if getattr(model.config, "use_cache", None) is not None else {}
    return model(**batch, **kwargs)


class StopForward(Exception):
    """Raised by a hook to end a forward pass early once everything needed is captured."""


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``(batch, dim)``: the attention-mask-weighted mean over positions of ``(batch, seq, dim)`` hidden states."""
    hidden = hidden.float()
    if attention_mask is None:
        return hidden.mean(1)
    mask = attention_mask.unsqueeze(-1).to(hidden)
    return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1)
