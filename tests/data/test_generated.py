"""The original's own samples as a text source: cached, resumed without repeats, split between processes."""

from __future__ import annotations

import pytest
import torch
from tiny_models import full_length_tokenizer, tiny_model, tiny_tokenizer

from hf_normswap.data import packed_linear
from hf_normswap.data import DataError, load_texts
from hf_normswap.data.generated import DrawShare, SampleCache, SamplingSettings, draw, sample_texts

SETTINGS = SamplingSettings(length=12, batch_size=3, seed=1, precision="fp32")  # auto is timed: it may vary
BUDGET = 12 * 3 * 3  # three batches


def _counting(model, calls: list):
    """``model`` with its generate calls recorded in ``calls``."""
    generate = model.generate
    model.generate = lambda **kw: calls.append(kw["input_ids"].shape) or generate(**kw)
    return model


@pytest.fixture(autouse=True)
def unpacked(monkeypatch):
    """Packing is timed too, and packed matmuls round differently: the tests that compare draws keep it off."""
    monkeypatch.setattr(packed_linear, "packing_speedup", lambda layers, packed, rows: 1.0)


@pytest.fixture()
def counted():
    calls = []
    return _counting(tiny_model("llama"), calls), calls


def test_a_second_call_reads_the_cache_without_sampling(counted, tmp_path):
    model, calls = counted
    tokenizer = full_length_tokenizer()
    first = sample_texts(model, tokenizer, SETTINGS, BUDGET, cache_dir=tmp_path, progress=False)
    assert len(calls) == 3 and len(first) == 9 and len(set(first)) == 9
    assert sample_texts(model, tokenizer, SETTINGS, BUDGET, cache_dir=tmp_path, progress=False) == first
    assert len(calls) == 3
    assert len(list(tmp_path.rglob("batch-*.safetensors"))) == 3 and not list(tmp_path.rglob("*.partial*"))


@pytest.mark.skipif(not packed_linear._ops_available(), reason="this torch has no oneDNN linear ops")
def test_a_draw_on_packed_weights_gives_full_samples_and_leaves_the_model_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setattr(packed_linear, "packing_speedup", lambda layers, packed, rows: 2.0)
    calls, packed_forward = [], packed_linear._packed_forward
    monkeypatch.setattr(packed_linear, "_packed_forward",
                        lambda inputs, **kw: calls.append(1) or packed_forward(inputs, **kw))
    model = tiny_model("llama")
    texts = sample_texts(model, full_length_tokenizer(), SETTINGS, BUDGET, cache_dir=tmp_path, progress=False)
    assert calls and len(texts) == 9 and len(set(texts)) == 9
    assert not any("forward" in module.__dict__ for module in model.modules())


def test_a_changed_setting_or_model_makes_a_new_cache(tmp_path):
    model = tiny_model("llama")
    caches = {SampleCache(model, SETTINGS, tmp_path).directory,
              SampleCache(model, SamplingSettings(length=12, batch_size=3, seed=1, temperature=0.5), tmp_path).directory,
              SampleCache(tiny_model("llama", seed=1), SETTINGS, tmp_path).directory}
    assert len(caches) == 3


def test_an_interrupted_draw_resumes_where_it_stopped_and_repeats_nothing(counted, tmp_path):
    model, calls = counted
    tokenizer = full_length_tokenizer()
    part = sample_texts(model, tokenizer, SETTINGS, 12 * 3, cache_dir=tmp_path, progress=False)  # one batch
    whole = sample_texts(model, tokenizer, SETTINGS, BUDGET, cache_dir=tmp_path, progress=False)
    assert len(calls) == 3 and whole[:3] == part and len(set(whole)) == 9  # only the two missing batches drawn
    fresh = sample_texts(tiny_model("llama"), tokenizer, SETTINGS, BUDGET, cache_dir=tmp_path / "fresh",
                         progress=False)
    assert fresh == whole  # each batch has its own seed: launches and processes do not change the text


