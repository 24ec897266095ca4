"""The recipe's ``output_dir``: the recipe deletes (checkpoint rotation) and resumes from what is in it, so it works
only in a directory it created, recorded in ``run.json`` with the model it trains and the parameters it trains.
A resume that names another model or trains other parameters is refused before anything loads, an interrupted
Trainer checkpoint is skipped, and the recipe's JSON files are written whole or not at all, as valid JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import try_to_load_from_cache
from safetensors import safe_open
from transformers import TrainingArguments
from transformers.trainer_pt_utils import safe_globals

from ..atomic_write import atomic_write
from ..checkpoint.directory import check_output_dir
from ..checkpoint.loading import resolve
from ..checkpoint.packaged import PREFIX as PACKAGED
from ..checkpoint.record import ConversionRecord
from ..evaluation import finite_json
from ..validation import ValidationError, check_path_length, first_line, shown
from .run_lock import LOCK

RECORD = "run.json"
WRITTEN_BY = "hf-normswap recipes/finetune.py"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
SAMPLES, SAMPLE_BYTES = 16, 1 << 16
CHECKPOINT = re.compile(r"checkpoint-(\d+)")


def write_json(path: Path, data) -> None:
    """``path`` holds the old content or the new, never a part: a kill mid-write must not break the next resume."""
    with atomic_write(path) as staging:
        staging.write_text(finite_json.dumps(data, indent=1, default=str))


def read_json(path: Path) -> dict | None:
    """The object in ``path``; None when it is missing or unreadable (written by an earlier, interrupted run)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def weights_fingerprint(path: Path) -> str | None:
    """A hash of the weight files at ``path`` (a directory or one file): names, sizes and 16 spread samples of each,
    so a 14 GB model is identified in milliseconds; two different trainings differ in every sample."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES
                                                 and p.is_file())
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as handle:
            for i in range(SAMPLES):
                handle.seek(i * max(0, size - SAMPLE_BYTES) // (SAMPLES - 1))
                digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def model_identity(spec: str) -> dict:
    """The model a spec names: the spec, its local path and its weights' fingerprint (a Hub id: of the cached
    snapshot, None before the first download)."""
    location, extra = resolve(spec)
    path = Path(location) / extra["gguf_file"] if "gguf_file" in extra else Path(location)
    if not path.exists():
        try:
            cached = try_to_load_from_cache(spec, "config.json")
        except ValueError:  # not a Hub id either: loading will say the model is not found
            cached = None
        return {"model": spec, "path": None,
                "weights": weights_fingerprint(Path(cached).parent) if isinstance(cached, str) else None}
    return {"model": spec, "path": str(path.resolve()), "weights": weights_fingerprint(path)}


def trained_parameters(trainable: str, freeze_embeddings: bool, lora) -> dict:
    """What decides the optimizer's state: a resume that trains other parameters cannot load it (``lora``: the
    adapters' settings, recorded where ``trainable`` is lora)."""
    return {"trainable": trainable, "freeze_embeddings": freeze_embeddings,
            "lora": dataclasses.asdict(lora) if trainable == "lora" else None}


