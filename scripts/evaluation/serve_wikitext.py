"""Run a command against a local Hub mirror that serves lm-eval's ``wikitext`` dataset from a local WikiText-2 file.

lm-evaluation-harness's ``wikitext`` task reads the Hub dataset ``EleutherAI/wikitext_document_level`` (config
``wikitext-2-raw-v1``, one row per article, column ``page``). Without the Hub, this script builds that dataset from
``wiki.test.raw`` (articles split at their top-level `` = Title = `` headings, as the Hub dataset is), serves it with
the tests' local Hub (``tests/hub_mirror.py``) on 127.0.0.1, and runs the command after ``--`` with ``HF_ENDPOINT`` pointing there and a
fresh Hub cache, so lm-eval runs unchanged:

    python scripts/evaluation/serve_wikitext.py --test wiki.test.raw -- \\
        lm_eval --model hf --model_args pretrained=out/smollm2-eln,trust_remote_code=True --tasks wikitext --device cpu

``train`` and ``validation`` hold one empty page unless given: lm-eval scores ``test``; the others only give few-shot
examples (the task reads them when it is built, so they must exist).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the local Hub lives with the tests

from hub_mirror import HubMirror

REPO = "EleutherAI/wikitext_document_level"
CONFIG = "wikitext-2-raw-v1"
HEADING = re.compile(r"^ = [^=].* = $")


def articles(path: Path) -> list[str]:
    """The articles of a WikiText raw file: each starts at a top-level heading line."""
    pages: list[list[str]] = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if HEADING.match(line.rstrip("\n")) or not pages:
            pages.append([])
        pages[-1].append(line)
    return ["".join(page) for page in pages if "".join(page).strip()]


def build_repo(folder: Path, splits: dict[str, Path | None]) -> None:
    """The dataset repository: one parquet file per split, declared in the card; a split without a file holds one
    empty page (datasets refuses a split without rows)."""
    import datasets

    card = ["---", "configs:", f"- config_name: {CONFIG}", "  data_files:"]
    (folder / CONFIG).mkdir(parents=True, exist_ok=True)
    for split, source in splits.items():
        name = f"{CONFIG}/{split}-00000-of-00001.parquet"
        datasets.Dataset.from_dict({"page": articles(source) if source else [""]}).to_parquet(folder / name)
        card += [f"  - split: {split}", f"    path: {name}"]
    (folder / "README.md").write_text("\n".join(card + ["---", ""]))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--test", type=Path, required=True, help="WikiText-2 raw test file (wiki.test.raw)")
    parser.add_argument("--validation", type=Path, help="raw validation file (wiki.valid.raw), optional")
    parser.add_argument("--train", type=Path, help="raw train file (wiki.train.raw), optional")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if not command:
        parser.error("give the command to run after --")
    splits = {"train": args.train, "validation": args.validation, "test": args.test}
    for path in filter(None, splits.values()):
        if not path.is_file():
            parser.error(f"no such file: {path}")
    with tempfile.TemporaryDirectory() as scratch, HubMirror() as hub:
        build_repo(Path(scratch) / "repo", splits)
        hub.add_folder(REPO, Path(scratch) / "repo", repo_type="dataset")
        env = dict(os.environ, **hub.env(), HF_HOME=str(Path(scratch) / "hf-home"))
        given = ", ".join(f"{split} from {path}" for split, path in splits.items() if path)
        print(f"serving {REPO} ({given}) at {hub.url}", file=sys.stderr, flush=True)
        return subprocess.run(command, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
