"""Calibration with the weights on disk (``normswap convert --max-host-memory``): its peak memory on a model larger
than the limit, and the same checkpoint as calibrating in memory.

    python scripts/benchmarks/bench_from_disk.py --out out/bench-from-disk                       # both cases
    python scripts/benchmarks/bench_from_disk.py --out out/bench-from-disk --cases llama3b --max-host-memory 4GB
    python scripts/benchmarks/bench_from_disk.py --out out/bench-from-disk --replan   # the 3B prediction made again

Cases, each conversion in a fresh process (one thread, glibc returning freed memory to the OS):
- ``equal``: SmolLM2-135M (``offline:smollm2``, real weights) saved as safetensors, calibrated (ELN, ``block``, no
  end-to-end steps) in memory and with every weight on disk; the two checkpoints compared tensor by tensor;
- ``llama3b``: a Llama-3.2-3B-shaped model with random weights (fp32, 12.9 GB), written shard by shard into a
  temporary folder (never whole in memory; removed afterwards), calibrated within ``--max-host-memory`` as the
  command line does (``planning/disk.py`` sets what stays in memory), and saved; the peak resident memory (VmHWM)
  against the limit and the plan.

``OUT/results.json`` holds the machine, the commit and each case's numbers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared harness (run by path)

from harness.flags import add_output, script_parser
from harness.memory import memory_environment, peak_rss_mb
from harness.record import ROOT, commit, machine

# Llama-3.2-3B's published shape (tied embeddings)
LLAMA_3B = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                rope_theta=500000.0, tie_word_embeddings=True)
# few short sequences: memory depends on the shapes; the random model's case reads random token ids
CALIBRATION = dict(num_blocks=4, block_len=64, batch_size=2, strategy="block", block_steps=2, block_rows=1,
                   tune_steps=0)
SHARD_BYTES = 2**30


def call(function: str, *args: str) -> dict:
    """One of this file's workers in a fresh process; the JSON it prints last."""
    result = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--call", function, *args], cwd=ROOT,
                            env=memory_environment(), capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{function} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------- inside the processes


def write_random_llama(folder: str) -> dict:
    """The 3B shape's weights drawn tensor by tensor and written as safetensors shards of about 1 GiB, with
    ``model.safetensors.index.json`` and ``config.json``: never more than one shard in memory."""
    import torch
    import transformers
    from accelerate import init_empty_weights
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(**LLAMA_3B)
    with init_empty_weights():
        model = transformers.LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    names = [n for n in model.state_dict() if not (config.tie_word_embeddings and n == "lm_head.weight")]
    shard, size, files, weight_map, total = {}, 0, [], {}, 0

    def flush():
        nonlocal shard, size
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(Path(folder) / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({key: name for key in shard})
        shard, size = {}, 0

    for name in names:
        shape = model.state_dict()[name].shape
        tensor = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=generator) * 0.02
        shard[name], size, total = tensor, size + tensor.numel() * 4, total + tensor.numel() * 4
        if size >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    (Path(folder) / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config.save_pretrained(folder)
    return {"bytes": total, "shards": len(files)}


def save_smollm2(folder: str) -> dict:
    import hf_normswap  # noqa: F401  (kernels for the GGUF load)
    from hf_normswap import load_model

    model, tokenizer = load_model("offline:smollm2")
    model.hf_quantizer = None  # saved as the dense tensors it holds
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {}


def calibrate(model_dir: str, out: str, limit: str, data: str) -> dict:
    """Load (within ``limit``: ``none`` for all in memory, ``all-on-disk``, or a size given to the plan as
    ``--max-host-memory`` is), calibrate, save; the peak resident memory of the whole."""
    import torch

    # internal: the weights on disk (offload) and in memory as the plan counts them; imported in the worker, whose
    # memory is what is measured
    import hf_normswap
    from hf_normswap import CalibrationConfig, load_model, offload
    from hf_normswap.planning.disk import weights_in_memory
    from hf_normswap.planning.plan_settings import parse_bytes

    torch.set_num_threads(1)
    config = CalibrationConfig(data=None, progress=False, **CALIBRATION)
    fixed = {"none": None, "all-on-disk": 1}
    weights = fixed[limit] if limit in fixed else weights_in_memory(model_dir, config, parse_bytes(limit))
    start = time.time()
    model, tokenizer = load_model(model_dir, weights_memory=weights)
    loaded = time.time()
    kept = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if t.device.type != "meta")
    if data == "random":
        config.data = torch.randint(0, model.config.vocab_size, (config.num_blocks, config.block_len),
                                    generator=torch.Generator().manual_seed(0))
    else:
        config.data, config.tokenizer = data, tokenizer
    hf_normswap.convert(model, "eln", calibration=config)
    calibrated = time.time()
    hf_normswap.save_pretrained(model, out)
    return {"peak_mb": round(peak_rss_mb()), "weights_in_memory": weights, "kept_in_memory": kept,
            "on_disk": offload.is_offloaded(model),
            "load_s": round(loaded - start, 1), "calibration_s": round(calibrated - loaded, 1),
            "save_s": round(time.time() - calibrated, 1)}