# TrainingArguments' settings that a resume takes from the checkpoint's optimizer state (each parameter group's
# hyperparameters are restored with it), whatever the config says
RESTORED_TRAINING_ARGUMENTS = ("weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "optim", "optim_args")


def optimizer_settings(lr, training: dict) -> dict:
    """The settings a resumed optimizer would silently drop, as the run records them: the learning rates (each
    group's, and the scheduler's base rates, come back from the checkpoint) and the optimizer's own (of the
    ``training`` section)."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    restored = {f"training.{key}": training.get(key, defaults[key]) for key in RESTORED_TRAINING_ARGUMENTS}
    return {"lr.base": lr.base, "lr.shape": lr.shape, "lr.gamma": lr.gamma,
            **{key: getattr(value, "value", value) for key, value in restored.items()}}  # an enum: its name


def check_optimizer_settings(out: Path, record: dict, asked: dict, last: Path) -> None:
    """A resume from ``last`` keeps the optimizer settings recorded in ``record`` (run.json): refuse settings
    (``asked``: :func:`optimizer_settings`) that change one, which the checkpoint's card would record while the run
    trains with the old value."""
    recorded = record.get("optimizer")
    if not isinstance(recorded, dict):  # a run recorded before these were: nothing to compare with
        return
    changed = [f"{key} {shown(recorded.get(key))} (the config: {shown(value)})" for key, value in asked.items()
               if key in recorded and recorded[key] != value]
    if changed:
        raise ValidationError(f"output_dir {out} trained with {', '.join(changed)}: a resume restores them from "
                              f"{last.name}'s optimizer state and would train with the old values; set them back, "
                              "name a new output_dir, or set resume=false to start over")


def last_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete Trainer checkpoint: the Trainer writes ``trainer_state.json`` last, so a checkpoint a
    kill interrupted has none (or a part of one) and is skipped."""
    found = [(int(m.group(1)), p) for p in output_dir.glob("checkpoint-*")
             if (m := CHECKPOINT.fullmatch(p.name)) and p.is_dir()]
    for _, path in sorted(found, reverse=True):
        if read_json(path / "trainer_state.json") is not None:
            return path
    return None


@dataclass(frozen=True)
class ResumePoint:
    """Where a launch goes on from: the newest complete Trainer checkpoint (None: it trains from the calibrated
    model) and the Trainer's state saved with it (``trainer_state.json``; empty without one)."""

    checkpoint: str | None
    state: dict


def resume_point(output_dir: Path, resume: bool) -> ResumePoint:
    """The :class:`ResumePoint` of ``output_dir``: its last checkpoint when the run resumes, else none."""
    last = last_checkpoint(output_dir) if resume else None
    if last is None:
        return ResumePoint(None, {})
    return ResumePoint(str(last), read_json(last / "trainer_state.json"))


def finished_run(output_dir: Path, save_path: Path, resume: bool, train_tokens: int | None,
                 steps: int) -> str | None:
    """Where a finished run stands, when a relaunch would train nothing: the run recorded in run.json that it
    finished (else its last checkpoint says so) at ``train_tokens`` or more (else at the run's ``steps``), and the
    final checkpoint is still the one saved then; None otherwise. (The Trainer, resumed from a checkpoint at
    ``max_steps``, would train one more step and replace ``final``.) A larger budget with no Trainer checkpoint left
    to continue from would train again from the calibrated model and replace ``final``: a ValidationError."""
    if not (resume and output_dir.is_dir()):
        return None
    last = last_checkpoint(output_dir)
    record = read_json(output_dir / RECORD) or {}
    fact = record.get("finished")
    fact = fact if isinstance(fact, dict) and all(type(fact.get(k)) is int for k in ("steps", "tokens")) else None
    state = fact or (read_json(last / "trainer_state.json") if last else None)
    if not state:
        return None
    step = state.get("steps", state.get("global_step")) or 0
    tokens = state.get("tokens", state.get("num_input_tokens_seen")) or 0
    try:
        saved = ConversionRecord.read(save_path).training
    except ValidationError:  # no final checkpoint yet, or not one this package saved
        saved = None
    if not isinstance(saved, dict) or saved.get("steps") != step:
        return None  # stopped before its final checkpoint was saved: the relaunch finishes it
    done = tokens >= train_tokens if train_tokens is not None else 0 < steps <= step
    where = f"finished at {step} steps / {tokens:,} tokens"
    if done:
        more = ("raise train_tokens or training.max_steps to continue" if last is not None else
                "no Trainer checkpoint is left to continue from (training.save_strategy no, or removed): set "
                "resume=false to train anew")
        return f"{where}: nothing to train (final checkpoint {save_path}); {more}"
    if last is None:
        raise ValidationError(f"output_dir {output_dir} {where} (final checkpoint {save_path}) and holds no Trainer "
                              "checkpoint to continue from "
                              "(training.save_strategy no, or removed): a larger budget would train again from the "
                              "calibrated model and replace final; set resume=false to do that, or name a new "
                              "output_dir")
    return None


def damaged_checkpoint(checkpoint: Path) -> str | None:
    """Why the Trainer could not resume from ``checkpoint`` (a cut or foreign file), or None: each state file read as
    the Trainer reads it, tensors only (``weights_only``: a pickle that would run code is refused, not run) and
    memory-mapped, so an optimizer state of gigabytes is not read into memory."""
    for file in sorted(checkpoint.iterdir()):
        try:
            if file.suffix in (".pt", ".pth") or file.suffix == ".bin" and file.name != "training_args.bin":
                with safe_globals():  # the numpy types of rng_state.pth, which the Trainer allows too
                    torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            elif file.suffix == ".safetensors":
                with safe_open(file, "pt"):
                    pass
        except Exception as error:  # torch and safetensors raise their own types for a cut file or a foreign pickle
            return f"{file.name} cannot be read ({first_line(error)[:200]})"
    return None


def check_run_dir(config) -> None:
    """Refuse, before anything loads, an output_dir the recipe did not create, and a resume that would train another
    model or other parameters than the run recorded there."""
    out = Path(config.output_dir)
    check_path_length(out, "output_dir")
    inside = Path(os.path.realpath(out.expanduser()))
    # rotation and resumes would delete and read beside them
    for key, spec, source in read_sources(config.model, config.original):
        if source.is_dir() and source in (inside, *inside.parents):
            raise ValidationError(f"output_dir {out} is inside {key} {shown(spec)}, which the recipe reads: name an "
                                  "output_dir outside it")
    if not out.exists():
        return
    if not out.is_dir():
        raise ValidationError(f"output_dir {out} is not a directory; name a new or empty one")
    entries = sorted(p.name for p in out.iterdir())
    if not entries or entries == [LOCK] and not (out / LOCK).is_symlink():  # a launch killed as it began
        return
    linked = [name for name in entries if (out / name).is_symlink()]
    if linked:  # the recipe writes calibrated/, final/, checkpoints and its JSON files there: never through a link
        raise ValidationError(f"output_dir {out}: {linked[0]} is a link (to {os.readlink(out / linked[0])}); the "
                              "recipe writes only inside output_dir: remove the link, or name a new output_dir")
    record = read_json(out / RECORD)
    if record is None or record.get("written_by") != WRITTEN_BY:
        entries = [name for name in entries if name != LOCK]
        raise ValidationError(f"output_dir {out} holds files the recipe did not write ({', '.join(entries[:3])}"
                              f"{', ...' if len(entries) > 3 else ''}); it deletes and resumes from what is there: "
                              "name a new or empty output_dir")
    if not config.resume:
        return
    damaged = [key for key in ("model", "parameters") if not isinstance(record.get(key, {}), dict)]
    if damaged:
        raise ValidationError(f"{out / RECORD} is damaged ({damaged[0]} is {shown(record[damaged[0]])}, not an "
                              "object): name a new output_dir, or set resume=false to start over")
    recorded, now = record.get("model") or {}, model_identity(config.model)
    if recorded.get("model") != now["model"] or recorded.get("path") != now["path"]:
        changed = f"model {shown(recorded.get('model'))}"
    elif None not in (recorded.get("weights"), now["weights"]) and recorded["weights"] != now["weights"]:
        changed = f"other weights of {shown(now['model'])}"
    else:
        changed = None
    if changed:
        raise ValidationError(f"output_dir {out} was calibrated and trained from {changed}; the config names "
                              f"{shown(config.model)}: name another output_dir, or set resume=false to start over")
    asked = trained_parameters(config.trainable, config.freeze_embeddings, config.lora)
    last = last_checkpoint(out)
    damaged = damaged_checkpoint(last) if last is not None else None
    if damaged:
        raise ValidationError(f"{last} is damaged: {damaged}; delete {last} to resume from the one before, or set "
                              "resume=false to start over")
    if record.get("parameters") != asked and last is not None:
        raise ValidationError(f"output_dir {out} trains {record.get('parameters')}, the config {asked}: its "
                              "checkpoints' optimizer state fits those parameters only; set them back, name another "
                              "output_dir, or set resume=false to start over")
    if last is not None:
        check_optimizer_settings(out, record, optimizer_settings(config.lr, config.training), last)


def read_sources(model: str, original: str | None):
    """``(key, spec, real path)`` of the ``model`` and the ``original`` the recipe reads from disk (a packaged model
    lives in the package); a name too long to be a path or a Hub id is refused here."""
    for key, spec in (("model", model), ("original", original)):
        if spec and not spec.startswith(PACKAGED):
            check_path_length(spec, key)
            yield key, spec, Path(os.path.realpath(Path(spec).expanduser()))


def check_save_dir(config) -> None:
    """The final checkpoint replaces only one that a run in this output_dir saved (save_dir inside output_dir, or
    recorded in its run.json): never the model or the original it reads, nor any other checkpoint of the user's."""
    save = Path(os.path.realpath(config.save_path.expanduser()))
    for key, spec, source in read_sources(config.model, config.original):
        if source.exists() and save in (source, *source.parents):
            raise ValidationError(f"save_dir {config.save_path} would replace {key} {shown(spec)}, which the recipe "
                                  "reads: name another save_dir")
    check_output_dir(save, overwrite=True)
    out = Path(os.path.realpath(Path(config.output_dir).expanduser()))
    record = read_json(out / RECORD) or {}
    saved = record.get("saved") if record.get("written_by") == WRITTEN_BY else None
    saved = saved if isinstance(saved, str) else None
    owned = out in save.parents or save == Path(saved or "")
    if not owned and save.is_dir() and any(save.iterdir()):
        raise ValidationError(f"save_dir {config.save_path} holds a checkpoint the recipe did not save there; it "
                              "replaces only its own: name a new or empty save_dir")


def record_save(out: Path, save_path: Path, steps: int, tokens: int) -> None:
    """Note in ``out``'s run.json where the final checkpoint went, so that a later launch may replace it
    (check_save_dir), and that the run finished there at ``steps`` / ``tokens`` (``finished_run``: a fact of the
    folder, not of the Trainer checkpoints, which ``save_strategy: no`` never writes and a user may delete)."""
    record = read_json(out / RECORD) or {}
    write_json(out / RECORD, {**record, "saved": os.path.realpath(save_path.expanduser()),
                              "finished": {"steps": steps, "tokens": tokens}})


def claim_run_dir(config) -> None:
    """Create output_dir (main process) and record what it trains, before the models load; checked again first
    (``check_run_dir``): the recipe holds the folder's lock by now, and a launch that ended since the settings were
    checked may have changed it."""
    check_run_dir(config)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = read_json(out / RECORD) if config.resume else None
    identity = model_identity(config.model)
    if record is not None and record.get("model", {}).get("weights") is not None:
        identity = record["model"]  # a Hub id recorded once downloaded; check_run_dir compared the two
    kept = {key: record[key] for key in ("saved", "finished") if key in record} if record is not None else {}
    claimed = {"written_by": WRITTEN_BY, "model": identity,
               "parameters": trained_parameters(config.trainable, config.freeze_embeddings, config.lora),
               "optimizer": optimizer_settings(config.lr, config.training), **kept}
    write_json(out / RECORD, claimed)
