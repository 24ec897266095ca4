"""recipes/finetune.py sharded with FSDP2 (recipes/accelerate_configs/fsdp2.yaml) on 2 CPU processes over gloo.

accelerate 1.15 would run DDP here (hf_normswap/training/sharding.py says why); the runs below must log their shard
units, so a DDP run cannot pass. A tiny llama with tied embeddings (as SmolLM2), every weight trained, with the
logit KL through the chunked head loss and the layer-wise term: the same global batch of 4 rows trains to the same
weights on one process and on two sharded ones, a launch resumed from the halfway checkpoint ends where the
uninterrupted one does, and the gathered checkpoint reloads with identical logits.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_normswap
from test_finetune_recipe import RECIPE, ROOT, WORDS, tiny_tokenizer, write_config
from tiny_models import tiny_model

FSDP2 = ROOT / "recipes" / "accelerate_configs" / "fsdp2.yaml"
ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
           CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
# fp32 sums in another order (a reduce-scatter of two halves against one process's batch of 4), through 4 AdamW
# steps: 7.5e-9 at most measured, where training moved the weights by up to 0.04
TOLERANCE = 1e-6


def run(command: list[str], **env: str) -> str:
    result = subprocess.run(command, cwd=ROOT, env=dict(ENV, **env), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"failed:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result.stdout


def sharded_launch(config: Path, *overrides: str, accelerate_config: Path = FSDP2, script: list[str] = (str(RECIPE),),
                   **env: str) -> str:
    out = run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config),
               "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", "0", *script, "--config",
               str(config), *overrides], **env)
    assert "[sharding] FSDP2: student 4 units over 2 processes: 2 x LlamaDecoderLayer" in out, out[-3000:]
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A converted tiny llama (no calibration: every run starts from the same weights), its original, and the
    uninterrupted sharded run (4 steps, checkpoints at 2 and 4)."""
    root = tmp_path_factory.mktemp("sharding")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20))) + " ." for _ in range(400)]
    (root / "train.txt").write_text("\n".join(lines[:300]))
    (root / "eval.txt").write_text("\n".join(lines[300:]))
    original = root / "tiny-llama"
    tiny_model("llama", tie_word_embeddings=True).save_pretrained(original)
    tokenizer = tiny_tokenizer(original, "\n".join(lines))
    converted = tiny_model("llama", tie_word_embeddings=True)
    hf_normswap.convert(converted, to="eln")
    hf_normswap.save_pretrained(converted, root / "converted", tokenizer=tokenizer)
    settings = dict(original=str(original), trainable="all", progressive={"enabled": False}, precision="fp32",
                    distill={"weight": 0.5, "temperature": 2.0, "hidden": 1.0})
    config = write_config(root, root / "converted", root / "fsdp", **settings)
    log = sharded_launch(config)
    return root, config, log


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return dict(hf_normswap.load(directory).named_parameters())


def test_fsdp2_on_two_processes_trains_to_the_weights_of_one_process_at_the_same_global_batch(setup):
    root, config, log = setup
    assert "teacher 3 units over 2 processes: 2 x LlamaDecoderLayer, [root]" in log
    run([sys.executable, str(RECIPE), "--config", str(config), f"output_dir={root / 'single'}",
         "training.per_device_train_batch_size=4"])
    sharded, single = weights(root / "fsdp" / "final"), weights(root / "single" / "final")
    start = weights(root / "converted")
    assert sharded.keys() == single.keys()
    for name, value in single.items():
        assert not torch.equal(value, start[name]), f"{name} did not train"
        torch.testing.assert_close(sharded[name], value, rtol=0, atol=TOLERANCE, msg=name)
    summaries = {run_dir: json.loads((root / run_dir / "summary.json").read_text()) for run_dir in ("fsdp", "single")}
    for summary in summaries.values():
        assert summary["training"]["tokens_seen"] == 4 * 4 * 32  # steps x global batch x block length
    # the final evaluation of the sharded models (every process alike) scores what one process scores
    sharded_eval, single_eval = summaries["fsdp"]["finetuned"], summaries["single"]["finetuned"]
    assert sharded_eval["tokens"] == single_eval["tokens"] > 0
    for name in ("original", "finetuned"):
        assert sharded_eval["results"][name]["nll"] == pytest.approx(single_eval["results"][name]["nll"], rel=1e-5)
    assert sharded_eval["kl"]["finetuned"] == pytest.approx(single_eval["kl"]["finetuned"], rel=1e-3, abs=1e-7)
    assert (summaries["fsdp"]["original_eval_block_perplexity"]
            == pytest.approx(summaries["single"]["original_eval_block_perplexity"], rel=1e-6))
    assert json.loads((root / "fsdp" / "summary.json").read_text())["training"]["world_size"] == 2