def compare(first: str, second: str) -> dict:
    """Tensor by tensor, bit for bit, the weights of two saved checkpoints."""
    import torch
    from safetensors import safe_open

    def tensors(folder):
        out = {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
        return out

    a, b = tensors(first), tensors(second)
    differing = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
    return {"tensors": len(a), "same_names": a.keys() == b.keys(), "differing": differing[:5],
            "bit_identical": a.keys() == b.keys() and not differing}


WORKERS = {f.__name__: f for f in (write_random_llama, save_smollm2, calibrate, compare)}

# ------------------------------------------------------------------------------------------------------ the cases


def equal_case(work: Path, data: str) -> dict:
    source = work / "smollm2"
    call("save_smollm2", str(source))
    runs = {mode: call("calibrate", str(source), str(work / mode), mode, data) for mode in ("none", "all-on-disk")}
    return {"case": "equal", "data": data, "calibration": CALIBRATION, "in_memory": runs["none"],
            "on_disk": runs["all-on-disk"], **call("compare", str(work / "none"), str(work / "all-on-disk"))}


def predicted_mb(kept_in_memory: int) -> int:
    """The plan's peak for the 3B case: what calibration from disk needs beside the weights (``disk.py``), plus the
    weights accelerate's device map kept in memory."""
    import transformers

    # internal: the plan's own arithmetic, whose prediction is checked against the measurement
    from hf_normswap import CalibrationConfig
    from hf_normswap.planning import PlanSettings, model_sizes
    from hf_normswap.planning.disk import beside_the_weights
    from hf_normswap.planning.recipe_plan import calibration_settings

    config = CalibrationConfig(data=None, **CALIBRATION)
    sizes = model_sizes(transformers.LlamaConfig(**LLAMA_3B))
    return round((beside_the_weights(sizes, PlanSettings(**calibration_settings(config))) + kept_in_memory) / 2**20)


def with_prediction(case: dict) -> dict:
    """The 3B case with the plan's prediction (made again by ``--replan``; the measurement kept)."""
    predicted = predicted_mb(case["kept_in_memory"])
    return {**case, "predicted_mb": predicted, "predicted_over_measured": round(predicted / case["peak_mb"], 3)}


def llama3b_case(work: Path, limit: str) -> dict:
    from hf_normswap.planning.plan_settings import parse_bytes  # internal: a size read as --max-host-memory's

    source = work / "llama3b"
    source.mkdir()
    written = call("write_random_llama", str(source))
    run = call("calibrate", str(source), str(work / "llama3b-eln"), limit, "random")
    return with_prediction({"case": "llama3b", "weights_bytes": written["bytes"], "limit": limit,
                            "calibration": CALIBRATION, **run,
                            "peak_over_limit": round(run["peak_mb"] * 2**20 / parse_bytes(limit), 3)})


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--call"]:
        print(json.dumps(WORKERS[argv[1]](*argv[2:])))
        return 0
    parser = script_parser(__doc__)
    add_output(parser, "out/bench-from-disk", "folder for the checkpoints and the rows")
    parser.add_argument("--cases", nargs="+", default=["equal", "llama3b"], choices=["equal", "llama3b"])
    parser.add_argument("--max-host-memory", default="4GB", help="the 3B case's limit")
    parser.add_argument("--data", default="builtin", help="the equal case's calibration text")
    parser.add_argument("--work", default=None, help="folder for the temporary models (default: the system's)")
    parser.add_argument("--replan", action="store_true",
                        help="make the 3B case's prediction in OUT/results.json again, at this commit, running nothing")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.replan:
        if not (out / "results.json").is_file():
            parser.error(f"--replan: no {out / 'results.json'}; run the benchmark into {out} first")
        results = json.loads((out / "results.json").read_text())
        results["cases"] = [with_prediction(c) if c["case"] == "llama3b" else c for c in results["cases"]]
        results["predicted_at"] = commit()
        (out / "results.json").write_text(json.dumps(results, indent=1))
        print(json.dumps([c for c in results["cases"] if c["case"] == "llama3b"]))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    results = {"machine": machine(), "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": " ".join([Path(sys.argv[0]).name, *argv]), "cases": []}
    for name in args.cases:
        with tempfile.TemporaryDirectory(prefix="bench-from-disk-", dir=args.work) as work:
            start = time.time()
            case = equal_case(Path(work), args.data) if name == "equal" else llama3b_case(Path(work),
                                                                                         args.max_host_memory)
            case["wall_s"] = round(time.time() - start, 1)
        results["cases"].append(case)
        print(json.dumps(case), flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
