"""What calibration reports: the per-norm fit table that ``normswap convert`` prints, and a plot of each fit.

Both read what calibration returned (the conversion report's rows and summary); neither changes the model.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from .fitting import FitStats


FIT_TABLE_LEGEND = """\
  param mean/min/max: the shape parameter (ELN beta, DyT alpha) when the norm was fitted, over its channels;
    later block or model tuning moves it (the final value is on the norm's line above)
  gamma: mean of weight / amplitude, the norm's scale as fitted
  resid: the fit's weighted mean squared error, module output against the original norm's, on the sampled tokens
  rel.err: ||output - original|| / ||original|| on ordinary tokens; rel.err@0: the same on first-position tokens
    (the attention sink), '-' without any
  sat.: share of output elements beyond 95% of the amplitude (the flat part of tanh / ISRU)"""


def _calibration_line(summary: dict) -> str:
    """Strategy, time, and the tokens used against those asked for (short texts give fewer)."""
    asked = summary.get("num_blocks"), summary.get("block_len")
    used = f"{summary['tokens']} tokens" + (f" in {summary['sequences']} sequences" if "sequences" in summary else "")
    if all(asked) and not str(summary.get("data")).startswith("tensor"):  # token ids given: nothing was asked
        used += f" (asked: {asked[0]} sequences of up to {asked[1]} tokens)"
    parts = [f"{k}={summary[k]}" for k in ("strategy", "mode") if k in summary]
    if "seconds" in summary:
        parts.append(f"{summary['seconds']} s")
    return "calibration: " + ", ".join(parts + [used])


def fit_table(report) -> str:
    """The per-norm fit statistics of a calibrated conversion report, as a text table with its legend."""
    header = (f"  {'norm':<45} {'param':>6} {'mean':>10} {'min':>10} {'max':>10} {'gamma':>7} {'resid':>9} "
              f"{'rel.err':>8} {'rel.err@0':>9} {'sat.':>6}")
    lines = [_calibration_line(report.calibration), header]
    for c in report.converted:
        if not c.fit:
            continue
        f, st = c.fit, c.fit["stats"]
        first = st["rel_error_first"]
        lines.append(f"  {c.name:<45} {f['shape_name']:>6} {f['shape_mean']:>10.4g} {f['shape_min']:>10.4g} "
                     f"{f['shape_max']:>10.4g} {f['gamma_mean']:>7.3g} {st['loss']:>9.3g} {st['rel_error']:>8.3g} "
                     f"{'-' if first is None else format(first, '.3g'):>9} {st['saturation']:>6.1%}")
    tuning = report.calibration.get("tuning")
    if tuning:
        lines.append(f"  tuning ({tuning['objective']}, {tuning['steps']} steps on {tuning['rows']} rows): "
                     f"{tuning['loss_before']:.4g} -> {tuning['loss_after']:.4g}")
    lines.append(FIT_TABLE_LEGEND)
    return "\n".join(lines)


PLOT_POINTS = 20000  # points drawn of each kind of token: a sample of them keeps the scatter plot light


def plot_fit(directory: Path, name: str, module, reference, x, target, is_first, stats: FitStats) -> Path:
    """The source norm's outputs over its inputs (grey: ordinary tokens, red: first positions) with the fitted
    module's outputs on the same inputs, all divided by the source's per-channel scale (paper's Figure 3); at most
    :data:`PLOT_POINTS` of each kind."""
    # lazy: matplotlib is slow to import and `import hf_normswap` must not load it; Agg is chosen before pyplot
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    scale = getattr(reference, "weight", None)
    scale = scale.detach().float() if isinstance(scale, torch.Tensor) else torch.ones(x.shape[-1])
    scale = torch.where(scale.abs() < 1e-6, torch.ones_like(scale), scale)
    with torch.no_grad():
        fitted = copy.deepcopy(module).to("cpu", torch.float32)(x.float()).float() if x.shape[0] else x
    generator = torch.Generator().manual_seed(0)
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for rows, color, label in ((~is_first, "0.6", "source, tokens"), (is_first, "tab:red", "source, first position")):
        xs, ys, fs = x[rows], (target[rows] - _bias(reference)) / scale, (fitted[rows] - _bias(reference)) / scale
        flat = xs.numel()
        if flat == 0:
            continue
        pick = torch.randperm(flat, generator=generator)[:PLOT_POINTS]
        ax.scatter(xs.flatten()[pick], ys.flatten()[pick], s=2, c=color, alpha=0.4, label=label)
        ax.scatter(xs.flatten()[pick], fs.flatten()[pick], s=1, c="tab:blue", alpha=0.3,
                   label="fitted" if color == "0.6" else None)
    ax.set(title=f"{name}\nrel. error {stats.rel_error:.3g}, saturated {stats.saturation:.1%}",
           xlabel="input x", ylabel="output / source gamma")
    ax.legend(fontsize=7, markerscale=4)
    path = directory / f"{name.replace('.', '_')}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _bias(reference) -> torch.Tensor | float:
    bias = getattr(reference, "bias", None)
    return bias.detach().float() if isinstance(bias, torch.Tensor) else 0.0