def test_a_sharded_run_resumed_from_its_halfway_checkpoint_with_recomputed_activations_ends_with_the_same_weights(
        setup):
    root, config, _ = setup
    resumed = root / "resumed"
    resumed.mkdir()
    shutil.copytree(root / "fsdp" / "checkpoint-2", resumed / "checkpoint-2")
    shutil.copy(root / "fsdp" / "run.json", resumed / "run.json")  # the recipe resumes only in a directory it owns
    # recomputing the activations in backward (gradient checkpointing) changes no weight either
    log = sharded_launch(config, f"output_dir={resumed}", "training.gradient_checkpointing=true")
    assert "resuming from" in log and "checkpoint-2" in log
    uninterrupted = weights(root / "fsdp" / "final")
    for name, value in weights(resumed / "final").items():
        assert torch.equal(value, uninterrupted[name]), name
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["launches"][0]["start_step"] == 2 and summary["launches"][0]["start_tokens"] == 2 * 4 * 32
    assert summary["training"]["tokens_seen"] == 4 * 4 * 32  # counted over both launches


def test_the_gathered_checkpoint_reloads_with_identical_logits(setup):
    """The recipe compares the gathered model in memory with hf_normswap.load of what it saved (bit for bit);
    plain transformers with the checkpoint's remote code gives the same logits."""
    from transformers import AutoModelForCausalLM

    root, _, _ = setup
    final = root / "fsdp" / "final"
    summary = json.loads((root / "fsdp" / "summary.json").read_text())
    assert summary["reload_identical"] is True
    ids = torch.randint(0, 120, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        packaged = hf_normswap.load(final)(input_ids=ids).logits
        remote = AutoModelForCausalLM.from_pretrained(final, trust_remote_code=True).eval()(input_ids=ids).logits
    torch.testing.assert_close(remote, packaged, rtol=1e-5, atol=1e-5)
    saved = json.loads((final / "config.json").read_text())["normswap"]
    assert saved["training"]["steps"] == 4 and saved["training"]["world_size"] == 2
    assert "## Fine-tuning" in (final / "README.md").read_text()
    assert {p.name for p in (root / "fsdp").glob("checkpoint-*")} == {"checkpoint-2", "checkpoint-4"}
    assert (root / "fsdp" / "checkpoint-4" / "pytorch_model_fsdp_0").is_dir()  # sharded Trainer checkpoints


def test_a_sharded_lora_run_gathers_and_merges_its_adapters(setup):
    """LoRA under FSDP2: the adapters are sharded with their blocks, gathered with the student and merged before the
    save (the gathered copy is made after LoRA is applied)."""
    pytest.importorskip("peft")
    root, _, _ = setup
    settings = dict(original=str(root / "tiny-llama"), trainable="lora", progressive={"enabled": False},
                    precision="fp32", lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                    distill={"weight": 0.5, "temperature": 2.0, "hidden": 1.0})
    config = write_config(root, root / "converted", root / "lora", **settings)
    sharded_launch(config, "training.max_steps=2")
    summary = json.loads((root / "lora" / "summary.json").read_text())
    assert summary["reload_identical"] is True and summary["finetuned"]["tokens"] > 0
    trained, start = weights(root / "lora" / "final"), weights(root / "converted")
    changed = {name for name, value in trained.items() if not torch.equal(value, start[name])}
    assert any("q_proj" in name for name in changed) and not any("k_proj" in name for name in changed)


# recipes/finetune.py with every weight read counted (transformers' _load_pretrained_model, which every load of a
# model's weights goes through), written to READS_DIR/reads-RANK.json when the recipe ends
COUNTED_READS = """
import json, os, sys
from pathlib import Path

import transformers
from hf_normswap.training import recipe

read = transformers.PreTrainedModel._load_pretrained_model
reads = []

def counted(*args, **kwargs):
    reads.append(1)
    return read(*args, **kwargs)

transformers.PreTrainedModel._load_pretrained_model = staticmethod(counted)
code = recipe.main(sys.argv[2:])
(Path(sys.argv[1]) / f"reads-{os.environ['RANK']}.json").write_text(json.dumps(len(reads)))
sys.exit(code)
"""


def test_only_the_main_process_reads_weights_and_training_ends_where_whole_loads_do(setup, tmp_path):
    """fsdp2.yaml loads once a node (``fsdp_cpu_ram_efficient_loading``): the second process reads no weights, builds
    both models on the meta device and receives the student's shards from accelerate, the teacher's from torch; the
    original's samples (training text) and the progressive swap's norms come from the main process. The losses and
    the trained weights are those of a launch in which every process loads both models whole."""
    root, _, _ = setup
    script = tmp_path / "counted_reads.py"
    script.write_text(COUNTED_READS)
    whole = tmp_path / "fsdp2-whole.yaml"
    whole.write_text(FSDP2.read_text().replace("fsdp_cpu_ram_efficient_loading: true",
                                               "fsdp_cpu_ram_efficient_loading: false"))
    assert whole.read_text() != FSDP2.read_text()
    settings = dict(original=str(root / "tiny-llama"), trainable="all", precision="fp32",
                    progressive={"enabled": True, "order": "depth", "every": 1, "ramp": 1},
                    train_data="generated:length=32,batch_size=2,temperature=1.0",
                    distill={"weight": 0.5, "temperature": 2.0, "hidden": 1.0})
    cache = dict(HF_NORMSWAP_CACHE=str(tmp_path / "samples"))
    runs = {}
    for name, accelerate_config in (("once", FSDP2), ("whole", whole)):
        reads = tmp_path / f"reads-{name}"
        reads.mkdir()
        config = write_config(root, root / "converted", tmp_path / name, **settings)
        log = sharded_launch(config, "training.save_strategy=no", accelerate_config=accelerate_config,
                             script=[str(script), str(reads)], **cache)
        assert "teacher 3 units over 2 processes" in log
        runs[name] = {rank: json.loads((reads / f"reads-{rank}.json").read_text()) for rank in (0, 1)}
    assert runs["whole"][1] == 2  # the count sees every process's loads: the student and the original
    assert runs["once"][0] == runs["whole"][0] >= 2 and runs["once"][1] == 0
    losses = {name: [row["loss"] for row in json.loads((tmp_path / name / "summary.json").read_text())["history"]
                     if "loss" in row] for name in runs}
    assert len(losses["once"]) == 4 and losses["once"] == pytest.approx(losses["whole"], rel=1e-6)
    once, whole_weights = weights(tmp_path / "once" / "final"), weights(tmp_path / "whole" / "final")
    for name, value in whole_weights.items():
        torch.testing.assert_close(once[name], value, rtol=0, atol=TOLERANCE, msg=name)


def test_the_teacher_is_sent_a_shard_unit_at_a_time():
    """``shard_from_main`` broadcasts one group of state dict keys at a time, so the main process frees each group's
    whole weights once sent: one group a decoder block, one for the rest (embeddings, final norm, tied head), every
    key once."""
    from hf_normswap.training.sharding import unit_groups

    model = tiny_model("llama", tie_word_embeddings=True)
    groups = unit_groups(model)
    layers = model.config.num_hidden_layers
    assert len(groups) == layers + 1
    keys = [key for group in groups for key in group]
    assert len(keys) == len(set(keys)) and set(keys) == set(model.state_dict())
    root = next(group for group in groups if "lm_head.weight" in group)
    assert "model.embed_tokens.weight" in root and "model.norm.weight" in root
    assert all({key.split(".")[2] for key in group} == {str(i)} for i, group in
               enumerate(g for g in groups if g is not root))
