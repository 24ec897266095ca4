"""The recipe's results: the converted model evaluated against the original (perplexity, or a sentence encoder's
embedding cosine), the checkpoint saved with the record of its training, checked to reload with identical logits,
and the loss / learning-rate / perplexity curve drawn."""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
from pathlib import Path

import torch

from .loss_terms import plot_labels


def final_evaluation(model, original, tokenizer, texts: list[str], data: str, settings, name: str):
    """The converted model against the original on ``texts`` (of the spec ``data``), with the ``final_eval``
    ``settings``. Sharded models are evaluated on every process alike (each forward gathers its units from all of
    them)."""
    from ..evaluation.perplexity import evaluate
    from ..evaluation.embeddings import evaluate_embeddings
    from ..model_inputs import ends_in_hidden_states

    if ends_in_hidden_states(original):  # the embedding its users consume: cosine, neighbours and rank correlation
        return evaluate_embeddings(model, original, tokenizer, texts, data=data, **settings.arguments())
    return evaluate({name: model}, tokenizer, texts, against=original, data=data, progress=False,
                    **settings.arguments())


def fit_for_use(after, model, original, tokenizer, texts: list[str], settings, log):
    """The final evaluation completed by ``final_eval``'s tails and tasks (``evaluation.report``), None when it
    names neither; logged (``settings``: the run's ``final_eval``)."""
    from ..evaluation.report import FitSettings, fit_report
    from ..evaluation.tasks import check_tasks

    if not settings.tails and settings.task_names is None:
        return None
    tasks = None if settings.task_names is None else check_tasks(settings.task_names, [])  # checked at the start
    asked = FitSettings(context=settings.tails, tasks=tasks, limit=settings.limit, num_fewshot=settings.num_fewshot,
                        max_tokens=settings.max_tokens, batch_size=settings.batch_size or 1)
    report = fit_report(after, {"original": original, "converted": model}, tokenizer, texts, asked)
    log(f"fit for use:\n{report.parts_table()}")
    return report



@torch.no_grad()
def block_perplexity(model, dataset, batch_size: int = 4) -> float:
    """exp(mean next-token loss) over the eval blocks: the same number the Trainer logs as eval_perplexity."""
    model.eval()
    losses = []
    for start in range(0, len(dataset), batch_size):
        ids = torch.tensor(dataset[start:start + batch_size]["input_ids"], device=next(model.parameters()).device)
        losses.append(float(model(input_ids=ids, labels=ids).loss) * len(ids))
    return math.exp(sum(losses) / len(dataset))



def plot_history(history: list[dict], path: Path, original_ppl: float | None, title: str) -> Path:
    """Training loss, each parameter group's learning rate, and eval perplexity, over training tokens (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def tokens(rows):
        return [h.get("num_input_tokens_seen", 0) for h in rows]

    train = [h for h in history if "loss" in h]
    evals = [h for h in history if "eval_perplexity" in h]
    fig, (ax_loss, ax_lr, ax_ppl) = plt.subplots(1, 3, figsize=(15, 4))
    if train:
        ax_loss.plot(tokens(train), [h["loss"] for h in train], label="training loss")
        for key, label in plot_labels().items():  # every loss term's parts (training.loss_terms)
            rows = [h for h in train if h.get(key)]  # a term that is off logs 0
            if rows:
                ax_loss.plot(tokens(rows), [h[key] for h in rows], lw=0.8, label=label)
        ax_loss.legend(fontsize=8)
    for key in sorted({k for h in train for k in h if k.startswith("learning_rate/")}):
        rows = [h for h in train if key in h]
        ax_lr.plot(tokens(rows), [h[key] for h in rows], label=key.split("/", 1)[1])
    if ax_lr.lines:
        ax_lr.legend(fontsize=8, title="parameter group", title_fontsize=8)
    ax_loss.set(xlabel="training tokens", ylabel="loss", title="training")
    ax_lr.set(xlabel="training tokens", ylabel="learning rate", title="learning rate per parameter group",
              yscale="log")
    if evals:
        ax_ppl.plot(tokens(evals), [h["eval_perplexity"] for h in evals], "o-", label="converted")
    if original_ppl is not None:
        ax_ppl.axhline(original_ppl, c="k", ls="--", label=f"original ({original_ppl:.4g})")
        ax_ppl.axhline(1.3 * original_ppl, c="grey", ls=":", label="1.3 x original")
    ax_ppl.set(xlabel="training tokens", ylabel="perplexity", title="eval perplexity", yscale="log")
    if ax_ppl.lines:  # an encoder has no perplexity (it is evaluated by embedding cosine after training)
        ax_ppl.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def probe_logits(model, tokenizer) -> torch.Tensor:
    """The model's output on a fixed input, for the reload check."""
    from ..model_inputs import first_tensor

    ids = tokenizer("Normalization layers can be replaced by element-wise functions.", return_tensors="pt")
    model.eval()
    with torch.no_grad():
        return first_tensor(model(input_ids=ids["input_ids"].to(next(model.parameters()).device)))


def reloads_identically(expected: torch.Tensor, directory: Path, tokenizer) -> bool:
    """Load the saved checkpoint back (hf_normswap.load) and compare its logits with the saved model's
    (``probe_logits`` before the save) bit for bit."""
    import hf_normswap

    reloaded = hf_normswap.load(directory).to(expected.device)
    return torch.equal(expected, probe_logits(reloaded, tokenizer))



