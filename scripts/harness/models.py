"""The models the speed benchmarks time: SmolLM2-135M (packaged), its shapes with random weights, a tiny GPT-2;
and a model's converted and folded copies."""

from __future__ import annotations

import copy

import torch
import transformers

from hf_normswap import CalibrationConfig, convert, fold, load_model

MODELS = ("smollm2", "smollm2-random", "gpt2")


def gpt2_model():
    config = transformers.GPT2Config(vocab_size=8192, n_embd=256, n_layer=4, n_head=4, n_positions=512)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval(), config.vocab_size


def smollm2_model():
    model = load_model("offline:smollm2", with_tokenizer=False)[0]
    return model, model.config.vocab_size


def smollm2_random_model(layers: int = 30):
    """SmolLM2-135M's shapes with random weights: its speed without its package (no GGUF reader, no download)."""
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                      num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval(), config.vocab_size


def load(name: str, layers: int = 30):
    """(model, vocabulary size) of ``smollm2``, ``smollm2-random`` (``layers`` of them) or ``gpt2``."""
    if name == "smollm2-random":
        return smollm2_random_model(layers)
    return {"smollm2": smollm2_model, "gpt2": gpt2_model}[name]()


def model_variants(original, method: str, calibrate: bool, vocab: int, seq: int):
    """The converted model and its folded copy. ``calibrate``: the ``fast`` strategy (``block``'s saturating
    per-channel start, no tuning steps) on 2 random blocks, seconds, so activations stay in the range a calibrated
    model has; the analytic conversion overflows on SmolLM2 (perplexity ~1e170), and timing it times
    non-finite arithmetic instead of the model."""
    converted = copy.deepcopy(original)
    calibration = None
    if calibrate:
        ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(3))
        calibration = CalibrationConfig(data=ids, num_blocks=2, block_len=seq, batch_size=2, strategy="fast",
                                        progress=False)
    convert(converted, to=method, calibration=calibration)
    folded = copy.deepcopy(converted)
    fold(folded)
    return converted, folded
