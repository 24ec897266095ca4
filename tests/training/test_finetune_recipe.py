"""recipes/finetune.py end to end on a tiny llama, and the library pieces it uses (trainer, losses, progressive).

The two-process test is marked ``distributed`` (select with ``-m distributed``, skip with ``-m "not distributed"``);
it runs in the default suite. Two CPU processes join over gloo: on a machine without GPU,
``accelerate launch --multi_gpu --num_processes 2`` starts them through torchrun and the recipe creates its
accelerate state with ``cpu=True`` (accelerate's own ``--cpu`` flag starts a single process unless MPI is used).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml

import hf_normswap
from hf_normswap.checkpoint.record import ConversionRecord
from hf_normswap.data.generated import is_generated
from hf_normswap.training.recovery_run import converted_checkpoint, resolve_run
from hf_normswap.training import recipe_data, recipe_models, recipe_results, recipe_settings
from hf_normswap.training.config import RecipeConfig
from hf_normswap.training.losses import distillation_loss
from hf_normswap.training.hand_overs.blend import ProgressiveSwap
from hf_normswap.training.hand_overs.progressive import schedule
from hf_normswap.training.run_dir import claim_run_dir
from hf_normswap.training.trainable import group_learning_rates, norm_parameter_names, parameter_groups, set_trainable
from tiny_models import tiny_model

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "finetune.py"
WORDS = ("the model layer norm scale token value input output weight train step loss small large first last "
         "position channel element wise function learn fit data text tiny network block head sum mean root "
         "square shape beta alpha gamma bias original converted").split()


def check_settled(config):
    """``recipe_data.check_data`` as the recipe calls it, once the run is resolved."""
    calibrates = converted_checkpoint(config.model) is None
    recipe_data.check_data(config, calibrates, recipe_data.packs_blocks(config.model if calibrates else config.original))


def tiny_tokenizer(directory: Path, text: str):
    """A word-level tokenizer trained on ``text`` (fits the tiny model's 128-token vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], trainers.WordLevelTrainer(vocab_size=120, special_tokens=["<unk>", "<eos>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")
    tokenizer.save_pretrained(directory)
    return tokenizer


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """A tiny llama with its tokenizer in a directory, and a small text file."""
    root = tmp_path_factory.mktemp("finetune")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20))) + " ." for _ in range(400)]
    text = "\n".join(lines)
    (root / "train.txt").write_text("\n".join(lines[:300]))
    (root / "eval.txt").write_text("\n".join(lines[300:]))
    model_dir = root / "tiny-llama"
    tiny_model("llama").save_pretrained(model_dir)
    tiny_tokenizer(model_dir, text)
    return root, model_dir


def write_config(root: Path, model_dir: Path, output: Path, **extra) -> Path:
    config = {
        "model": str(model_dir), "method": "eln",
        "calibration": {"data": str(root / "train.txt"), "num_blocks": 4, "block_len": 32, "tune_steps": 3,
                        "progress": False},
        "train_data": str(root / "train.txt"), "eval_data": str(root / "eval.txt"),
        "block_len": 32, "eval_blocks": 4, "final_eval": {"max_tokens": 256, "max_length": 32},
        "distill": {"weight": 0.5, "temperature": 2.0}, "lr": {"base": 1e-3, "shape": 1e-2, "gamma": 1e-3},
        "progressive": {"enabled": True, "order": "depth", "every": 1, "ramp": 2},  # all converted from step 3
        "output_dir": str(output), "threads": 1,
        "training": {"max_steps": 4, "per_device_train_batch_size": 2, "logging_steps": 1, "eval_steps": 2,
                     "save_steps": 2, "save_total_limit": 2, "warmup_steps": 1, "report_to": "none",
                     "disable_tqdm": True, "dataloader_num_workers": 0},
    }
    config = {**config, **extra}
    path = root / f"{output.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def launch(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               "0", str(RECIPE), "--config", str(config), *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"launch failed:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result


