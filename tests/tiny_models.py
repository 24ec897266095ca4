"""Tiny random models from configs, one per architecture family the tool must handle (no Hub access), and random
element-wise modules."""

from __future__ import annotations

import string

import torch
import transformers

COMMON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=64)
DECODER = dict(COMMON, num_key_value_heads=2)

# model_type -> (config overrides, model class name)
TINY = {
    "gpt2": (dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64), "GPT2LMHeadModel"),
    "gpt_neox": (dict(COMMON), "GPTNeoXForCausalLM"),
    "opt": (dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                 word_embed_proj_dim=32, max_position_embeddings=64), "OPTForCausalLM"),
    "bloom": (dict(vocab_size=128, hidden_size=32, n_layer=2, n_head=4), "BloomForCausalLM"),
    "falcon": (dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    new_decoder_architecture=True, num_kv_heads=2), "FalconForCausalLM"),
    "phi": (dict(COMMON), "PhiForCausalLM"),
    "phi3": (dict(DECODER, pad_token_id=0), "Phi3ForCausalLM"),
    "llama": (dict(DECODER), "LlamaForCausalLM"),
    "mistral": (dict(DECODER), "MistralForCausalLM"),
    "mixtral": (dict(DECODER, num_local_experts=4, num_experts_per_tok=2), "MixtralForCausalLM"),
    "qwen2": (dict(DECODER), "Qwen2ForCausalLM"),
    "qwen3": (dict(DECODER, head_dim=8), "Qwen3ForCausalLM"),
    "gemma": (dict(DECODER, head_dim=8), "GemmaForCausalLM"),
    "gemma2": (dict(DECODER, head_dim=8), "Gemma2ForCausalLM"),
    "gemma3_text": (dict(DECODER, head_dim=8, sliding_window=16), "Gemma3ForCausalLM"),
    "olmo": (dict(DECODER), "OlmoForCausalLM"),
    "olmo2": (dict(DECODER), "Olmo2ForCausalLM"),
    "cohere": (dict(DECODER), "CohereForCausalLM"),
    "starcoder2": (dict(DECODER), "Starcoder2ForCausalLM"),
    "stablelm": (dict(DECODER), "StableLmForCausalLM"),
    "bert": (dict(COMMON), "BertForMaskedLM"),
    "roberta": (dict(COMMON, pad_token_id=1), "RobertaForMaskedLM"),
    "t5": (dict(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                decoder_start_token_id=0), "T5ForConditionalGeneration"),
    "bart": (dict(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                  max_position_embeddings=64), "BartForConditionalGeneration"),
    "vit": (dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
                 patch_size=4), "ViTModel"),
    "whisper": (dict(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                     max_source_positions=16, max_target_positions=32, decoder_start_token_id=1, pad_token_id=0,
                     bos_token_id=1, eos_token_id=2, suppress_tokens=None, begin_suppress_tokens=None),
                "WhisperForConditionalGeneration"),
}
ARCHITECTURES = sorted(TINY)


def tiny_config(model_type: str, **changes):
    overrides, _ = TINY[model_type]
    return transformers.AutoConfig.for_model(model_type, **dict(overrides, **changes))


def tiny_model(model_type: str, seed: int = 0, randomize_norms: bool = True, **changes):
    """A tiny random model; norm weights are randomized so a wrong weight mapping cannot pass unnoticed.
    ``changes`` override config values."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, **changes)
    model = getattr(transformers, TINY[model_type][1])(config).eval()
    if randomize_norms:
        with torch.no_grad():
            for module in model.modules():
                if "Norm" in type(module).__name__:
                    for param in module.parameters(recurse=False):
                        param.add_(0.1 * torch.randn_like(param))
    return model


def random_elementwise(cls, size: int, *, shape: float, amplitude: float, per_channel: bool = False,
                       bias: bool = True, dtype: torch.dtype = torch.float32):
    """A ``cls`` (an element-wise norm) module with weight amplitude + N(0, 1), bias N(0, 1), shape parameter(s)
    drawn from ``shape`` x U(0.5, 1.5) and scalar extras (Derf's shift) from 0.3 x N(0, 1): no parameter at a special
    value that could hide a wrong formula."""
    torch.manual_seed(0)
    module = cls(size, shape, per_channel=per_channel, bias=bias, amplitude=amplitude)
    with torch.no_grad():
        module.weight.add_(torch.randn(size))
        if bias:
            module.bias.copy_(torch.randn(size))
        module.set_shape_parameter(shape * (torch.rand(size if per_channel else ()) + 0.5))
        for extra in module.extras():  # Derf's shift
            extra.copy_(0.3 * torch.randn(extra.shape))
    return module.to(dtype)


def tiny_tokenizer(vocab_size: int = 128):
    """A byte-level BPE tokenizer over printable ASCII with ``vocab_size`` ids (the tiny models' vocabulary), trained
    offline in a fraction of a second, with ``<s>`` / ``</s>`` / ``<unk>``: what a Hub repository ships beside the
    weights."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tokenizer.train_from_iterator([string.printable, "the model of the norm and the data in the text " * 4], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")


def full_length_tokenizer():
    """:func:`tiny_tokenizer` without an EOS token: every sampled sequence runs to its full length, so counts of
    sampled batches are exact (with EOS, a sequence that samples it early is topped up by a further batch)."""
    tokenizer = tiny_tokenizer()
    tokenizer.eos_token = None
    return tokenizer
