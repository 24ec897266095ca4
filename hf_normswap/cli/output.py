"""Where a conversion goes: ``--output`` and ``--push-to-hub`` (the verb ``normswap push`` is ``push.py``). A save or
push that fails keeps the converted model in a temporary directory that the error names, so a long conversion is
never lost."""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

from ..atomic_write import atomic_write
from ..checkpoint.hub import PushError, push
from ..checkpoint.kept import keep
from ..checkpoint.model_card import hub_id
from ..checkpoint.directory import CheckpointError
from ..checkpoint.saving import save_pretrained
from ..validation import first_line


def saver(args, model, tokenizer):
    """``save(directory, **options)`` for the converted model, with its tokenizer and the original's Hub id."""
    return functools.partial(save_pretrained, model, tokenizer=tokenizer, base_model=hub_id(args.model))


def save_output(args, save) -> str:
    """Save into ``--output``; on failure into a temporary directory that the error names."""
    try:
        save(args.output, overwrite=args.overwrite)
    except (OSError, CheckpointError) as error:
        kept = keep(save, Path(args.output).name)
        raise CheckpointError(f"cannot save to {args.output} ({first_line(error)}); the converted model is kept "
                              f"in {kept}: move it into place") from None
    print(f"saved to {args.output}")
    return args.output


def save_and_push(args, model, tokenizer) -> None:
    """Save and push; when either fails, the converted model is kept in a temporary directory that the error names,
    so a long conversion is never lost to a full disk, a vanished directory or a network failure."""
    save = saver(args, model, tokenizer)
    if args.output:
        save_output(args, save)
    if args.push_to_hub:
        folder = args.output or keep(save, "checkpoint")
        try:
            print(f"pushed to {push(folder, args.push_to_hub, private=args.private)}")
        except PushError as error:
            where = "" if args.output else f"; the converted model is kept in {folder}: push it with `normswap push`"
            raise PushError(f"{error}{where}") from None
        if not args.output:
            shutil.rmtree(Path(folder).parent)


def write_whole(path, text: str) -> None:
    """``path`` holds the new text or what it held before, never a part: a write that fails (a full disk) leaves no
    empty or truncated file (``--report``). A device or a pipe (``/dev/stdout``) is written in place."""
    path = Path(os.path.realpath(Path(path).expanduser()))
    if path.exists() and not path.is_file():
        path.write_text(text)
        return
    with atomic_write(path) as staging:
        staging.write_text(text)