def test_two_processes_draw_different_shares_of_one_text(tmp_path):
    """Rank 0 of 2 draws batches 0 and 2 and finds batch 1 missing; rank 1 draws only batch 1, then both read the
    same text, the text one process alone would have drawn."""
    tokenizer = full_length_tokenizer()
    first, second = [], []
    with pytest.raises(ValueError, match="1 of 3 batches .* were not drawn by the other processes"):
        sample_texts(_counting(tiny_model("llama"), first), tokenizer, SETTINGS, BUDGET,
                     share=DrawShare(rank=0, world_size=2, wait_seconds=0), cache_dir=tmp_path, progress=False)
    texts = sample_texts(_counting(tiny_model("llama"), second), tokenizer, SETTINGS, BUDGET,
                         share=DrawShare(rank=1, world_size=2), cache_dir=tmp_path, progress=False)
    assert (len(first), len(second)) == (2, 1)
    alone = sample_texts(tiny_model("llama"), tokenizer, SETTINGS, BUDGET, cache_dir=tmp_path / "one", progress=False)
    assert texts == alone and len(set(texts)) == 9


def test_two_runs_drawing_one_cache_at_once_draw_each_batch_once(tmp_path):
    """Two runs of the same original and settings (the ELN and DyT configs side by side) each drew every batch: the
    second waits on the batch's lock, then reads it."""
    import threading
    import time

    tokenizer, calls, start = full_length_tokenizer(), [], threading.Barrier(2)
    models = [_counting(tiny_model("llama"), calls) for _ in range(2)]
    for model in models:  # slow enough that both reach each batch while the other draws it
        generate = model.generate
        model.generate = lambda generate=generate, **kw: time.sleep(0.3) or generate(**kw)
    caches = [SampleCache(model, SETTINGS, tmp_path) for model in models]
    assert caches[0].directory == caches[1].directory
    results = []

    def run(model, cache):
        start.wait()
        results.append(draw(model, tokenizer, cache, [0, 1, 2], progress=False))

    threads = [threading.Thread(target=run, args=pair) for pair in zip(models, caches)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 3 and "fp32" in results  # each batch drawn once, by whichever run reached it first
    assert not list(caches[0].directory.glob("*.lock"))  # the locks leave no file
    alone = sample_texts(tiny_model("llama"), tokenizer, SETTINGS, BUDGET, cache_dir=tmp_path / "one", progress=False)
    assert sample_texts(models[0], tokenizer, SETTINGS, BUDGET, cache_dir=tmp_path, progress=False) == alone
    assert len(calls) == 3


@pytest.mark.parametrize("spec, message", [
    ("generated:temperature=0", "temperature must be above 0"),
    ("generated:top_p=0", "top_p must be in (0, 1]"),
    ("generated:top_p=1.5", "top_p must be in (0, 1]"),
    ("generated:length=0", "length must be a whole number of at least 1"),
    ("generated:tempreature=1", "is not one of temperature=..."),
    ("generated:length=abc", "length='abc' is not an integer (digits, e.g. 64)"),
    ("generated:batch_size=1e9", "batch_size='1e9' is not an integer (digits, e.g. 64)"),
    ("generated:length=65", "length 65 is longer than the context of the model (64 tokens)"),
])
def test_bad_settings_are_one_line(spec, message):
    with pytest.raises(DataError) as error:
        load_texts(spec, model=tiny_model("llama"), tokenizer=tiny_tokenizer(), max_tokens=64)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_model_without_a_language_model_head_or_no_model_is_refused():
    import transformers
    from tiny_models import tiny_config

    encoder = transformers.BertModel(tiny_config("bert"))
    with pytest.raises(DataError, match="needs a model with a language-model head"):
        load_texts("generated", model=encoder, tokenizer=tiny_tokenizer(), max_tokens=64)
    with pytest.raises(DataError, match="sampled from the original model"):
        load_texts("generated", tokenizer=tiny_tokenizer(), max_tokens=64)


def test_calibration_reads_the_originals_samples(tmp_path, monkeypatch):
    import hf_normswap
    from hf_normswap import CalibrationConfig

    monkeypatch.setenv("HF_NORMSWAP_CACHE", str(tmp_path))
    model = tiny_model("llama")
    config = CalibrationConfig(data="generated:length=16,batch_size=4", tokenizer=tiny_tokenizer(), num_blocks=4,
                               block_len=16, strategy="fast", progress=False)
    report = hf_normswap.convert(model, "eln", calibration=config)
    assert report.calibration["data"] == "generated:length=16,batch_size=4"
    assert report.calibration["tokens"] == 4 * 16  # 4 blocks of 16 (batches that ended early were topped up)
    drawn = sorted(tmp_path.rglob("batch-*.safetensors"))
    assert drawn and torch.isfinite(model(input_ids=torch.tensor([[1, 5, 9]])).logits).all()
    hf_normswap.convert(tiny_model("llama"), "eln", calibration=config)  # another conversion reads the same samples
    assert sorted(tmp_path.rglob("batch-*.safetensors")) == drawn


def test_the_sampler_draws_from_the_softmax_and_never_a_masked_token():
    from hf_normswap.data.generated import InverseCdfSampler

    scores = torch.tensor([0.0, 1.0, float("-inf"), 2.0, float("-inf")]).expand(40_000, 5).contiguous()
    torch.manual_seed(0)
    drawn = InverseCdfSampler()(None, scores.clone()).argmax(dim=-1)
    share = torch.bincount(drawn, minlength=5) / len(drawn)
    expected = torch.softmax(scores[0], dim=-1)
    assert share[2] == 0 and share[4] == 0
    assert torch.allclose(share, expected, atol=0.01)  # 3 standard errors of a share near 0.5 at 40,000 draws: 0.0075


def test_the_two_level_search_draws_across_blocks_and_the_tail_and_never_a_masked_token():
    from hf_normswap.data.generated import InverseCdfSampler

    block = InverseCdfSampler.BLOCK
    width = 2 * block + 7  # two whole blocks and a tail
    row = torch.full((width,), float("-inf"))
    allowed = [0, block - 2, block + 3, 2 * block + 1, width - 1]  # the first two blocks end masked
    row[allowed] = torch.tensor([1.0, 0.0, 2.0, 0.5, 1.5])
    scores = row.expand(40_000, width).contiguous()
    torch.manual_seed(0)
    drawn = InverseCdfSampler()(None, scores.clone()).argmax(dim=-1)
    share = torch.bincount(drawn, minlength=width) / len(drawn)
    expected = torch.softmax(row, dim=-1)
    assert share.sum() == 1 and share[allowed].sum() == 1  # no masked token, no token past the vocabulary
    assert torch.allclose(share, expected, atol=0.01)


def test_the_preallocated_cache_generates_what_the_default_cache_does():
    from hf_normswap.data.generated import PreallocatedLayer, cache_argument, preallocated_cache

    model = tiny_model("llama").eval()
    prompts = torch.tensor([[1, 5, 9], [1, 7, 3]])
    kwargs = dict(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=20,
                  min_new_tokens=20, pad_token_id=0)
    cache = preallocated_cache(model, 23)
    assert len(cache.layers) == model.config.num_hidden_layers
    assert all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
    assert torch.equal(model.generate(**kwargs, **{cache_argument(model): cache}), model.generate(**kwargs))
    assert cache.layers[0].key_buffer.shape[-2] == 23 and cache.get_seq_length() == 22


def test_the_cache_goes_to_generate_under_the_name_the_installed_transformers_takes():
    """Later transformers 5.x name generate's cache ``cache``, earlier ones (5.17) ``past_key_values`` and refuse
    ``cache`` as an unused model kwarg."""
    import inspect

    from hf_normswap.data.generated import cache_argument

    class EarlierForward(torch.nn.Module):
        def forward(self, input_ids=None, attention_mask=None, past_key_values=None, **kwargs):
            return input_ids

    model = tiny_model("llama")
    assert cache_argument(model) in inspect.signature(model.forward).parameters
    assert cache_argument(EarlierForward()) == "past_key_values"


def test_sliding_window_layers_keep_their_own_cache():
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from hf_normswap.data.generated import preallocated_cache

    model = tiny_model("mistral")
    model.config.sliding_window = 4
    layers = preallocated_cache(model, 16).layers
    assert len(layers) == model.config.num_hidden_layers
    assert all(type(layer) is DynamicSlidingWindowLayer for layer in layers)


def test_weights_are_cast_for_sampling_and_put_back_unrounded():
    from hf_normswap.precision import weights_in

    model = tiny_model("llama")
    before = {name: p.clone() for name, p in model.named_parameters()}
    with weights_in(model, torch.bfloat16):
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        model(input_ids=torch.tensor([[1, 5, 9]]))
    assert all(torch.equal(p, before[name]) and p.dtype == torch.float32 for name, p in model.named_parameters())


def test_the_sampling_precision_is_part_of_the_cache_key_and_of_each_batch(tmp_path, monkeypatch):
    import dataclasses

    from safetensors import safe_open

    from hf_normswap.data import generated
    from hf_normswap.data.generated import sampling_precision

    model = tiny_model("llama")
    for speedup, chosen in ((2.0, "bf16"), (0.5, "fp32")):  # fp32 weights: bf16 where its matmul is faster
        monkeypatch.setattr(generated, "matmul_speedup", lambda device, speedup=speedup: speedup)
        assert sampling_precision(model, "auto") == chosen
    monkeypatch.undo()
    assert sampling_precision(model.to(torch.bfloat16), "auto") == "bf16"
    model = tiny_model("llama")
    directories = {SampleCache(model, SamplingSettings(precision=p), tmp_path).directory
                   for p in ("auto", "fp32", "bf16")}
    assert len(directories) == 3
    cache = SampleCache(model, dataclasses.replace(SETTINGS, precision="bf16"), tmp_path)
    assert generated.draw(model, full_length_tokenizer(), cache, [0], progress=False) == "bf16"
    with safe_open(cache.path(0), "pt") as batch:
        assert batch.metadata() == {"precision": "bf16"}
    assert sampling_precision(tiny_model("llama").to(torch.float16), "auto") == "fp16"
    with pytest.raises(ValueError, match="precision must be auto, fp32, bf16, fp16"):
        SamplingSettings.from_spec("generated:precision=fp8")


def test_the_models_own_generation_defaults_do_not_shape_the_samples(tmp_path):
    """A repetition penalty or an n-gram ban in the model's generation_config would change the distribution sampled;
    the samples are those of a model without them, and the model's config is left as it was."""
    plain, tuned = tiny_model("llama"), tiny_model("llama")
    tuned.generation_config.repetition_penalty, tuned.generation_config.no_repeat_ngram_size = 1.5, 2
    texts = [sample_texts(model, full_length_tokenizer(), SETTINGS, BUDGET, cache_dir=tmp_path / name, progress=False)
             for name, model in (("plain", plain), ("tuned", tuned))]
    assert texts[0] == texts[1]
    assert (tuned.generation_config.repetition_penalty, tuned.generation_config.no_repeat_ngram_size) == (1.5, 2)


@pytest.mark.parametrize("mode", ["static", "compiled"])
def test_the_static_cache_and_the_compiled_decode_step_draw_the_same_tokens(tmp_path, monkeypatch, mode):
    """The CUDA branch (transformers' static cache, the decode step compiled) run on the CPU: the same seed gives
    the same samples as the packed path's preallocated cache; "compiled" runs inductor on the CPU."""
    from transformers import CompileConfig

    from hf_normswap.data.generated import draw

    model, tokenizer = tiny_model("llama"), full_length_tokenizer()
    # the static cache with the decode step left eager, or compiled by inductor
    config = CompileConfig(backend="eager") if mode == "static" else CompileConfig(mode="default")
    config._compile_all_devices = True  # transformers' switch for compiling on a CPU
    drawn, caches, compiles = {}, [], []
    model.register_forward_pre_hook(lambda module, args, kwargs: caches.append(
        type(kwargs.get("cache", kwargs.get("past_key_values"))).__name__), with_kwargs=True)
    compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *args, **kw: compiles.append(kw) or compile(*args, **kw))
    for name, compiled in (("preallocated", None), (mode, config)):
        cache = SampleCache(model, SETTINGS, tmp_path / name)
        caches.clear()
        draw(model, tokenizer, cache, [0, 1], progress=False, compiled=compiled)
        drawn[name] = [cache.read(0), cache.read(1)]
        assert caches[0] == ("DynamicCache" if compiled is None else "StaticCache")
    assert [kw["backend"] for kw in compiles] == ["eager" if mode == "static" else "inductor"]
    assert drawn[mode] == drawn["preallocated"]
    assert len({tuple(row) for batch in drawn[mode] for row in batch}) == 2 * SETTINGS.batch_size
