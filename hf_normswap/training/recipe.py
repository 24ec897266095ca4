"""The recovery recipe: convert with calibration, train against the original, evaluate, save.

    normswap recover --config recipes/configs/smollm2-eln.yaml training.max_steps=50
    accelerate launch recipes/finetune.py --config recipes/configs/smollm2-eln.yaml
    accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml recipes/finetune.py --config ...
    accelerate launch --config_file recipes/accelerate_configs/fsdp2.yaml recipes/finetune.py --config ...  (sharded)
    python recipes/finetune.py --config recipes/configs/smollm2-eln.yaml train_tokens=500000 output_dir=DIR

Settings come from the YAML config, then from ``key=value`` overrides (dotted keys reach into sections; values are
read as YAML), checked before anything loads (``recipe_settings``, ``recipe_data.check_data``). Steps:

1. load the original (Hub id, directory, ``.gguf``, ``offline:smollm2``) and convert a copy with calibration, or
   load an already converted checkpoint (its original from ``original:``); the calibrated model is cached in
   ``OUTPUT/calibrated`` so a resumed run does not calibrate again (it refuses a cache calibrated otherwise;
   ``resume=false`` calibrates anew) (``recipe_models``);
2. evaluate the calibrated model against the original (main process);
3. train with :class:`~hf_normswap.training.trainer.NormSwapTrainer`: cross-entropy plus optional distillation from
   the frozen original (its logits and / or every block's output; a sentence encoder trains on the blocks' outputs
   alone), norm-only / full / LoRA training, optional progressive conversion, ``train_tokens`` in total over every
   launch (it sets ``max_steps``); resumes from the last checkpoint, so a long run can be done in chunks;
4. evaluate again (a sentence encoder: mean cosine of sentence embeddings to the original's), save the checkpoint
   with remote code and a model card that records the training, check that it reloads with identical logits, draw
   the loss / perplexity curve, optionally push to the Hub (``recipe_results``).
"""

from __future__ import annotations

import contextlib
import errno
import time
from pathlib import Path

import torch

from ..checkpoint.directory import CheckpointError
from ..checkpoint.record import ConversionRecord
from ..validation import first_line
from .compiled_blocks import keep_compile_cache
from .recipe_data import check_data, packs_blocks
from .recipe_models import load_models
from .recipe_results import final_evaluation, finish
from .recipe_settings import COMMAND, fail, load_config, stopped
from .recipe_training import train


def main(argv: list[str] | None = None, command: str = "finetune") -> int:
    """Run the recipe on ``argv`` (``--config FILE`` and ``key=value`` overrides; None: the command line): resolve
    the run, load (calibrating or loading the converted model), evaluate, train, evaluate and save. ``command``:
    what the user ran, named by every error and log line."""
    from accelerate import PartialState
    from transformers import set_seed

    from ..planning.recovery_run import RecoveryRunError, resolve_run
    from ..validation import ValidationError
    from .run_dir import claim_run_dir, finished_run, read_json
    from .sharding import fsdp2_requested, loads_once

    launched = time.monotonic()
    COMMAND.set(command)
    config = load_config(argv)
    if config.threads:
        torch.set_num_threads(int(config.threads))
    # On a machine without GPU, `accelerate launch --multi_gpu --num_processes N` starts N CPU processes; they
    # join with gloo only when the state is created with cpu=True (accelerate's --cpu starts a single process).
    cpu = bool(config.training.get("use_cpu")) or not torch.cuda.is_available()
    state = PartialState(cpu=cpu)
    device_memory = torch.cuda.get_device_properties(state.device).total_memory if state.device.type == "cuda" else None
    try:
        run = resolve_run(config, processes=state.num_processes, is_main=state.is_main_process,
                          device=str(state.device), cpu=cpu, sharded=fsdp2_requested(), load_once=loads_once(),
                          device_memory=device_memory)
    except RecoveryRunError as error:  # settings that name no run: a mistake, before anything loads
        fail(str(error))
    check_data(config, run.calibrates, packs_blocks(run.original))
    with held_run_dir(config.output_dir, state), written_or_stopped(config.output_dir):
        set_seed(config.seed)
        try:  # under the lock, on the main process: a launch that ended meanwhile may have changed the folder
            done = finished_run(run.output_dir, run.save_path, config.resume, config.train_tokens, run.steps)
            if state.is_main_process and not done:
                claim_run_dir(config)
        except ValidationError as error:
            fail(str(error))
        if done:
            if state.is_main_process:
                print(f"[{command}] {done}", flush=True)
            return 0
        summary = (read_json(run.output_dir / "summary.json") or {}) if config.resume else {}
        summary["config"] = config.to_dict()
        log = (lambda *a: print(f"[{command}]", *a, flush=True)) if state.is_main_process else (lambda *a: None)
        log(f"step: {run.batch_size} x {config.block_len} tokens x {run.accumulation} accumulated x "
            f"{run.processes} processes = {run.tokens_per_step:,} tokens, {run.steps} steps")
        log_memory_plan(run, device_memory, state, log)
        keep_compile_cache(run.output_dir)

        student, original, tokenizer = load_models(run, state)
        original.eval().requires_grad_(False)
        record = ConversionRecord.of(student)
        log(f"{len(record.converted)} {record.method.upper()} norms; original {run.original}")
        eval_texts = evaluate_calibrated(config, student, original, tokenizer, summary, state, log)
        trained = train(run, student, original, tokenizer, state, log, launched)
        hand_over = trained.hand_over
        if hand_over is not None and not hand_over.finished:  # half handed over: not the converted model
            log(f"{hand_over.name}: stopped at step {hand_over.stopped_at} of its {hand_over.end} "
                f"({hand_over.status()}); no converted model saved: launch again to resume from the last checkpoint")
            state.wait_for_everyone()
            return 0
        finish(config, state, trained, original, tokenizer, eval_texts, summary, log)
        state.wait_for_everyone()
    return 0


