"""Export the packaged SmolLM2 (``offline:smollm2``, a 98 MB GGUF) as a bf16 safetensors checkpoint in parts that
each fit one send to the GPU machine, which has neither the ``gguf`` reader nor the network.

    python scripts/export_smollm2_safetensors.py OUT_DIR

writes ``OUT_DIR/part-1`` ... ``OUT_DIR/part-N``: the weights in shards of at most ``--shard-mb`` (default 60), one
shard a part, and in ``part-1`` also the config, the shard index and the tokenizer, every part under
``--part-mib`` (default 60; a send carries at most 64 MiB, the code included). 134.5 million parameters in bf16 are
269 MB, so five parts (the tied 56.6 MB embedding is one tensor, a shard of its own). How it goes over:

1. Put OUT_DIR inside the checkout where git ignores it: ``OUT_DIR=shared/smollm2-bf16`` with ``/shared/smollm2-bf16/``
   in ``.git/info/exclude``.
2. One ``run`` a part, on the same warm machine (ignored paths already there are kept between calls):
   ``carry=["shared/smollm2-bf16/part-1"]`` with a short command (``ls shared/smollm2-bf16``), then ``part-2``, ... up to
   ``part-N``. A machine given back in between loses the parts sent before it.
3. Then ``SMOLLM2_DIR=shared/smollm2-bf16 bash scripts/gpu_check.sh $OUT/check``, whose recovery step links the
   parts' files into one folder and trains from it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_normswap.checkpoint.loading import load_model  # noqa: E402


def export(out: Path, shard_mb: int, part_mib: float) -> list[Path]:
    """The checkpoint in ``out/whole``, then its files moved into parts of at most ``part_mib`` MiB."""
    model, tokenizer = load_model("offline:smollm2", dtype=torch.bfloat16)
    # the weights are dense once dequantized: drop the GGUF reader's marks, or the GPU machine would look for it
    model.hf_quantizer = None
    del model.config.quantization_config
    whole = out / "whole"
    model.save_pretrained(whole, max_shard_size=f"{shard_mb}MB")
    tokenizer.save_pretrained(whole)
    shards = sorted(whole.glob("model*.safetensors"))
    rest = [f for f in sorted(whole.iterdir()) if f not in shards]
    parts, size = [rest], sum(f.stat().st_size for f in rest)
    for shard in shards:
        if size + shard.stat().st_size > part_mib * 2**20 and parts[-1]:
            parts.append([])
            size = 0
        if shard.stat().st_size > part_mib * 2**20:
            raise SystemExit(f"{shard.name} is {shard.stat().st_size / 2**20:.1f} MiB, over --part-mib {part_mib}: "
                             f"lower --shard-mb")
        parts[-1].append(shard)
        size += shard.stat().st_size
    folders = []
    for index, files in enumerate(parts, 1):
        folder = out / f"part-{index}"
        folder.mkdir()
        for file in files:
            shutil.move(file, folder / file.name)
        folders.append(folder)
    whole.rmdir()
    return folders


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="a new or empty folder")
    parser.add_argument("--shard-mb", type=int, default=60, help="largest weight shard, MB (default: %(default)s)")
    parser.add_argument("--part-mib", type=float, default=60, help="largest part, MiB (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.out_dir.exists() and any(args.out_dir.iterdir()):
        parser.error(f"{args.out_dir} is not empty: name a new folder")
    for folder in export(args.out_dir, args.shard_mb, args.part_mib):
        files = sorted(folder.iterdir())
        print(f"{folder}: {sum(f.stat().st_size for f in files) / 2**20:.1f} MiB, {', '.join(f.name for f in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