@torch.no_grad()
def logits(model, ids):
    return model(input_ids=ids).logits


@pytest.mark.distributed
def test_two_process_training_resumes_and_saves_a_reloadable_checkpoint(tiny_setup):
    root, model_dir = tiny_setup
    output = root / "run"
    config = write_config(root, model_dir, output)

    first = launch(config)
    assert "training from the calibrated model" in first.stdout
    assert {p.name for p in output.glob("checkpoint-*")} == {"checkpoint-2", "checkpoint-4"}
    summary = json.loads((output / "summary.json").read_text())
    assert summary["training"]["world_size"] == 2 and summary["training"]["steps"] == 4

    # tokens take precedence: 6 steps; in bf16 autocast, evaluated and saved without accelerate's autocast wrapper
    second = launch(config, "train_tokens=768", "training.max_steps=100", "precision=bf16")
    assert "resuming from" in second.stdout and "checkpoint-4" in second.stdout
    summary = json.loads((output / "summary.json").read_text())
    assert [s["global_step"] for s in summary["launches"]] == [4, 6]
    assert [s["start_tokens"] for s in summary["launches"]] == [0, 4 * 2 * 2 * 32]  # where each chunk began
    assert summary["launches"][1]["resumed_from"].endswith("checkpoint-4")
    assert summary["reload_identical"] is True
    history = summary["history"]
    assert any("eval_perplexity" in h for h in history) and any("kd_loss" in h for h in history)
    assert [h["converted_fraction"] for h in history if "converted_fraction" in h][-1] == 1.0
    assert summary["training"]["tokens_seen"] == 6 * 2 * 2 * 32  # steps * batch * processes * block length
    for key in ("calibrated", "finetuned"):
        assert summary[key]["ratio"][key] > 0
    assert (output / "curve.png").stat().st_size > 1000

    final = output / "final"
    model = hf_normswap.load(final)
    ids = torch.randint(0, 120, (2, 24), generator=torch.Generator().manual_seed(1))
    # the last Trainer checkpoint is the same weights, saved through the same path mid-training
    assert torch.equal(logits(model, ids), logits(hf_normswap.load(output / "checkpoint-6"), ids))
    # training changed the calibrated model (only the norm parameters train by default)
    calibrated = hf_normswap.load(output / "calibrated")
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, calibrated.get_parameter(n))}
    assert changed and changed <= set(norm_parameter_names(model))
    # the checkpoint loads without the package through its remote code, and records the training in its card
    from transformers import AutoModelForCausalLM

    remote = AutoModelForCausalLM.from_pretrained(final, trust_remote_code=True).eval()
    torch.testing.assert_close(logits(remote, ids), logits(model, ids), rtol=1e-5, atol=1e-5)
    saved = json.loads((final / "config.json").read_text())["normswap"]
    assert saved["training"]["steps"] == 6 and saved["evaluation"]["metrics"]
    card = (final / "README.md").read_text()
    assert "## Fine-tuning" in card and "6 steps" in card and "Evaluation against the original" in card


def test_lora_single_process(tiny_setup):
    """Plain ``python recipes/finetune.py`` with LoRA: adapters merged, norm copies trained, checkpoint saved."""
    pytest.importorskip("peft")
    root, model_dir = tiny_setup
    output = root / "lora"
    config = write_config(root, model_dir, output, trainable="lora", progressive={"enabled": False},
                          lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    command = [sys.executable, str(RECIPE), "--config", str(config), "training.max_steps=2", "training.eval_steps=2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    summary = json.loads((output / "summary.json").read_text())
    assert summary["reload_identical"] is True
    model = hf_normswap.load(output / "final")
    calibrated = hf_normswap.load(output / "calibrated")
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, calibrated.get_parameter(n))}
    assert any("q_proj" in n for n in changed) and any(n in norm_parameter_names(model) for n in changed)
    assert not any("k_proj" in n for n in changed)


