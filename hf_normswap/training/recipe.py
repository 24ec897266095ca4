"""The recovery recipe: convert with calibration, train against the original, evaluate, save.

    normswap recover --config recipes/configs/smollm2-eln.yaml training.max_steps=50
    accelerate launch recipes/finetune.py --config recipes/configs/smollm2-eln.yaml
    accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml recipes/finetune.py --config ...
    accelerate launch --config_file recipes/accelerate_configs/fsdp2.yaml recipes/finetune.py --config ...  (sharded)
    python recipes/finetune.py --config recipes/configs/smollm2-eln.yaml train_tokens=500000 output_dir=DIR

Settings come from the YAML config, then from ``key=value`` overrides (dotted keys reach into sections; values are
read as YAML), checked before anything loads (``recipe_settings``, ``recipe_data.check_data``). The steps are the
methods of :class:`RecoveryRecipe`, in the order they run:

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
import dataclasses
import errno
import gc
import time
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list
from transformers import TrainingArguments, set_seed

from ..checkpoint import hub
from ..checkpoint.directory import CheckpointError
from ..checkpoint.publish import probe_logits, reloads_identically
from ..checkpoint.record import ConversionRecord
from ..data import DataError
from ..evaluation.documents import evaluation_texts
from ..model_inputs import ends_in_hidden_states
from ..planning import PlanError, plan, run_plan_settings
from .recovery_run import RecoveryRunError, check_calibration_cache, resolve_run
from ..validation import ValidationError, first_line
from .compiled_blocks import compile_blocks, keep_compile_cache
from .config import RecipeConfig
from .divergence import check_finite
from .hand_overs import converted_roles
from .hand_overs.blend import HandOverError
from .recipe_data import check_data, packs_blocks, recipe_datasets, sentence_steps
from .recipe_models import load_models, skeleton_to_gather, whole_student
from .recipe_results import (block_perplexity, closing_line, final_evaluation, fit_for_use, launch_entry,
                             launch_history, plot_history, save_final)
from .recipe_settings import COMMAND, fail, load_config, stopped
from .recipe_training import (TrainingRun, choose_trainable, own_share, progressive_swap, recovery_loss,
                              training_callbacks)
from .run_dir import ResumePoint, claim_run_dir, finished_run, read_json, record_save, resume_point, write_json
from .run_lock import lock_run_dir
from .sharding import fsdp2_requested, is_sharded, loads_once
from .step_precision import training_precision
from .trainable import merge_lora
from .trainer import NormSwapTrainer, without_autocast_wrapper
from .wall_clock import FirstStepClock

RESUMES = "it goes on from its last checkpoint, if any"


def main(argv: list[str] | None = None, command: str = "finetune") -> int:
    """Run the recipe on ``argv`` (``--config FILE`` and ``key=value`` overrides; None: the command line).
    ``command``: what the user ran, named by every error and log line."""
    launched = time.monotonic()
    COMMAND.set(command)
    recipe = RecoveryRecipe(load_config(argv), launched)
    return recipe.recover()


class RecoveryRecipe:
    """One recovery of a converted model, its steps as methods in the order they run: set up (this launch's state
    and the run resolved from the settings, checked before anything loads), claim the run folder, load, evaluate
    the start, train, evaluate and save. The run, the state, the log and the summary are held here, so that the
    helpers each step calls get plain values."""

    def __init__(self, config: RecipeConfig, launched: float):
        """``launched``: when the launch started (``time.monotonic()``), for the seconds to its first step."""
        self.config, self.launched, self.summary = config, launched, {}
        self.resume_from: ResumePoint | None = None  # read when the run folder is claimed
        if config.threads:
            torch.set_num_threads(int(config.threads))
        # On a machine without GPU, `accelerate launch --multi_gpu --num_processes N` starts N CPU processes; they
        # join with gloo only when the state is created with cpu=True (accelerate's --cpu starts a single process).
        cpu = bool(config.training.get("use_cpu")) or not torch.cuda.is_available()
        self.state = state = PartialState(cpu=cpu)
        self.log = run_log(state.is_main_process)
        cuda = state.device.type == "cuda"
        self.device_memory = torch.cuda.get_device_properties(state.device).total_memory if cuda else None
        try:  # settings that name no run, or a cache calibrated otherwise: a mistake, before anything loads
            self.run = resolve_run(config, processes=state.num_processes, is_main=state.is_main_process,
                                   device=str(state.device), cpu=cpu, sharded=fsdp2_requested(),
                                   load_once=loads_once(), device_memory=self.device_memory)
            if config.resume and self.run.calibrates:
                check_calibration_cache(self.run.calibrated_cache, config.method, config.calibration,
                                        config.roles_to_convert)
        except (RecoveryRunError, ValidationError, CheckpointError) as error:
            fail(str(error))
        check_data(config, self.run.calibrates, packs_blocks(self.run.original))

    def recover(self) -> int:
        """The recovery, holding its run folder; 0 also when a finished run has nothing to train, and when a
        hand-over stopped half way (the next launch resumes it)."""
        state = self.state
        with (held_run_dir(self.config.output_dir, state.is_main_process, state.num_processes),
              written_or_stopped(self.config.output_dir)):
            set_seed(self.config.seed)
            if not self.claim():
                return 0
            student, original, tokenizer = self.load()
            eval_texts = self.evaluate_start(student, original, tokenizer)
            trained = self.train(student, original, tokenizer)
            stopped_half_way = half_handed_over(trained.hand_over)
            if stopped_half_way:
                self.log(stopped_half_way)
            else:
                self.finish(trained, original, tokenizer, eval_texts)
            state.wait_for_everyone()
        return 0

    def claim(self) -> bool:
        """Read where the run folder's last checkpoint leaves this launch, claim the folder (the main process, under
        its lock: a launch that ended meanwhile may have changed it) and begin this launch's summary (a resumed run's
        so far), logging the step and the memory plan; False, said in one line, when the run finished already with
        nothing left to train."""
        config, run = self.config, self.run
        try:
            self.resume_from = resume_point(run.output_dir, config.resume)
            done = finished_run(run.output_dir, run.save_path, config.resume, config.train_tokens, run.steps)
            if self.state.is_main_process and not done:
                claim_run_dir(config)
        except ValidationError as error:
            fail(str(error))
        if done:
            self.log(done)
            return False
        self.summary = (read_json(run.output_dir / "summary.json") or {}) if config.resume else {}
        self.summary["config"] = config.to_dict()
        self.log(f"step: {run.batch_size} x {config.block_len} tokens x {run.accumulation} accumulated x "
                 f"{run.processes} processes = {run.tokens_per_step:,} tokens, {run.steps} steps")
        if self.state.is_main_process:  # what the run is about to need (``normswap plan``), before anything loads;
            try:  # a model the plan cannot read (remote code, a config it does not know) is said, and the run goes on
                self.log(f"memory plan:\n{plan(run.original, run_plan_settings(run, self.device_memory)).describe()}")
            except (PlanError, OSError, ValueError) as error:
                self.log(f"memory plan: not available ({error})")
        keep_compile_cache(run.output_dir)
        return True

    def load(self) -> tuple:
        """(student, original, tokenizer): the converted model (calibrated, or read) and its frozen original."""
        student, original, tokenizer = load_models(self.run, self.state)
        original.eval().requires_grad_(False)
        record = ConversionRecord.of(student)
        self.log(f"{len(record.converted)} {record.method.upper()} norms; original {self.run.original}")
        return student, original, tokenizer

    def evaluate_start(self, student, original, tokenizer) -> list[str] | None:
        """The calibrated model against the original, once (a resumed run keeps the first measurement), on the main
        process; returns the evaluation texts, which the final evaluation reads again (every process under FSDP2)."""
        config, state, summary = self.config, self.state, self.summary
        eval_texts = None
        if state.is_main_process:
            try:
                eval_texts = evaluation_texts(config.eval_data, original, tokenizer, config.final_eval.max_tokens)
            except DataError as error:  # e.g. the original's samples cannot be cached
                raise stopped(f"eval_data: {error}") from None
        if state.is_main_process and "calibrated" not in summary:
            start = time.time()
            before = final_evaluation(student, original, tokenizer, eval_texts, config.eval_data, config.final_eval,
                                      "calibrated")
            summary["calibrated"] = before.to_dict()
            write_json(self.run.output_dir / "summary.json", summary)
            self.log(f"after calibration ({time.time() - start:.0f}s):\n{before.table()}")
        state.wait_for_everyone()
        if fsdp2_requested() and state.num_processes > 1:  # under FSDP2 every process takes part in the final one,
            eval_texts = broadcast_object_list([eval_texts])[0]  # on the main process's texts (the others may hold
        return eval_texts  # no weights to sample the original's from)

    def train(self, student, original, tokenizer) -> TrainingRun:
        """The training rows, the trainable parameters (norms, all, LoRA; progressive conversion), the precision,
        then :class:`NormSwapTrainer` from the run folder's last checkpoint when resuming."""
        run, state, log = self.run, self.state, self.log
        config = run.settings
        encoder = ends_in_hidden_states(original)
        distill = config.distill
        if encoder and not (distill.weight == 1 and not distill.logits and (distill.hidden or distill.embedding)):
            fail("a sentence encoder has no logits: train it on hidden states alone, distill.weight=1 "
                 "distill.logits=false and distill.hidden or distill.embedding > 0 (recipes/configs/minilm-eln.yaml)")
        train_set, eval_set = recipe_datasets(run.text, tokenizer, original, state, encoder)
        steps = (sentence_steps(config.train_tokens, run.tokens_per_step // config.block_len, train_set)
                 if encoder and config.train_tokens is not None else run.steps)
        if steps <= 0 and not hasattr(train_set, "__len__"):
            fail(f"train_data {config.train_data} is read as a stream, which has no epochs: set train_tokens or "
                 "training.max_steps")
        kind = config.hand_over.chosen(config.progressive, config.taper, config.trainable)
        swap, started = progressive_swap(kind, steps, run.original_read_once, student, original,
                                         state.is_main_process)
        if started:
            log(started)
        hand_over = kind.callback(swap, converted_roles(student), log) if swap is not None else None
        loss = recovery_loss(distill, config.head_chunk, student)
        student, trainable, dropout = choose_trainable(student, config.trainable, config.lora,
                                                       config.freeze_embeddings)
        if dropout:
            log(f"dropout off in {dropout} places of the student: it is fitted to the original's exact outputs")
        rows = f"sentences (at most {config.block_len} tokens)" if encoder else f"blocks of {config.block_len} tokens"
        mix = f", a mix of {' + '.join(run.text.sources)}" if len(run.text.sources) > 1 else ""
        log(f"training {trainable:,} parameters ({config.trainable}) on "
            + (f"{config.train_data} streamed in {rows}" if not hasattr(train_set, "__len__") else
               f"{len(train_set)} {rows}{mix}"))
        precision = training_precision(config.precision, loss, run.batch_size, student, original, train_set,
                                       tokenizer, state)
        log(precision.describe())
        if config.compile if config.compile is not None else state.device.type == "cuda":
            log(f"compiled: {compile_blocks([student, original])} blocks of the student and the original")
        args = TrainingArguments(output_dir=str(Path(config.output_dir)), seed=config.seed,
                                 learning_rate=config.lr.base, prediction_loss_only=True, eval_on_start=not encoder,
                                 **{"include_num_input_tokens_seen": "non_padding" if encoder else "all",
                                    # a loss that is not finite is logged as it is, not as the average of the rest
                                    "logging_nan_inf_filter": False,
                                    **own_share(train_set, config.streaming),
                                    **config.training, "per_device_train_batch_size": run.batch_size,
                                    "gradient_accumulation_steps": run.accumulation, "use_cpu": run.cpu,
                                    "max_steps": steps, "bf16": precision.bf16})
        first_step = FirstStepClock(self.launched)
        saturation = Path(config.output_dir) / "saturation.jsonl" if state.is_main_process else None
        callbacks = training_callbacks(student, first_step, config.max_minutes, saturation,
                                       config.first_scale_handover, hand_over)
        skeleton = skeleton_to_gather(student)  # after LoRA and the trainable choice: the model as it is sharded
        trainer = NormSwapTrainer(model=student, args=args, train_dataset=train_set, eval_dataset=eval_set,
                                  processing_class=tokenizer, callbacks=callbacks,
                                  teacher=original if distill.weight > 0 else None, loss=loss,
                                  shape_lr=config.lr.shape, gamma_lr=config.lr.gamma,
                                  shard_teacher=config.shard_teacher)
        last = self.resume_from.checkpoint
        log(f"resuming from {last}" if last else "training from the calibrated model")
        start = time.time()
        try:
            result = trainer.train(resume_from_checkpoint=last)
        except HandOverError as error:  # checked with the Trainer's count of steps: an epoch-based run's, a resume's
            fail(str(error))
        return TrainingRun(trainer=trainer, result=result, precision=precision, skeleton=skeleton, eval_set=eval_set,
                           encoder=encoder, wall=time.time() - start, last=last, resumed=self.resume_from.state,
                           first_step=first_step.seconds, hand_over=hand_over)

    def finish(self, trained: TrainingRun, original, tokenizer, eval_texts: list[str] | None) -> None:
        """After training: evaluate (every process when sharded), then on the main process save the checkpoint with
        the record of its training (the ``training`` part of its ``ConversionRecord``) and its evaluation, check
        that it reloads with identical logits, draw the curve, write ``summary.json`` and push if asked. A model
        with weights that are not finite (a diverged training) stops the run before any of it (``divergence``)."""
        config, state, summary, trainer = self.config, self.state, self.summary, trained.trainer
        out, save_dir, encoder = self.run.output_dir, self.run.save_path, trained.encoder
        skeleton, trained.skeleton = trained.skeleton, None  # held here alone: freed once the save is checked
        model = without_autocast_wrapper(trainer.accelerator.unwrap_model(trainer.model))
        check_finite(model, trainer, state.num_processes)  # before the evaluation, the save and the push
        sharded = skeleton is not None and is_sharded(model)
        if state.is_main_process or sharded:
            after = final_evaluation(model, original, tokenizer, eval_texts, config.eval_data, config.final_eval,
                                     "finetuned")
            original_block_ppl = None if encoder else block_perplexity(original, trained.eval_set)
        model = whole_student(trainer, model, skeleton if sharded else None, original, state.is_main_process)
        if not state.is_main_process:
            return
        model = merge_lora(model).eval()
        self.log(f"after training:\n{after.table()}")
        history = launch_history(summary, trained.resumed, trainer.state.log_history)
        launches = summary.get("launches", []) + [launch_entry(trained)]
        training = {"steps": trainer.state.global_step, "tokens_seen": trainer.state.num_input_tokens_seen,
                    "trainable": config.trainable, "distill": dataclasses.asdict(config.distill),
                    "loss": trainer.recovery_loss.describe(), "lr": dataclasses.asdict(config.lr),
                    "progressive": dataclasses.asdict(config.progressive) if config.progressive.enabled else None,
                    "taper": {**dataclasses.asdict(config.taper), "steps": trained.hand_over.steps}
                    if config.taper.fraction else None,
                    "hand_over": trained.hand_over.describe() if trained.hand_over is not None else None,
                    "train_data": config.train_data, "block_len": config.block_len,
                    "precision": vars(trained.precision), "freeze_embeddings": config.freeze_embeddings,
                    "wall_seconds": round(sum(s["wall_seconds"] for s in launches), 1),
                    "world_size": state.num_processes, "train_loss": trained.result.training_loss}
        ConversionRecord.amend(model, training=training)
        fit = None if encoder else fit_for_use(after, model, original, tokenizer, eval_texts, config.final_eval)
        if fit is not None:
            self.log(f"fit for use:\n{fit.parts_table()}")
        card = None if encoder else dict(after.card("finetuned"), **({"fit_for_use": fit.parts_table()} if fit else {}))
        expected = probe_logits(model, tokenizer)
        save_final(model, save_dir, tokenizer, card)
        steps, tokens = trainer.state.global_step, trainer.state.num_input_tokens_seen
        record_save(out, save_dir, steps, tokens)
        if sharded:  # the gathered copy (the skeleton filled) goes before the reloaded one comes; reference cycles
            del model, skeleton  # hold the module past ``del``, so they are collected here
            gc.collect()
        identical = reloads_identically(expected, save_dir, tokenizer)
        curve = plot_history(history, out / "curve.png", original_block_ppl,
                             f"{config.model} -> {config.method.upper()}, {config.trainable}, {tokens:,} tokens")
        summary.update(finetuned=after.to_dict(), training=training, launches=launches, history=history,
                       reload_identical=identical, curve=str(curve), checkpoint=str(save_dir),
                       original_eval_block_perplexity=original_block_ppl, fit_for_use=fit and fit.parts_dict())
        closing = closing_line(summary, encoder, trained.wall)
        write_json(out / "summary.json", summary)
        self.log(closing)
        if config.push_to_hub:
            self.log(f"pushed to {hub.push(save_dir, config.push_to_hub)}")


def run_log(is_main: bool):
    """The run's log: a line that starts with the command's name, printed by the main process alone."""
    if not is_main:
        return lambda *parts: None
    return lambda *parts: print(f"[{COMMAND.get()}]", *parts, flush=True)


def half_handed_over(hand_over) -> str | None:
    """Why nothing is saved when the run's hand-over (the taper's or the progressive swap's callback, None without
    one) stopped before its end: half handed over, the model is not the converted one; None otherwise."""
    if hand_over is None or hand_over.finished:
        return None
    return (f"{hand_over.name}: stopped at step {hand_over.stopped_at} of its {hand_over.end} ({hand_over.status()}); "
            "no converted model saved: launch again to resume from the last checkpoint")


@contextlib.contextmanager
def held_run_dir(output_dir: str, is_main: bool, processes: int):
    """Held while the launch runs: ``output_dir`` claimed under its lock (``run_lock``) by the main process. A second
    launch into the same folder is refused in one line before any model loads, on every process of it."""
    lock, refusal = None, None
    if is_main:
        try:
            lock = lock_run_dir(output_dir)
        except ValidationError as error:
            refusal = str(error)
    if processes > 1:
        refusal = broadcast_object_list([refusal])[0]
    if refusal is not None:
        if is_main:
            fail(refusal)
        raise SystemExit(2)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


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
