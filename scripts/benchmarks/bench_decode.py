"""A converted model against its original: the forward over a batch and greedy generation, tokens/s.

Per model (``--models``): the original, then the same model converted in place (ELN, the ``fast`` calibration on
two random blocks, so that activations stay in a calibrated model's range), then folded in place (``--fold``'s
``hf_normswap.fold``). One model is held at a time, so Llama-3-8B's shapes (16 GB in bf16) fit one GPU; the
variants run one after another in the same process, each the median of ``--reps`` runs after one warm-up.

Models: ``smollm2-random`` and ``llama3-8b-random`` (their shapes with random weights, built on the device; their
speed needs no download), or a spec ``hf_normswap.load`` reads (``offline:smollm2``, a folder). Generation: a
``--prompt``-token prompt, exactly ``--new-tokens`` new tokens (``min_new_tokens``: no early end) at each of
``--gen-batches``; transformers' default cache.

    python scripts/benchmarks/bench_decode.py --device cuda --models smollm2-random,llama3-8b-random --json /tmp/decode.json
    python scripts/benchmarks/bench_decode.py --models smollm2-random --layers 2 --batch 1 --seq 32 --gen-batches 1 \\
        --new-tokens 4 --reps 1   # a CPU smoke run
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from hf_normswap import CalibrationConfig, METHODS, convert, fold

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared harness (run by path)

from harness.flags import add_device, add_output, script_parser
from harness.record import commit, machine

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHAPES = {  # LlamaConfig arguments
    "smollm2-random": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                           tie_word_embeddings=True),
    "llama3-8b-random": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                             tie_word_embeddings=False),
}


def log(*args):
    print(*args, flush=True)


def build(name: str, device: str, dtype: torch.dtype, layers: int | None):
    """(model in eval mode on ``device``, vocabulary size)."""
    if name in SHAPES:
        import transformers

        shape = dict(SHAPES[name], max_position_embeddings=8192)
        if layers:
            shape["num_hidden_layers"] = layers
        config = transformers.LlamaConfig(**shape)
        torch.manual_seed(0)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):  # built where it runs: 16 GB never passes through CPU memory
                model = transformers.LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
        return model.eval(), config.vocab_size
    from hf_normswap import load_model

    model, _ = load_model(name, dtype=dtype, with_tokenizer=False, device=device)
    return model.eval(), model.config.vocab_size


def synchronize(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, reps: int, fn) -> float:
    fn()  # warm-up: Triton's first launch, allocator
    times = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model, vocab: int, args) -> dict:
    """Tokens/s of the forward (``--batch`` x ``--seq``) and of generation at each ``--gen-batches``."""
    device = args.device
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(device)
    result = {}
    with torch.inference_mode():
        seconds = timed(device, args.reps, lambda: model(input_ids=ids, use_cache=False))
        result[f"forward {args.batch}x{args.seq}"] = args.batch * args.seq / seconds
        for batch in map(int, args.gen_batches.split(",")):
            prompt = torch.randint(0, vocab, (batch, args.prompt), generator=generator).to(device)
            kwargs = dict(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                          max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0)
            seconds = timed(device, args.reps, lambda: model.generate(**kwargs))
            result[f"generate batch {batch}"] = batch * args.new_tokens / seconds
    return result


def bench_model(name: str, args) -> list[dict]:
    model, vocab = build(name, args.device, DTYPES[args.dtype], args.layers)
    rows = []

    def record(variant: str):
        for mode, tokens_per_s in measure(model, vocab, args).items():
            rows.append(dict(model=name, variant=variant, mode=mode, dtype=args.dtype, tokens_per_s=tokens_per_s))
            log(f"{name:<18} {variant:<10} {mode:<24} {tokens_per_s:12.1f} tok/s")

    record("original")
    ids = torch.randint(0, vocab, (2, 256), generator=torch.Generator().manual_seed(3))
    calibration = CalibrationConfig(data=ids, num_blocks=2, block_len=256, batch_size=2, strategy="fast",
                                    progress=False)
    convert(model, to=args.method, calibration=calibration)
    record(args.method)
    report = fold(model)
    log(f"{name}: folded {report}")
    record(f"{args.method}-folded")
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    originals = {row["mode"]: row["tokens_per_s"] for row in rows if row["variant"] == "original"}
    for row in rows:
        row["vs_original"] = round(row["tokens_per_s"] / originals[row["mode"]], 4)
    return rows


def parse_args(argv=None):
    parser = script_parser(__doc__)
    add_device(parser)
    parser.add_argument("--models", default="smollm2-random,llama3-8b-random")
    parser.add_argument("--method", default="eln", choices=list(METHODS))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--layers", type=int, help="random models: fewer layers (a smoke run)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--gen-batches", default="1,32")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    add_output(parser, None, "write all rows to this file", flag="--json")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {args.device}: no CUDA GPU here; use --device cpu", file=sys.stderr)
        return 2
    rows = []
    for name in args.models.split(","):
        rows += bench_model(name, args)
        if args.json:  # after each model: a call cut short keeps the models it finished
            Path(args.json).write_text(json.dumps({"machine": machine(args.device), "commit": commit(), "argv": sys.argv[1:],
                                                   "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
