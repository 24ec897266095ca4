"""The recipe's results: the converted model evaluated against the original (perplexity, or a sentence encoder's
embedding cosine), the checkpoint saved with the record of its training, checked to reload with identical logits,
and the loss / learning-rate / perplexity curve drawn."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

import hf_normswap  # its load and save_pretrained looked up at the call, as a user's code calls them
from ..checkpoint.directory import CheckpointError
from ..checkpoint.publish import save_or_keep
from ..evaluation.embeddings import evaluate_embeddings
from ..evaluation.perplexity import PerplexitySettings, evaluate
from ..evaluation.fit_for_use import FitSettings, fit_report
from ..evaluation.tasks import check_tasks
from ..model_inputs import ends_in_hidden_states
from .recipe_settings import stopped
from .recipe_training import TrainingRun
from .loss_terms import plot_labels


def final_evaluation(model, original, tokenizer, texts: list[str], data: str, settings, name: str):
    """The converted model against the original on ``texts`` (of the spec ``data``), with the ``final_eval``
    ``settings``. Sharded models are evaluated on every process alike (each forward gathers its units from all of
    them)."""
    if ends_in_hidden_states(original):  # the embedding its users consume: cosine, neighbours and rank correlation
        return evaluate_embeddings(model, original, tokenizer, texts, data=data, **settings.arguments())
    return evaluate({name: model}, tokenizer, texts, against=original, data=data,
                    settings=PerplexitySettings(progress=False, **settings.arguments()))


def fit_for_use(after, model, original, tokenizer, texts: list[str], settings):
    """The final evaluation completed by ``final_eval``'s tails and tasks (``evaluation.fit_for_use``), None when it
    names neither (``settings``: the run's ``final_eval``)."""
    if not settings.tails and settings.task_names is None:
        return None
    tasks = None if settings.task_names is None else check_tasks(settings.task_names, [])  # checked at the start
    asked = FitSettings(context=settings.tails, tasks=tasks, limit=settings.limit, num_fewshot=settings.num_fewshot,
                        max_tokens=settings.max_tokens, batch_size=settings.batch_size or 1)
    return fit_report(after, {"original": original, "converted": model}, tokenizer, texts, asked)



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
    # matplotlib loads for the curve alone, and its backend is chosen here: a caller's own stays untouched until then
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


def save_final(model, save_dir: Path, tokenizer, evaluation: dict | None) -> None:
    """The final checkpoint, saved as a convert's is (``checkpoint.publish``): a save that fails (a full disk) keeps
    the trained model in a temporary directory that the one-line error names."""
    save = functools.partial(hf_normswap.save_pretrained, model, tokenizer=tokenizer, evaluation=evaluation)
    try:
        save_or_keep(save, save_dir, overwrite=True, what="trained model")
    except CheckpointError as error:
        raise stopped(str(error)) from None


def launch_entry(trained: TrainingRun) -> dict:
    """This launch as ``summary.json``'s ``launches`` records it: where it resumed from, how long it ran, and the
    steps and tokens it started and ended at."""
    state = trained.trainer.state
    return {"resumed_from": trained.last, "wall_seconds": round(trained.wall, 1),
            "start_step": trained.resumed.get("global_step", 0),
            "start_tokens": trained.resumed.get("num_input_tokens_seen", 0),
            "global_step": state.global_step, "tokens": state.num_input_tokens_seen,
            "first_step_seconds": trained.first_step and round(trained.first_step, 1)}


def launch_history(summary: dict, resumed_state: dict, log_history: list[dict]) -> list[dict]:
    """The logged rows of every launch: the earlier launches' as ``summary.json`` holds them, then the rows this one
    logged. The Trainer's own history, restored from the checkpoint it resumed (``resumed_state``), ends at that
    checkpoint's step: an earlier launch's rows after it (its final summary row, steps after the last save) were
    lost from ``summary.json`` at each resume. A launch that resumed nothing started over: its rows alone."""
    if not resumed_state:
        return log_history
    restored = resumed_state.get("log_history") or []
    return (summary.get("history") or restored) + log_history[len(restored):]


def closing_line(summary: dict, encoder: bool, wall: float) -> str:
    """The run's last line, from its ``summary``: the converted model to the original after calibration and after
    training (an encoder's embedding cosine, else the perplexity ratio), this launch's ``wall`` seconds, and where
    the checkpoint and the curve went."""
    ratio = {k: summary[k]["results"]["converted"]["cosine"] if encoder else summary[k]["ratio"].get(k)
             for k in ("calibrated", "finetuned")}
    training = summary["training"]
    return (f"{'embedding cosine to' if encoder else 'perplexity /'} original: {ratio['calibrated']:.4g} after "
            f"calibration -> {ratio['finetuned']:.4g} after {training['steps']} steps ({training['tokens_seen']:,} "
            f"tokens, {wall / 60:.1f} min); saved {summary['checkpoint']} (reloads identically: "
            f"{summary['reload_identical']}); curve {summary['curve']}")
