"""End-to-end tuning: a few Adam steps on the new modules' parameters only, so the converted model's output matches
the original's (KL of next-token distributions for language models, MSE of the last hidden state otherwise) on a
few calibration sequences. The teacher outputs are computed before any norm is replaced."""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn
from tqdm.auto import tqdm

from ..model_inputs import first_tensor, forward_without_cache, text_config
from ..modules import adam_groups


@contextmanager
def training_only(model: nn.Module, params: list[nn.Parameter]):
    """Gradients for ``params`` alone (here and in ``block_pass.tune_block``), restoring every parameter's
    requires_grad afterwards and dropping the gradients the last step left: kept, they would hold a second copy of
    every tuned weight until the conversion ends (one block's weights a block, in the block pass)."""
    chosen = {id(p) for p in params}
    saved = {n: p.requires_grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in chosen)
    try:
        with torch.enable_grad():
            yield
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(saved[n])
        for p in params:
            p.grad = None


def tuning_rows(batches, count: int) -> list[dict]:
    """The first ``count`` calibration sequences, one row each."""
    rows = []
    for batch in batches:
        for r in range(batch["input_ids"].shape[0]):
            rows.append({k: v[r:r + 1] for k, v in batch.items()})
            if len(rows) >= count:
                return rows
    return rows


def teacher_outputs(model, rows) -> list[torch.Tensor]:
    """The original model's outputs on the tuning rows, computed before any norm is replaced."""
    with torch.no_grad():
        return [first_tensor(forward_without_cache(model, row)).detach().float() for row in rows]


def tune(model, modules, rows, teacher, config) -> dict:
    """``config.tune_steps`` Adam steps at ``config.tune_lr`` on ``modules``' own parameters, cycling over ``rows``;
    keeps the parameters of the best full pass (never worse than the start)."""
    params = [p for m in modules for p in m.parameters(recurse=False)]
    best = [p.detach().clone() for p in params]
    optimizer = torch.optim.Adam(adam_groups(modules, config.tune_lr))
    is_lm = teacher[0].shape[-1] == getattr(text_config(model), "vocab_size", -1)

    def loss_on(k):
        mask = rows[k]["attention_mask"].bool()
        out = first_tensor(forward_without_cache(model, rows[k])).float()
        if is_lm:
            t = torch.log_softmax(teacher[k][mask], -1)
            s = torch.log_softmax(out[mask], -1)
            return torch.nn.functional.kl_div(s, t, log_target=True, reduction="batchmean")
        t = teacher[k][mask]
        return (out[mask] - t).pow(2).mean() / t.pow(2).mean().clamp_min(1e-12)

    def mean_loss():
        with torch.no_grad():
            return sum(float(loss_on(k)) for k in range(len(rows))) / len(rows)

    history = []
    with training_only(model, params):
        start_loss = best_loss = mean_loss()
        with tqdm(total=config.tune_steps, desc="calibration: tune", disable=not config.progress,
                  leave=False) as bar:
            for step in range(config.tune_steps):
                k = step % len(rows)
                optimizer.zero_grad()
                loss = loss_on(k)
                if not torch.isfinite(loss):
                    break
                loss.backward()
                optimizer.step()
                history.append(float(loss.detach()))
                bar.update()
                bar.set_postfix(loss=f"{history[-1]:.4g}")
                if len(rows) == 1 or (step + 1) % len(rows) == 0:  # a full pass over the tuning rows
                    epoch = sum(history[-len(rows):]) / len(rows)
                    if epoch < best_loss:
                        best_loss, best = epoch, [p.detach().clone() for p in params]
        final = mean_loss()
        if not math.isfinite(final) or final > best_loss:
            with torch.no_grad():
                for p, b in zip(params, best):
                    p.copy_(b)
            final = mean_loss()
    return {"objective": "kl" if is_lm else "relative_mse", "rows": len(rows), "steps": len(history),
            "loss_before": round(start_loss, 6), "loss_after": round(final, 6)}