def test_a_resumed_run_refuses_a_cached_calibration_the_config_does_not_describe(tiny_setup, tmp_path, capsys,
                                                                                  no_loading):
    """``OUTPUT/calibrated`` from another method or other calibration settings stops the run before any model loads,
    instead of training a start the config does not describe; ``resume=false`` calibrates anew."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, model_dir = tiny_setup
    output = tmp_path / "run"
    base = ["--config", str(write_config(root, model_dir, output)), "calibration.precision=auto"]
    config = recipe_settings.load_config(base)
    claim_run_dir(config)  # what the recipe records before calibrating
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    hf_normswap.convert(model, to="eln", calibration=dataclasses.replace(config.calibration, tokenizer=tokenizer))
    hf_normswap.save_pretrained(model, output / "calibrated", tokenizer=tokenizer)

    # calibrated as asked: the run is set up and goes on
    no_loading.RecoveryRecipe(recipe_settings.load_config([*base, "calibration.progress=true"]), launched=0.0)
    no_loading.RecoveryRecipe(recipe_settings.load_config(  # the same roles in another order
        [*base, "roles=[final, embedding, post_norm, mlp_input, attention_input]"]), launched=0.0)
    capsys.readouterr()
    for override, named in (("method=dyt", "method 'eln' (the config: 'dyt')"),
                            ("calibration.num_blocks=3", "num_blocks 4 (the config: 3)"),
                            ("calibration.precision=fp32", "precision 'auto' (the config: 'fp32')"),
                            ("roles=[mlp_input]", "roles ('attention_input', 'embedding', 'final', 'mlp_input', "
                                                  "'post_norm') (the config: ('mlp_input',))")):
        with pytest.raises(SystemExit) as error:
            no_loading.main([*base, override])  # refused as the run is set up, before any model loads
        assert error.value.code == 2
        message = capsys.readouterr().err
        assert named in message and "resume=false" in message and message.count("\n") == 1, message
    from accelerate import PartialState

    state = PartialState(cpu=True)
    resumed, _, _ = recipe_models.load_models(resolve_run(recipe_settings.load_config(base)), state)  # the cache, as calibrated
    assert resumed.config.normswap["method"] == "eln" and "calibrated model from" in capsys.readouterr().out
    anew, _, _ = recipe_models.load_models(resolve_run(recipe_settings.load_config([*base, "method=dyt", "resume=false"])),
                                       state)
    assert anew.config.normswap["method"] == "dyt" and "converted" in capsys.readouterr().out
    some, _, _ = recipe_models.load_models(resolve_run(recipe_settings.load_config(
        [*base, "roles=[mlp_input]", "resume=false"])), state)  # the roles asked, and those alone
    converted = ConversionRecord.of(some).converted
    assert converted and {entry.role for entry in converted.values()} == {"mlp_input"}


@pytest.mark.parametrize("env, named", [({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "FSDP1"),
                                        ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
                                         "ZeRO-3")])
def test_sharding_other_than_fsdp2_is_refused_before_anything_loads(env, named, monkeypatch, capsys):
    """The whole model is gathered for the final evaluation and save with FSDP2's state dict API
    (tests/training/test_sharding.py); FSDP1 and ZeRO-3 would wait forever for the other ranks' shards."""
    recipe_settings.load_config([])
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    recipe_settings.load_config([])  # FSDP2 goes on
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as error:
        recipe_settings.load_config([])
    assert error.value.code == 2 and named in capsys.readouterr().err


def test_block_dataset_packs_blocks_within_the_limits(tiny_setup):
    from transformers import AutoTokenizer

    root, model_dir = tiny_setup
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = str(root / "train.txt")
    full = recipe_data.block_dataset(tokenizer, text, "calibration", 32)
    assert len(full) > 20 and all(len(row) == 32 for row in full["input_ids"]) and full["labels"] == full["input_ids"]
    assert len(recipe_data.block_dataset(tokenizer, text, "calibration", 32, max_tokens=100)) == 3  # 100 // 32
    assert len(recipe_data.block_dataset(tokenizer, text, "calibration", 32, max_tokens=1000, max_blocks=5)) == 5
    assert recipe_data.block_dataset(tokenizer, text, "calibration", 32, max_blocks=2)["input_ids"] == full["input_ids"][:2]
    with pytest.raises(SystemExit, match="fewer than one block"):
        recipe_data.block_dataset(tokenizer, text, "calibration", 32, max_tokens=10)


