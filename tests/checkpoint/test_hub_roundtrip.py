"""The paths a user runs against the Hub, offline: models and a dataset downloaded from a local Hub mirror
(``tests/hub_mirror.py``, selected with ``HF_ENDPOINT``) by the real huggingface_hub, transformers and datasets
clients, converted, pushed back, and loaded from the Hub in a process where hf_normswap cannot be imported.

Each step runs in its own process: huggingface_hub reads ``HF_ENDPOINT`` when it is imported."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hf_normswap
from hf_normswap.data import fingerprint
from hub_mirror import HubMirror, write_text_dataset
from tiny_models import tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
DATASET = "someone/tinytext"
# a clean process: no hf_normswap (`python -I` drops PYTHONPATH and the working directory; the module is blocked
# in case the environment installed it), only torch and transformers loading the pushed repository's remote code
LOAD_FROM_HUB = """
import sys
sys.modules["hf_normswap"] = None
try:
    import hf_normswap
    raise SystemExit("hf_normswap is importable")
except ImportError:
    pass
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
with torch.no_grad():
    torch.save(model(torch.load(sys.argv[2])).logits, sys.argv[3])
"""


def dataset_rows(split: str) -> list[str]:
    words = "norm scale token model layer block channel weight bias data".split()
    return [" ".join(words[(i + j) % len(words)] for j in range(40 + i)) + f" ({split} {i})" for i in range(24)]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The mirror with tiny/gpt2, tiny/llama (weights + tokenizer) and the dataset someone/tinytext (config
    ``small``: train and test parquet files declared in the dataset card, as Hub datasets are)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("hub")
    tokenizer = tiny_tokenizer()
    with HubMirror() as mirror:
        for model_type in ("gpt2", "llama"):
            folder = root / model_type
            model = tiny_model(model_type, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            mirror.add_folder(f"tiny/{model_type}", folder)
        folder = write_text_dataset(root / "tinytext", {split: [dataset_rows(split)] for split in ("train", "test")},
                                    config="small")
        mirror.add_folder(DATASET, folder, repo_type="dataset")
        yield mirror


def run(hub: HubMirror, cache: Path, *args: str, isolated: bool = False) -> subprocess.CompletedProcess:
    """A fresh process pointed at the mirror, with its own Hub cache; ``isolated``: ``python -I`` outside the repo."""
    env = hub.process_env(cache, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if not isolated:
        env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, "-I", *args] if isolated else [sys.executable, *args]
    result = subprocess.run(command, env=env, cwd=cache.parent, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def normswap(*args: str) -> list[str]:
    return ["-c", "import sys; from hf_normswap.cli import main; sys.exit(main(sys.argv[1:]))", *args]


def test_convert_from_hub_push_and_load_from_hub_without_the_package(hub, tmp_path):
    out = tmp_path / "gpt2-eln"
    result = run(hub, tmp_path / "cache", *normswap("convert", "tiny/gpt2", "--to", "eln", "--calib", "builtin",
                                                    "--calib-blocks", "4", "--calib-len", "64", "--output", str(out),
                                                    "--push-to-hub", "me/gpt2-eln"))
    assert f"pushed to {hub.url}/me/gpt2-eln" in result.stdout
    downloaded = {c["path"] for c in hub.calls if c["method"] == "GET"}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.rsplit("/", 1)[1] for p in downloaded
                                                                       if p.startswith("/tiny/gpt2/resolve/")}
    uploaded = hub.files("me/gpt2-eln")
    assert uploaded == {p.name: p.read_bytes() for p in out.iterdir()}
    config = json.loads(uploaded["config.json"])
    assert config["normswap"]["method"] == "eln" and len(config["normswap"]["converted"]) == 5
    assert config["normswap"]["calibration"]["data"] == "builtin"

    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    script = tmp_path / "load_from_hub.py"
    script.write_text(textwrap.dedent(LOAD_FROM_HUB))
    run(hub, tmp_path / "clean-cache", str(script), "me/gpt2-eln", str(tmp_path / "ids.pt"),
        str(tmp_path / "logits.pt"), isolated=True)
    assert any(c["path"].startswith("/me/gpt2-eln/resolve/") and c["path"].endswith("/modeling_normswap.py")
               for c in hub.calls)
    with torch.no_grad():
        expected = hf_normswap.load(out).eval()(ids).logits
    assert torch.equal(torch.load(tmp_path / "logits.pt"), expected)


def test_calibrate_on_a_hub_dataset_through_datasets(hub, tmp_path):
    out = tmp_path / "llama-eln"
    spec = f"{DATASET}:small:train"
    run(hub, tmp_path / "cache", *normswap("convert", "tiny/llama", "--to", "eln", "--calib", spec, "--calib-blocks",
                                           "4", "--calib-len", "64", "--output", str(out)))
    calibration = json.loads((out / "config.json").read_text())["normswap"]["calibration"]
    assert calibration["data"] == spec
    assert calibration["fingerprint"] == fingerprint(dataset_rows("train"))  # the train split's rows, in order
    assert any(c["method"] == "GET" and c["path"].startswith(f"/datasets/{DATASET}/resolve/")
               and c["path"].endswith("/small/train-00000-of-00001.parquet") for c in hub.calls)
