"""``normswap push DIR REPO``: upload a saved checkpoint to the Hub, its own files only (what else the folder holds
is named, not uploaded)."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.directory import checkpoint_files
from ..checkpoint.hub import push
from ..conversion.evaluation import warn


def add_parser(commands) -> None:
    hub = commands.add_parser("push", help="upload a saved checkpoint to the Hugging Face Hub")
    hub.add_argument("directory", help="checkpoint directory written by `normswap convert --output`")
    hub.add_argument("repo", help="Hub repository, NAME or OWNER/NAME (created if missing)")
    hub.add_argument("--private", action="store_true", help="create the repo private")


def run(args) -> None:
    print(f"pushed to {push(args.directory, args.repo, private=args.private)}")
    folder = Path(args.directory)
    kept = sorted({p.name for p in folder.iterdir()} - set(checkpoint_files(folder)))
    if kept:
        warn(f"not uploaded, not part of the checkpoint: {', '.join(kept)}")
