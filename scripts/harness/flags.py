"""The flags the scripts share, each with one spelling and one help text: the threads, the output, the models, the
device; and the parser that shows a script's docstring (its usage lines) under ``--help``."""

from __future__ import annotations

import argparse

import torch


def script_parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser, its whole docstring, usage lines included, as the description."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_threads(parser: argparse.ArgumentParser, default: int | None = 1) -> None:
    """``--threads``: torch's threads in this process and OMP_NUM_THREADS of the processes it starts (None: every
    core)."""
    shown = "every core" if default is None else default
    parser.add_argument("--threads", type=int, default=default,
                        help=f"CPU threads, here and in the processes started (default: {shown})")


def use_threads(args: argparse.Namespace) -> None:
    """Run this process on ``--threads`` threads (every core when not given)."""
    if args.threads:
        torch.set_num_threads(args.threads)


def add_output(parser: argparse.ArgumentParser, default: str | None, what: str, flag: str = "--out") -> None:
    """The output flag (``--out``, or ``--json`` for the speed benchmarks' one file of rows)."""
    parser.add_argument(flag, default=default, help=f"{what} (default: %(default)s)" if default else what)


def add_model(parser: argparse.ArgumentParser, default: str = "offline:smollm2") -> None:
    """``--model``: one model, as the ``normswap`` command takes it."""
    parser.add_argument("--model", default=default,
                        help="a Hub id, a local folder, a .gguf file or offline:NAME (default: %(default)s)")


def add_models(parser: argparse.ArgumentParser, choices, default, what: str = "comma-separated", *,
               listed: bool = False) -> None:
    """``--models``: the benchmark's named models, comma-separated (``listed``: as separate words)."""
    if listed:
        parser.add_argument("--models", nargs="+", default=list(default), choices=list(choices))
    else:
        parser.add_argument("--models", default=default, help=f"{what}: {', '.join(choices)} (default: %(default)s)")


def add_device(parser: argparse.ArgumentParser, what: str = "cpu, cuda, cuda:1 (default: cpu)") -> None:
    """``--device``: where the benchmark runs."""
    parser.add_argument("--device", default="cpu", help=what)


def add_text_blocks(parser: argparse.ArgumentParser, what: str, blocks: int = 4, block_len: int = 512,
                    data: str | None = None) -> None:
    """``--data`` (required unless a default is given), ``--blocks`` and ``--block-len``: the token blocks an
    analysis runs (``hf_normswap.data.token_blocks``)."""
    parser.add_argument("--data", required=data is None, default=data, help=what)
    parser.add_argument("--blocks", type=int, default=blocks, help="blocks of text (default: %(default)s)")
    parser.add_argument("--block-len", type=int, default=block_len, help="tokens a block (default: %(default)s)")