def test_a_mix_trains_on_equal_shares_of_its_sources_in_turn(tiny_setup, tmp_path, monkeypatch):
    """``train_data: [A, B]``: A's and B's blocks alternate, the shorter source read again; a local file streams its
    blocks in a shuffled order, and the original's samples stream without end, the blocks its samples give."""
    import itertools
    import types

    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, model_dir = tiny_setup
    monkeypatch.setenv("HF_NORMSWAP_CACHE", str(tmp_path / "cache"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    state = types.SimpleNamespace(process_index=0, num_processes=1)
    short = tmp_path / "short.txt"
    short.write_text(" ".join(WORDS[:40]) + "\n" + " ".join(WORDS[40:] + WORDS[:30]))
    corpus, spec = str(root / "train.txt"), "generated:length=32,batch_size=2,temperature=1.0"

    def blocks(source, max_tokens=None, original=None):
        return recipe_data.block_dataset(tokenizer, source, "calibration", 32, max_tokens,
                                         draw=recipe_data.SampleDraw(original, state))["input_ids"]

    def first(rows, count):
        return [row["input_ids"] for row in itertools.islice(iter(rows), count)]

    config = recipe_settings.load_config([f"model={model_dir}", f"train_data=[{corpus}, {short}]", "block_len=32"])
    long, few = blocks(corpus), blocks(str(short))
    rows = first(recipe_data.training_blocks(resolve_run(config).text, tokenizer, None, state), 2 * len(long))
    assert len(few) == 2 < len(long) and rows[0::2] != long and sorted(rows[0::2]) == sorted(long)
    assert all(row in few for row in rows[1::2]) and all(rows[1::2].count(row) >= len(long) // 2 - 1 for row in few)

    original = AutoModelForCausalLM.from_pretrained(model_dir)
    config = recipe_settings.load_config([f"model={model_dir}", f"train_data=['{spec}', {corpus}]", "block_len=32",
                                          "train_tokens=256"])
    rows = first(recipe_data.training_blocks(resolve_run(config).text, tokenizer, original, state), 2 * len(long))
    sampled = blocks(spec, 32 * 8, original)  # from the cache the stream filled
    assert len(sampled) >= 2 and rows[0::2][:len(sampled)] == sampled  # the samples' blocks in order, past 256
    assert sorted(rows[1::2]) == sorted(long)


def test_a_source_read_whole_in_a_mix_is_shuffled_by_the_run_s_seed(tiny_setup, tmp_path):
    """Mixed with a stream, a source read whole becomes a stream too, which the Trainer does not shuffle: its blocks
    come in an order the run's ``seed`` sets, each once a pass."""
    import itertools
    import types

    from transformers import AutoTokenizer

    root, model_dir = tiny_setup
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    state = types.SimpleNamespace(process_index=0, num_processes=1)
    spec = f"repeated:words=6:{root / 'train.txt'}"
    whole = recipe_data.block_dataset(tokenizer, spec, "calibration", 32, draw=recipe_data.SampleDraw(state=state))
    whole = whole["input_ids"]

    def read(seed):
        config = recipe_settings.load_config([f"model={model_dir}", f"train_data=[{root / 'train.txt'}, {spec}]",
                                              "block_len=32", f"seed={seed}"])
        rows = recipe_data.training_blocks(resolve_run(config).text, tokenizer, None, state)
        return [row["input_ids"] for row in itertools.islice(iter(rows), 2 * len(whole))][1::2]

    assert len(whole) > 4 and sorted(read(0)) == sorted(whole) == sorted(read(1))
    assert read(0) == read(0) and read(0) != read(1) and read(0) != whole


def test_a_sentence_encoder_trains_on_sentences_with_its_special_tokens(tmp_path):
    """The rows an encoder is used on ([CLS] sentence [SEP], padded per batch), not packed blocks; ``train_tokens``
    counts their real tokens."""
    from transformers import AutoTokenizer

    from hf_normswap.checkpoint.packaged import PackagedModelMissing, packaged_path

    try:
        tokenizer = AutoTokenizer.from_pretrained(packaged_path("offline:minilm"))
    except PackagedModelMissing as missing:
        pytest.skip(str(missing))
    text = tmp_path / "text.txt"
    text.write_text("A short first sentence of prose here. The second sentence is a little longer than that one.\n"
                    "= Heading =\nToo short.\n")
    rows = recipe_data.sentence_dataset(tokenizer, str(text), 128)["input_ids"]
    assert [tokenizer.decode(r) for r in rows] == [
        "[CLS] a short first sentence of prose here. [SEP]",
        "[CLS] the second sentence is a little longer than that one. [SEP]"]
    rows_of_128 = recipe_data.sentence_dataset(tokenizer, str(text), 128)
    assert recipe_data.tokens_per_row(rows_of_128) == (len(rows[0]) + len(rows[1])) / 2
    assert len(recipe_data.sentence_dataset(tokenizer, str(text), 6)["input_ids"][1]) == 6  # cut to block_len


# ------------------------------------------------------------------------------------------ library pieces


def converted_tiny(method="eln"):
    model = tiny_model("llama")
    original = tiny_model("llama")
    report = hf_normswap.convert(model, to=method)
    return model, original, report


def test_parameter_groups_separate_shape_and_gamma_without_decay():
    model, _, _ = converted_tiny()
    set_trainable(model, "all")
    groups = {g["name"]: g for g in parameter_groups(model, lr=1e-4, weight_decay=0.1, shape_lr=1e-2, gamma_lr=1e-3,
                                                     decay_names={n for n, _ in model.named_parameters()
                                                                  if n.endswith("proj.weight")})}
    assert groups["shape"]["lr"] == 2e-2 and groups["shape"]["weight_decay"] == 0.0  # ELN: twice (adam_groups)
    assert groups["gamma"]["lr"] == 1e-3 and groups["gamma"]["weight_decay"] == 0.0
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0
    assert len(groups["shape"]["params"]) == 5  # 2 layers x 2 norms + final norm, one beta each
    assert sum(len(g["params"]) for g in groups.values()) == len(list(model.parameters()))
    set_trainable(model, "norms")
    assert {g["name"] for g in parameter_groups(model, lr=1e-4, weight_decay=0.1)} == {"shape", "gamma"}
    dyt = parameter_groups(converted_tiny("dyt")[0], lr=1e-4, weight_decay=0.1, shape_lr=1e-2)
    assert [g["lr"] for g in dyt if g["name"] == "shape"] == [1e-2]
    derf_model = converted_tiny("derf")[0]
    derf = {g["name"]: g for g in parameter_groups(derf_model, lr=1e-4, weight_decay=0.1, shape_lr=1e-2, gamma_lr=1e-3)}
    assert derf["shape"]["lr"] == 1e-2 and len(derf["shape"]["params"]) == 5  # log alpha, as DyT's
    shifts = {id(m.shift) for m in derf_model.modules() if isinstance(m, hf_normswap.modules.Derf)}
    assert len(shifts) == 5 and shifts <= {id(p) for p in derf["gamma"]["params"]}  # the shift: a bias, no decay


def test_each_group_learning_rate_is_logged_and_plotted_under_its_name_over_tokens(tmp_path, monkeypatch):
    model, _, _ = converted_tiny()
    set_trainable(model, "all")
    optimizer = torch.optim.AdamW(parameter_groups(model, lr=3e-4, weight_decay=0.1, shape_lr=5e-2, gamma_lr=1e-3))
    rates = group_learning_rates(optimizer)
    assert rates == {"learning_rate/shape": 0.1, "learning_rate/gamma": 1e-3, "learning_rate/no_decay": 3e-4}
    history = [{"loss": 2.0 - i / 10, "num_input_tokens_seen": 512 * i, **rates} for i in range(1, 5)]
    history.append({"eval_perplexity": 30.0, "num_input_tokens_seen": 2048})
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    recipe_results.plot_history(history, tmp_path / "curve.png", 20.0, "test")
    loss, lr, ppl = figures[0].axes
    assert sorted(line.get_label() for line in lr.lines) == ["gamma", "no_decay", "shape"]
    assert list(lr.lines[0].get_xdata()) == [512, 1024, 1536, 2048] and lr.get_xlabel() == "training tokens"
    assert list(ppl.lines[0].get_xdata()) == [2048]


def test_an_encoder_s_curve_plots_its_hidden_state_terms_without_a_perplexity_legend(tmp_path, monkeypatch):
    history = [{"loss": 1.0, "ce_loss": 0.0, "kd_loss": 0.0, "hidden_loss": 0.6, "embedding_loss": 0.4,
                "num_input_tokens_seen": 900 * i} for i in range(1, 4)]
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns when asked for a legend of no lines
        recipe_results.plot_history(history, tmp_path / "curve.png", None, "encoder")
    loss, _, ppl = figures[0].axes
    assert [line.get_label() for line in loss.lines] == ["training loss", "layer-wise", "1 - embedding cosine"]
    assert not ppl.lines and ppl.get_legend() is None


def test_distillation_loss_is_zero_for_equal_logits_and_scales_with_temperature():
    torch.manual_seed(0)
    a, b = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    assert float(distillation_loss(a, a)) == pytest.approx(0.0, abs=1e-6)
    reference = torch.nn.functional.kl_div(torch.log_softmax(a, -1).reshape(-1, 11),
                                           torch.log_softmax(b, -1).reshape(-1, 11), log_target=True,
                                           reduction="batchmean")
    assert float(distillation_loss(a, b, chunk=3)) == pytest.approx(float(reference), rel=1e-5)
    mask = torch.zeros(2, 5)
    mask[0, :2] = 1
    masked = torch.nn.functional.kl_div(torch.log_softmax(a[0, :2], -1), torch.log_softmax(b[0, :2], -1),
                                        log_target=True, reduction="batchmean")
    assert float(distillation_loss(a, b, mask=mask)) == pytest.approx(float(masked), rel=1e-5)
    softened = torch.nn.functional.kl_div(torch.log_softmax(a / 2, -1).reshape(-1, 11),
                                          torch.log_softmax(b / 2, -1).reshape(-1, 11), log_target=True,
                                          reduction="batchmean")
    assert float(distillation_loss(a, b, temperature=2.0)) == pytest.approx(4 * float(softened), rel=1e-5)


def test_schedule_orders():
    roles = {"model.layers.0.input_layernorm": "attention_input", "model.layers.0.post_attention_layernorm":
             "mlp_input", "model.layers.1.input_layernorm": "attention_input",
             "model.layers.1.post_attention_layernorm": "mlp_input", "model.norm": "final"}
    by_depth = schedule(roles, every=10)
    assert [s.names for s in by_depth] == [list(roles)[:2], list(roles)[2:4], ["model.norm"]]
    assert [s.start for s in by_depth] == [0, 10, 20]
    by_role = schedule(roles, every=5, ramp=0, order="role", role_order=["mlp_input", "attention_input"])
    assert [len(s.names) for s in by_role] == [2, 2, 1] and by_role[0].names[0].endswith("post_attention_layernorm")
    assert by_role[0].mix(0) == 1.0 and by_role[1].mix(4) == 0.0
    reverse = schedule(roles, order="reverse_depth", group=2)
    assert set(reverse[0].names) == {"model.norm", *list(roles)[2:4]}


@torch.no_grad()
def test_progressive_swap_blends_from_original_to_converted():
    model, original, report = converted_tiny()
    names = [c.name for c in report.converted]
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    converted_logits, original_logits = logits(model, ids), logits(original, ids)
    swap = ProgressiveSwap(model, {n: original.get_submodule(n) for n in names},
                           schedule({n: "x" for n in names}, every=4, ramp=4))
    swap.set_step(0)
    assert not torch.allclose(logits(model, ids), original_logits)  # the first stage has started ramping
    halfway = logits(model, ids)
    swap.set_step(-1)
    torch.testing.assert_close(logits(model, ids), original_logits)
    swap.set_step(10 ** 6)
    torch.testing.assert_close(logits(model, ids), converted_logits)
    assert not torch.allclose(halfway, converted_logits)
    swap.remove()
    assert torch.equal(logits(model, ids), converted_logits)
    assert not any(k.startswith("original") for k in model.state_dict())


@pytest.mark.parametrize("config", sorted((ROOT / "recipes" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_configs_name_hub_or_builtin_data_and_local_files_override_them(config, tmp_path, capsys):
    named = recipe_settings.load_config(["--config", str(config)])
    for spec in (named.calibration.data, named.train_data, named.eval_data):
        assert spec.startswith(("wikitext:wikitext-2-raw-v1:", "builtin", "generated")), spec  # nothing outside it
    text = tmp_path / "text.txt"
    text.write_text((" ".join(WORDS) + "\n") * 40)  # more than a block of the configs' lengths
    local = [f"calibration.data={text}", f"train_data={text}", "eval_data=builtin:evaluation"]
    check_settled(recipe_settings.load_config(["--config", str(config), *local]))
    capsys.readouterr()
    with pytest.raises(SystemExit) as error:
        check_settled(recipe_settings.load_config(["--config", str(config), *local, f"eval_data={tmp_path}/missing.txt"]))
    assert error.value.code == 2
    assert re.fullmatch(r"finetune: error: eval_data: data file not found: .*missing.txt.*\(eval_data=PATH\)\n",
                        capsys.readouterr().err)


@pytest.mark.parametrize("config", sorted((ROOT / "recipes" / "configs").glob("smollm2-*.yaml")), ids=lambda p: p.name)
def test_smollm2_configs_need_no_data_argument_and_no_network(config, capsys):
    """Calibrated and trained on the original's samples, evaluated on the offline text: nothing to download."""
    named = recipe_settings.load_config(["--config", str(config)])
    assert named.model.startswith("offline:")
    assert is_generated(named.calibration.data) and is_generated(named.train_data), named
    assert named.eval_data == "builtin:evaluation"
    check_settled(named)
    assert capsys.readouterr().err == ""


def test_a_converted_checkpoint_needs_no_calibration_data(tmp_path):
    """The main job's recovery: the recipe on a saved calibrated checkpoint reads no calibration text."""
    model, _, _ = converted_tiny()
    hf_normswap.save_pretrained(model, tmp_path / "converted")
    unreadable = f"calibration.data={tmp_path}/missing.txt"
    check_settled(recipe_settings.load_config([f"model={tmp_path / 'converted'}", unreadable]))
    with pytest.raises(SystemExit):  # an original to convert still needs it
        check_settled(recipe_settings.load_config([f"model={tmp_path}", unreadable]))


def test_a_strategy_set_to_no_stays_no(tmp_path):
    """YAML reads an unquoted `no` as false; the Trainer's strategies take the word."""
    config = tmp_path / "c.yaml"
    config.write_text("training: {save_strategy: no}\n")
    loaded = recipe_settings.load_config(["--config", str(config), "training.eval_strategy=no"])
    assert loaded.training["eval_strategy"] == loaded.training["save_strategy"] == "no"


@pytest.mark.distributed
def test_two_processes_train_on_the_originals_samples_and_a_second_run_reuses_them(tiny_setup, tmp_path, monkeypatch):
    """``generated`` training text: each process draws its share of the batches into the cache, both train on the
    whole sample, and another run with the same settings draws nothing."""
    root, model_dir = tiny_setup
    monkeypatch.setenv("HF_NORMSWAP_CACHE", str(tmp_path / "cache"))
    spec = "generated:length=32,batch_size=2,temperature=1.0"
    config = write_config(root, model_dir, tmp_path / "gen", train_data=spec, progressive={"enabled": False})
    first = launch(config, "training.max_steps=2", "training.eval_strategy=no", "training.save_strategy=no")
    batches = sorted((tmp_path / "cache").rglob("batch-*.safetensors"))
    assert len(batches) >= 4  # 2 steps x 2 processes x 2 rows x 32 tokens: 4 batches of 2 x 32 at least
    assert "tokens sampled" in first.stderr
    mtimes = [b.stat().st_mtime_ns for b in batches]
    second = launch(write_config(root, model_dir, tmp_path / "gen2", train_data=spec, progressive={"enabled": False}),
                    "training.max_steps=2", "training.eval_strategy=no", "training.save_strategy=no")
    assert "tokens sampled" not in second.stdout + second.stderr
    assert [b.stat().st_mtime_ns for b in sorted((tmp_path / "cache").rglob("batch-*.safetensors"))] == mtimes


@pytest.mark.parametrize("train_data, training, max_train_tokens, expected", [
    ("wiki.txt", {"max_steps": 10}, None, [None]),  # a corpus is read whole, whatever the steps
    ("wiki.txt", {"max_steps": 10}, 5000, [5000]),
    ("generated", {"max_steps": 10}, None, [10 * 2 * 3 * 4 * 16]),  # steps x batch x accumulation x processes x len
    ("generated", {"max_steps": 10}, 3000, [3000]),  # within the cap
    ("generated", {"max_steps": -1}, None, [None]),  # epochs: no step count to size the samples by
    (["wiki.txt", "generated"], {"max_steps": 10}, None, [None, 10 * 2 * 3 * 4 * 16 // 2]),  # a mix: half each
    (["wiki.txt", "generated"], {"max_steps": 10}, 3000, [1500, 1500]),
])
def test_the_training_text_is_sized_by_the_run_only_for_the_originals_samples(train_data, training, max_train_tokens,
                                                                               expected):
    sources = train_data if isinstance(train_data, list) else [train_data]
    config = RecipeConfig(train_data=train_data, max_train_tokens=max_train_tokens, block_len=16,
                          training={**RecipeConfig().training, **training, "per_device_train_batch_size": 2,
                                    "gradient_accumulation_steps": 3})
    text = resolve_run(config, processes=4).text
    assert (text.sources, text.shares, text.capped) == (tuple(sources), tuple(expected), max_train_tokens is not None)


def test_the_models_go_to_the_training_device_and_under_fsdp2_only_the_blocks_do():
    """Calibration, sampling and evaluation run where the model is: on a GPU machine that is the GPU accelerate
    trains on (the meta device stands in for it here). Under FSDP2 accelerate shards from CPU memory, so the model
    stays there and calibration's blocks visit the device (the run's calibration; the settings keep theirs)."""
    from types import SimpleNamespace

    from hf_normswap.model_inputs import model_device
    from hf_normswap.training.config import RecipeConfig

    gpu, cpu = SimpleNamespace(device=torch.device("meta")), SimpleNamespace(device=torch.device("cpu"))
    config = RecipeConfig(output_dir="unused")
    ddp, fsdp2 = resolve_run(config, device="meta"), resolve_run(config, device="meta", sharded=True)
    assert model_device(recipe_models.place_for_training(tiny_model("llama"), cpu.device, ddp.sharded)).type == "cpu"
    assert model_device(recipe_models.place_for_training(tiny_model("llama"), gpu.device, ddp.sharded)).type == "meta"
    assert ddp.calibration.device is None
    assert model_device(recipe_models.place_for_training(tiny_model("llama"), gpu.device, fsdp2.sharded)).type == "cpu"
    assert fsdp2.calibration.device == "meta" and config.calibration.device is None