def save_final(model, save_dir: Path, tokenizer, evaluation: dict | None) -> None:
    """The final checkpoint; a save that fails (a full disk) keeps the trained model in a temporary directory that
    the one-line error names, as a convert's save does."""
    import hf_normswap

    from ..checkpoint.directory import CheckpointError
    from ..checkpoint.kept import keep
    from ..validation import first_line
    from .recipe_settings import stopped

    save = functools.partial(hf_normswap.save_pretrained, model, tokenizer=tokenizer, evaluation=evaluation)
    try:
        save(save_dir, overwrite=True)
    except (OSError, CheckpointError) as error:
        try:
            kept = keep(save, save_dir.name)
        except CheckpointError as lost:
            raise stopped(f"cannot save to {save_dir} ({first_line(error)}); {lost}") from None
        raise stopped(f"cannot save to {save_dir} ({first_line(error)}); the trained model is kept in {kept}: move "
                      "it into place") from None


def finish(config, state, run, original, tokenizer, eval_texts, summary: dict, log) -> None:
    """After training: evaluate (every process when sharded), then on the main process save the checkpoint with
    the record of its training (the ``training`` part of its :class:`~hf_normswap.checkpoint.record.ConversionRecord`) and its evaluation, check that it reloads with
    identical logits, draw the curve, write ``summary.json`` and push if asked. A model with weights that are not
    finite (a diverged training) stops the run before any of it (``divergence``)."""
    from ..checkpoint.record import ConversionRecord
    from .divergence import check_finite
    from .trainable import merge_lora
    from .trainer import without_autocast_wrapper
    from .recipe_models import whole_student
    from .run_dir import launch_history, record_save, write_json
    from .sharding import is_sharded

    out, save_dir, trainer, encoder = Path(config.output_dir), config.save_path, run.trainer, run.encoder
    skeleton, run.skeleton = run.skeleton, None  # held here alone, so that it is freed once the save is checked
    model = without_autocast_wrapper(trainer.accelerator.unwrap_model(trainer.model))
    check_finite(model, trainer, state)  # before the evaluation, the save and the push
    sharded = skeleton is not None and is_sharded(model)
    if state.is_main_process or sharded:
        after = final_evaluation(model, original, tokenizer, eval_texts, config.eval_data, config.final_eval,
                                 "finetuned")
        original_block_ppl = None if encoder else block_perplexity(original, run.eval_set)
    model = whole_student(trainer, model, skeleton if sharded else None, original, state)
    if not state.is_main_process:
        return
    model = merge_lora(model).eval()
    log(f"after training:\n{after.table()}")
    history = launch_history(summary, run.resumed, trainer.state.log_history)
    tokens = trainer.state.num_input_tokens_seen
    launches = summary.get("launches", []) + [{"resumed_from": run.last, "wall_seconds": round(run.wall, 1),
                                               "start_step": run.resumed.get("global_step", 0),
                                               "start_tokens": run.resumed.get("num_input_tokens_seen", 0),
                                               "global_step": trainer.state.global_step, "tokens": tokens,
                                               "first_step_seconds": run.first_step and round(run.first_step, 1)}]
    training = {"steps": trainer.state.global_step, "tokens_seen": tokens, "trainable": config.trainable,
                "distill": dataclasses.asdict(config.distill), "loss": run.trainer.recovery_loss.describe(),
                "lr": dataclasses.asdict(config.lr),
                "progressive": dataclasses.asdict(config.progressive) if config.progressive.enabled else None,
                "taper": {**dataclasses.asdict(config.taper), "steps": run.hand_over.steps} if config.taper.fraction
                else None,
                "hand_over": run.hand_over.describe() if run.hand_over is not None else None,
                "train_data": config.train_data, "block_len": config.block_len,
                "precision": vars(run.precision), "freeze_embeddings": config.freeze_embeddings,
                "wall_seconds": round(sum(s["wall_seconds"] for s in launches), 1),
                "world_size": state.num_processes, "train_loss": run.result.training_loss}
    ConversionRecord.amend(model, training=training)
    fit = None if encoder else fit_for_use(after, model, original, tokenizer, eval_texts, config.final_eval, log)
    card = None if encoder else dict(after.card("finetuned"), **({"fit_for_use": fit.parts_table()} if fit else {}))
    expected = probe_logits(model, tokenizer)
    save_final(model, save_dir, tokenizer, card)
    record_save(out, save_dir, trainer.state.global_step, tokens)
    if sharded:  # the gathered copy (the skeleton filled) goes before the reloaded one comes; reference cycles
        del model, skeleton  # hold the module past ``del``, so they are collected here
        gc.collect()
    identical = reloads_identically(expected, save_dir, tokenizer)
    curve = plot_history(history, out / "curve.png", original_block_ppl,
                         f"{config.model} -> {config.method.upper()}, {config.trainable}, {tokens:,} tokens")
    summary.update(finetuned=after.to_dict(), training=training, launches=launches, history=history,
                   reload_identical=identical, curve=str(curve), checkpoint=str(save_dir),
                   original_eval_block_perplexity=original_block_ppl, fit_for_use=fit and fit.parts_dict())
    write_json(out / "summary.json", summary)
    ratio = {k: summary[k]["results"]["converted"]["cosine"] if encoder else summary[k]["ratio"].get(k)
             for k in ("calibrated", "finetuned")}
    log(f"{'embedding cosine to' if encoder else 'perplexity /'} original: {ratio['calibrated']:.4g} after "
        f"calibration -> {ratio['finetuned']:.4g} after "
        f"{trainer.state.global_step} steps ({tokens:,} tokens, {run.wall / 60:.1f} min); saved {save_dir} "
        f"(reloads identically: {identical}); curve {curve}")
    if config.push_to_hub:
        from ..checkpoint.hub import push

        log(f"pushed to {push(save_dir, config.push_to_hub)}")