@contextlib.contextmanager
def held_run_dir(output_dir: str, state):
    """Held while the launch runs: ``output_dir`` claimed under its lock (``run_lock``) by the main process. A second
    launch into the same folder is refused in one line before any model loads, on every process of it."""
    from accelerate.utils import broadcast_object_list

    from ..validation import ValidationError
    from .run_lock import lock_run_dir

    lock, refusal = None, None
    if state.is_main_process:
        try:
            lock = lock_run_dir(output_dir)
        except ValidationError as error:
            refusal = str(error)
    if state.num_processes > 1:
        refusal = broadcast_object_list([refusal])[0]
    if refusal is not None:
        if state.is_main_process:
            fail(refusal)
        raise SystemExit(2)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


RESUMES = "it goes on from its last checkpoint, if any"


@contextlib.contextmanager
def written_or_stopped(output_dir: str):
    """A write of the run's own that fails (a full disk at run.json, summary.json, the curve, a Trainer checkpoint
    or the calibrated cache) stops the run in one line; its last checkpoint is kept to resume from."""
    try:
        yield
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise stopped(f"cannot write in output_dir {output_dir} ({first_line(error)}); free disk space and launch "
                      f"again: {RESUMES}") from None
    except CheckpointError as error:
        raise stopped(f"{error}; launch again once that is fixed: {RESUMES}") from None


def log_memory_plan(run, device_memory: int | None, state, log) -> None:
    """What the run is about to need (``normswap plan``), before anything loads; a model the plan cannot read
    (remote code, a config it does not know) is said in one line and the run goes on."""
    if not state.is_main_process:
        return
    from ..planning import PlanError, plan, run_plan_settings

    try:
        memory = plan(run.original, run_plan_settings(run, device_memory))
    except (PlanError, OSError, ValueError) as error:
        log(f"memory plan: not available ({error})")
        return
    log(f"memory plan:\n{memory.describe()}")


def evaluate_calibrated(config, student, original, tokenizer, summary: dict, state, log):
    """The calibrated model against the original, once (a resumed run keeps the first measurement), on the main
    process; returns the evaluation texts, which the final evaluation reads again (every process under FSDP2)."""
    from accelerate.utils import broadcast_object_list

    from ..data import DataError
    from ..evaluation.documents import evaluation_texts
    from .run_dir import write_json
    from .sharding import fsdp2_requested

    def texts():
        try:
            return evaluation_texts(config.eval_data, original, tokenizer, config.final_eval.max_tokens)
        except DataError as error:  # e.g. the original's samples cannot be cached
            raise stopped(f"eval_data: {error}") from None

    eval_texts = texts() if state.is_main_process else None
    if state.is_main_process and "calibrated" not in summary:
        start = time.time()
        before = final_evaluation(student, original, tokenizer, eval_texts, config.eval_data, config.final_eval,
                                  "calibrated")
        summary["calibrated"] = before.to_dict()
        write_json(Path(config.output_dir) / "summary.json", summary)
        log(f"after calibration ({time.time() - start:.0f}s):\n{before.table()}")
    state.wait_for_everyone()
    if fsdp2_requested() and state.num_processes > 1:  # under FSDP2 every process takes part in the final one,
        eval_texts = broadcast_object_list([eval_texts])[0]  # on the main process's texts (the others may hold no
    return eval_texts  # weights to sample the original's from)
