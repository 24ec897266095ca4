"""Calibration: bounded capture, least-squares fit, block pass, end-to-end tuning, strategy table, report, CLI flags.
Tiny models only."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from tiny_models import tiny_model

from hf_normswap import convert
from hf_normswap.calibration.activation_cache import ActivationCache
from hf_normswap.calibration.calibrate import CalibrationConfig
from hf_normswap.calibration.capture import NormSample, Reservoir, capturing
from hf_normswap.calibration.fitting import analytic_input_scale, fit_module, saturating_init
from hf_normswap.model_inputs import first_tensor
from hf_normswap.modules import ELN, DyT


def _cfg(**options) -> CalibrationConfig:
    return CalibrationConfig(**{"progress": False, "max_iter": 30, **options})


def _ids(rows=8, length=32, seed=1):
    return torch.randint(0, 128, (rows, length), generator=torch.Generator().manual_seed(seed))


def _kl(reference, model, ids) -> float:
    with torch.no_grad():
        p = first_tensor(reference(ids)).float().log_softmax(-1)
        q = first_tensor(model(ids)).float().log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def test_reservoir_keeps_cap_and_samples_uniformly():
    reservoir = Reservoir(200, 1, torch.Generator().manual_seed(0))
    for start in range(0, 100_000, 1000):  # each row holds its own index
        reservoir.add(torch.arange(start, start + 1000, dtype=torch.float32)[:, None])
    kept = reservoir.buffer[:, 0]
    assert reservoir.buffer.shape == (200, 1) and reservoir.seen == 100_000
    assert len(kept.unique()) == 200
    assert abs(float(kept.mean()) / 100_000 - 0.5) < 0.06  # uniform over everything seen, not the latest
    assert 0.35 < float((kept < 50_000).float().mean()) < 0.65


def test_capture_excludes_padding_and_flags_first_positions():
    model = tiny_model("llama")
    ids = _ids(4, 16) % 100
    mask = torch.ones_like(ids)
    mask[0, 10:] = 0  # right padding
    mask[1, :5] = 0  # left padding: the first real token is position 5
    ids[mask == 0] = 120  # a pad id no real token uses
    name = "model.layers.0.input_layernorm"
    with capturing({name: model.get_submodule(name)}, max_tokens=1000) as capture:
        capture.mask = mask
        model(input_ids=ids, attention_mask=mask)
    sample = capture.samples[name]
    assert sample.count == int(mask.sum())
    assert sample.first.buffer.shape[0] == 4 and sample.tokens.buffer.shape[0] == int(mask.sum()) - 4
    embeddings = model.get_input_embeddings()(ids)
    assert torch.allclose(sample.first.buffer[1], embeddings[1, 5])  # first real token of the left-padded row
    kept = sample.tokens.buffer
    for pad in (embeddings[0, 12], embeddings[1, 2]):
        assert not torch.isclose(kept, pad).all(-1).any()


def test_memory_stays_under_cap_with_large_calibration_set():
    model = tiny_model("llama")
    cap, first_cap = 64, 8
    ids = _ids(256, 64)  # 16384 tokens through every norm, 256 first positions
    report = convert(model, "eln", calibration=_cfg(
        data=ids, num_blocks=256, batch_size=32, max_tokens_per_norm=cap, max_first_per_norm=first_cap,
        strategy="fast"))
    summary = report.calibration
    assert summary["tokens"] == 256 * 64
    assert summary["capture_bytes_per_norm"] <= (cap + first_cap) * 32 * 4
    for c in report.converted:
        assert c.fit["tokens_seen"] == 256 * 64
        assert c.fit["tokens_kept"] == cap and c.fit["first_kept"] == first_cap


def test_sample_count_covers_everything_seen_not_just_what_is_kept():
    sample = NormSample(4, max_tokens=3, max_first=1, seed=0)
    x = torch.full((2, 5, 4), 2.0)
    sample.add(x, torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]))
    assert sample.count == 9 and (sample.tokens.seen, sample.first.seen) == (7, 2)
    assert sample.tokens.buffer.shape[0] == 3 and sample.first.buffer.shape[0] == 1


@pytest.mark.parametrize("cls,kind", [(ELN, "rmsnorm"), (DyT, "layernorm")])
def test_fit_recovers_known_shape_parameter(cls, kind):
    truth = cls(16, 3.0 if cls is ELN else 0.4, amplitude=4.0)
    x = torch.randn(500, 16) * 2
    with torch.no_grad():
        y = truth(x)
    module = cls(16, 50.0 if cls is ELN else 0.05, amplitude=4.0)
    stats = fit_module(module, x, y, params=("shape",))
    assert stats.loss < 1e-8 < stats.loss_before
    assert abs(float(module.shape_parameter().detach()) - float(truth.shape_parameter().detach())) < 1e-3


@pytest.mark.parametrize("arch,method", [("llama", "eln"), ("bert", "dyt")])
def test_calibrated_model_is_closer_than_analytic_init(arch, method):
    ids = _ids()
    reference = tiny_model(arch)
    analytic = tiny_model(arch)
    convert(analytic, method)
    calibrated = tiny_model(arch)
    report = convert(calibrated, method, calibration=_cfg(data=ids, batch_size=4, strategy="kl", tune_steps=0))
    assert report.calibration["mode"] == "sequential"
    kl_analytic, kl_calibrated = _kl(reference, analytic, ids[:4]), _kl(reference, calibrated, ids[:4])
    assert kl_calibrated < 0.5 * kl_analytic, (kl_calibrated, kl_analytic)
    for c in report.converted:  # every fit improves on its start (measured: 5-52 % lower)
        assert c.fit["stats"]["loss"] < 0.98 * c.fit["stats"]["loss_before"], c.fit["stats"]


def test_end_to_end_tuning_lowers_kl():
    ids = _ids()
    reference = tiny_model("llama")
    results = {}
    for steps in (0, 12):
        model = tiny_model("llama")
        report = convert(model, "eln", calibration=_cfg(data=ids, batch_size=4, strategy="kl", tune_steps=steps))
        results[steps] = (_kl(reference, model, ids[:4]), report)
    assert "tuning" not in results[0][1].calibration
    tuning = results[12][1].calibration["tuning"]
    assert tuning["objective"] == "kl" and tuning["steps"] == 12 and tuning["loss_after"] < tuning["loss_before"]
    assert results[12][0] < results[0][0], (results[12][0], results[0][0])


@pytest.mark.parametrize("cls", [ELN, DyT])
def test_saturating_init_keeps_the_slope_and_bounds_large_tokens(cls):
    x = torch.randn(400, 16, generator=torch.Generator().manual_seed(0)) * 2.0
    x[:, 3] += 6.0  # a channel that is large in every token
    w = torch.linspace(0.5, 1.5, 16)
    module = cls.from_norm(w, None, kind="rmsnorm", normalized_shape=(16,), per_channel=True)
    median_rms = x.pow(2).mean(-1).sqrt().median()
    saturating_init(module, x, "rmsnorm", analytic_input_scale(x, "rmsnorm"), knee=0.7)
    eps = 1e-3
    with torch.no_grad():
        slope = (module(torch.full((1, 16), eps)) - module(torch.full((1, 16), -eps)))[0] / (2 * eps)
        huge = module(x[:8] * 1000)  # an attention-sink-like token: 1000x the typical scale
    torch.testing.assert_close(slope, w / median_rms, rtol=1e-3, atol=1e-6)  # the norm's slope at zero
    ceiling = module.weight.detach()  # |f| < 1, so the output never exceeds weight = w * knee * s_c
    assert (huge.abs() <= ceiling * (1 + 1e-6)).all() and (huge.abs() > 0.9 * ceiling).float().mean() > 0.9
    relative = ceiling / w
    assert relative[3] > 2 * relative.median()  # the always-large channel gets a higher ceiling
    with pytest.raises(ValueError, match="per-channel"):
        saturating_init(cls(16, 1.0), x, "rmsnorm", 1.0)


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_block_tuning_lowers_every_block_error_and_the_output_error(arch):
    ids = _ids()
    reference = tiny_model(arch)
    start = tiny_model(arch)
    convert(start, "eln", calibration=_cfg(data=ids, batch_size=4, strategy="block", block_steps=0, tune_steps=0))
    tuned = tiny_model(arch)
    report = convert(tuned, "eln", calibration=_cfg(data=ids, batch_size=4, strategy="block", block_steps=25,
                                                    block_rows=2, tune_steps=0))
    rows = report.calibration["block_tuning"]
    final = ["model.norm"] if arch == "llama" else []  # the final norm is tuned after the blocks; BERT has none
    assert [r["block"] for r in rows] == list(range(tuned.config.num_hidden_layers)) + final
    assert all(r["error_after"] < 0.9 * r["error_before"] for r in rows), rows  # "never worse" alone could not fail
    if arch == "llama":
        assert _kl(reference, tuned, ids[:4]) < _kl(reference, start, ids[:4])
    else:
        with torch.no_grad():
            target = first_tensor(reference(ids[:4]))
            errors = [(first_tensor(m(ids[:4])) - target).norm() for m in (start, tuned)]
        assert errors[1] < errors[0]


def test_default_strategy_is_block_for_rmsnorm_models_kl_for_layernorm_heads_and_encoder_for_encoders():
    llama, bert = tiny_model("llama"), tiny_model("bert")
    encoder = transformers.BertModel(bert.config).eval()  # ends in hidden states, as sentence-transformers models do
    small = dict(data=_ids(), batch_size=4, block_steps=2, tune_steps=2)
    assert convert(llama, "eln", calibration=_cfg(**small)).calibration["strategy"] == "block"
    assert convert(bert, "eln", calibration=_cfg(**small)).calibration["strategy"] == "kl"
    report = convert(encoder, "eln", calibration=_cfg(**small))
    assert report.calibration["strategy"] == "encoder" and report.calibration["tuning"]["objective"] == "relative_mse"


def test_tuning_sequences_follow_the_strategy_unless_given():
    assert CalibrationConfig(strategy="block").resolved().tune_blocks == 16  # over 4 they overfit on SmolLM2
    assert CalibrationConfig(strategy="kl").resolved().tune_blocks == 4  # MiniLM: 4 beats 16 at 30 steps
    assert CalibrationConfig(strategy="encoder").resolved().tune_blocks == 64  # and 64 beats 4 and 16 at 300 steps
    assert CalibrationConfig(strategy="block", tune_blocks=2).resolved().tune_blocks == 2


def test_fast_strategy_is_the_saturating_start_alone_and_beats_the_analytic_one():
    ids = _ids()
    reference, analytic, fast = tiny_model("llama"), tiny_model("llama"), tiny_model("llama")
    convert(analytic, "eln", input_scale=1.0)
    report = convert(fast, "eln", calibration=_cfg(data=ids, batch_size=4, strategy="fast"))
    assert report.calibration["mode"] == "sequential"
    assert "block_tuning" not in report.calibration and "tuning" not in report.calibration  # nothing tuned
    shapes = [fast.get_submodule(c.name).shape_parameter() for c in report.converted]
    assert all(len(s.unique()) > 1 for s in shapes)  # per-channel, not the theory's scalar
    kl_analytic, kl_fast = _kl(reference, analytic, ids[:4]), _kl(reference, fast, ids[:4])
    assert kl_fast < 0.6 * kl_analytic, (kl_fast, kl_analytic)  # measured 0.0022 against 0.0064


def test_report_config_and_plots(tmp_path):
    model = tiny_model("llama")
    report = convert(model, "eln", calibration=_cfg(data=_ids(), batch_size=4, strategy="kl", tune_steps=2,
                                                    plots=str(tmp_path)))
    data = json.loads(report.to_json())
    row = data["converted"][0]["fit"]
    assert {"shape_mean", "gamma_mean", "stats"} <= set(row)
    assert {"loss", "rel_error", "rel_error_first", "saturation"} <= set(row["stats"])
    assert data["calibration"]["strategy"] == "kl" and data["calibration"]["fit"] == ["shape", "weight", "bias"]
    block = model.config.normswap
    assert block["calibration"]["strategy"] == "kl" and block["per_channel"] is True
    assert "rel.err" in str(report) and "rel.err@0: the same on first-position tokens" in str(report)
    assert "256 tokens in 8 sequences\n" in str(report)  # token ids given: all used
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert len(pngs) == len(report.converted) and pngs[0].endswith(".png")


def test_bf16_model_calibrates_sequentially_and_encoder_decoder_falls_back_to_one_shot():
    model = tiny_model("llama").to(torch.bfloat16)
    report = convert(model, "eln", calibration=_cfg(data=_ids(), batch_size=4, strategy="kl", tune_steps=0))
    assert report.calibration["mode"] == "sequential"
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if n.endswith("weight"))
    assert torch.isfinite(first_tensor(model(_ids()[:2])).float()).all()
    t5 = tiny_model("t5")
    report = convert(t5, "eln", calibration=_cfg(data=_ids(), batch_size=4, strategy="kl", tune_steps=0))
    assert report.calibration["mode"] == "one-shot"


def test_padded_text_calibration_for_encoder():
    class Tok:  # minimal tokenizer: words -> ids, right padding
        eos_token_id = None

        def __call__(self, rows, truncation=True, max_length=16, padding=True, return_tensors="pt"):
            ids = [[3 + (hash(w) % 100) for w in r.split()][:max_length] for r in rows]
            width = max(map(len, ids))
            return {"input_ids": torch.tensor([i + [0] * (width - len(i)) for i in ids]),
                    "attention_mask": torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])}

    model = tiny_model("bert")
    report = convert(model, "eln", calibration=_cfg(data="builtin", tokenizer=Tok(), num_blocks=6,
                                                                 block_len=16, strategy="kl", tune_steps=0))
    assert 0 < report.calibration["tokens"] <= 6 * 16  # padding excluded: at most the unpadded block budget
    assert report.converted[0].fit["tokens_seen"] == report.calibration["tokens"]
    tokens, sequences = report.calibration["tokens"], report.calibration["sequences"]
    assert sequences == 6
    assert f"{tokens} tokens in 6 sequences (asked: 6 sequences of up to 16 tokens)" in str(report)


def test_cli_calibration_flags_without_calib_and_bad_calib_data_are_one_line_errors(tmp_path, capsys):
    from hf_normswap.cli import main

    directory = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(directory)
    assert main(["convert", str(directory), "--to", "eln", "--calib", "none", "--strategy", "kl"]) == 2
    assert "--calib" in capsys.readouterr().err.strip().splitlines()[-1]
    assert main(["convert", str(directory), "--to", "eln", "--calib", str(tmp_path / "missing.txt")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("normswap: error:") and "missing.txt" in last
    with pytest.raises(SystemExit):
        main(["convert", "x", "--to", "eln", "--strategy", "nonsense"])
    assert "invalid choice" in capsys.readouterr().err


def test_unknown_strategy_is_a_conversion_error():
    from hf_normswap.surgery import ConversionError

    with pytest.raises(ConversionError, match="strategy"):
        convert(tiny_model("llama"), "eln", calibration=_cfg(data=_ids(), strategy="magic"))


def test_every_strategy_has_its_line_in_convert_help_and_the_readme(capsys):
    from pathlib import Path

    from hf_normswap.calibration.calibrate import STRATEGIES
    from hf_normswap.cli import main

    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    help_text = capsys.readouterr().out
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for strategy in STRATEGIES.values():
        assert strategy.help_line() in help_text
        row = next(line for line in readme.splitlines() if line.startswith(f"| `{strategy.name}` |"))
        assert strategy.fits in row and strategy.auto in row


def test_calibration_blocks_fit_the_model_context():
    from tiny_models import tiny_tokenizer

    model = tiny_model("gpt2")  # 64 positions: 512-token blocks would index past its position embeddings
    report = convert(model, "eln", calibration=_cfg(data="builtin", tokenizer=tiny_tokenizer(), num_blocks=2,
                                                    block_len=512, strategy="fast"))
    assert report.calibration["tokens"] == 2 * 64


@pytest.mark.parametrize("lr", [1e-2, 1e3])  # a tuned block, and one reset to its start (the steps made it worse)
def test_block_tuning_hands_on_the_outputs_of_the_parameters_it_keeps(lr):
    from hf_normswap.calibration.block_pass import tune_block

    torch.manual_seed(0)
    norm, linear = ELN(8, 8.0, amplitude=8 ** 0.5), torch.nn.Linear(8, 8)
    block = torch.nn.ModuleDict(dict(norm=norm, linear=linear))
    target_norm = torch.nn.RMSNorm(8)
    hidden = [3 * torch.randn(4, 5, 8), 3 * torch.randn(4, 5, 8)]
    with torch.no_grad():
        reference = [linear(target_norm(h)) for h in hidden]
    masks = [torch.ones(4, 5)] * 2
    record, outputs = tune_block(block, [norm], lambda x, k, rows: linear(norm(x)), hidden, reference, masks,
                                 _cfg(block_steps=6, block_rows=3, block_lr=lr, block_weights_lr=0), ActivationCache())
    assert record["error_after"] <= record["error_before"]
    with torch.no_grad():
        for out, h in zip(outputs, hidden):
            torch.testing.assert_close(out, linear(norm(h)))


def test_block_tuning_checks_never_worse_on_the_first_guard_rows():
    """With more than GUARD_ROWS sequences, the recorded errors are those of the first GUARD_ROWS alone: sequences
    after them, far off here, would move a check over every row."""
    from hf_normswap.calibration.block_pass import GUARD_ROWS, tune_block
    from hf_normswap.calibration.reconstruct import per_token_relative_error

    torch.manual_seed(0)
    norm = ELN(8, 8.0, amplitude=8 ** 0.5)
    hidden = [torch.randn(GUARD_ROWS, 5, 8), torch.randn(8, 5, 8)]
    reference = [torch.nn.RMSNorm(8)(hidden[0]).detach(), 100 * torch.randn(8, 5, 8)]
    masks = [torch.ones(h.shape[:2]) for h in hidden]
    with torch.no_grad():
        first = float(per_token_relative_error(norm(hidden[0]), reference[0]).mean())
    record, outputs = tune_block(norm, [norm], lambda x, k, rows: norm(x), hidden, reference, masks,
                                 _cfg(block_steps=0, block_rows=4, block_weights_lr=0), ActivationCache())
    assert record["error_before"] == pytest.approx(first, rel=1e-5) == record["error_after"]
    assert [o.shape[0] for o in outputs] == [GUARD_ROWS, 8]  # the next block still gets every sequence


def test_block_tuning_needs_the_original_outputs_of_the_sequences_it_reads_alone():
    """The sequential pass runs the original block only on the batches holding the first ``tuned_rows`` sequences:
    tuning must never read past them, and still hands every sequence on to the next block."""
    from hf_normswap.calibration.block_pass import GUARD_ROWS, _leading_batches, tune_block, tuned_rows

    torch.manual_seed(0)
    norm = ELN(8, 8.0, amplitude=8 ** 0.5)
    hidden = [torch.randn(GUARD_ROWS, 5, 8), torch.randn(8, 5, 8)]
    batches = [{"input_ids": torch.zeros(h.shape[:2]), "attention_mask": torch.ones(h.shape[:2])} for h in hidden]
    config = _cfg(block_steps=4, block_rows=4, block_weights_lr=0)
    assert tuned_rows(config) == GUARD_ROWS and _leading_batches(batches, tuned_rows(config)) == 1
    assert _leading_batches(batches, tuned_rows(_cfg(block_steps=5, block_rows=4))) == 2
    reference = [torch.nn.RMSNorm(8)(hidden[0]).detach()]  # the first batch's alone
    record, outputs = tune_block(norm, [norm], lambda x, k, rows: norm(x), hidden, reference,
                                 [b["attention_mask"] for b in batches], config, ActivationCache())
    assert record["error_after"] < record["error_before"]
    assert [o.shape[0] for o in outputs] == [GUARD_ROWS, 8]


def test_a_block_tuning_step_reads_as_many_sequences_as_block_rows_asks(monkeypatch):
    """The rows of a step come from one batch: a batch smaller than ``block_rows`` is made larger, so that 8 rows a
    step are 8 and not the 4 of the batch size."""
    from hf_normswap.calibration import block_pass

    rows = []
    error = block_pass._relative_error
    monkeypatch.setattr(block_pass, "_relative_error",
                        lambda out, target, mask: rows.append(out.shape[0]) or error(out, target, mask))
    convert(tiny_model("llama"), "eln", calibration=_cfg(data=_ids(16, 16), batch_size=4, strategy="block",
                                                         block_steps=2, block_rows=8, tune_steps=0))
    assert 8 in rows and max(rows) == 8
