"""Which norms matter: the damage each norm does when converted alone, the greedy curve, conversion under a budget.

Converting every norm of SmolLM2 costs about 17x in perplexity before training, but the loss is not spread evenly.
The map converts each selected norm alone, with ``convert`` and the calibration ``convert`` would run, and scores
the result against the original on a small slice of text: KL(original || converted) and the perplexity ratio for a
language model, the mean cosine of mean-pooled embeddings for an encoder. The original is scored once and cached.
The greedy curve then converts the cheapest norms first, as one set re-calibrated together, at doubling set sizes
(1, 2, 4, ..., all): the sets are nested prefixes of one order, doubling adds only log2(N) + 1 measurements to
the map's N, and the small sets, where budgets bite, are measured densely. :func:`largest_within` bisects between two curve
points to find the largest prefix within a budget.

Each measurement is a full ``convert`` of a copy of the model with the calibration config given; the command line
sets its end-to-end tuning steps (``tune_steps``) to 0 unless asked, since they cost more than everything else
together (30 forward-backward passes of the whole model per measurement on SmolLM2), and leaves the blocks' own
weights out of block tuning unless asked (``block_weights_lr``: the map is the damage of the norms, and a few hundred
tokens would overfit the weights); the strategy's per-norm fit and per-block tuning run as in ``convert``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..surgery import ConversionError, convert
from ..data import fingerprint, model_batches, token_blocks
from ..discovery.roles import LAYER, layer_of
from ..model_inputs import ModelFacts, first_tensor
from .conversion_check import not_comparable, perplexity
from .embeddings import mean_pooled

EVAL_WINDOWS, EVAL_LEN, SENTENCES = 2, 256, 64  # the default slice: 510 tokens scored, or 64 sentences for an encoder
CALIB_BLOCKS, CALIB_LEN = 2, 256  # calibration text per measurement
BUDGET_METRICS = ("kl", "ppl_ratio", "cosine")


@dataclass
class Score:
    """One converted model against the original on the slice: KL and perplexity ratio, or embedding cosine."""

    kl: float | None = None
    ppl_ratio: float | None = None
    cosine: float | None = None

    @property
    def damage(self) -> float:
        """What the greedy order sorts by: KL, or 1 - cosine for an encoder (non-finite counts as worst)."""
        value = self.kl if self.cosine is None else 1.0 - self.cosine
        return value if value is not None and math.isfinite(value) else math.inf

    def within(self, metric: str, limit: float) -> bool:
        value = getattr(self, metric)
        if value is None:
            raise ConversionError(f"a {metric} budget does not apply to this model (it measures "
                                  f"{'cosine' if self.cosine is not None else 'kl and ppl_ratio'})")
        return math.isfinite(value) and (value >= limit if metric == "cosine" else value <= limit)


class Reference:
    """The original model's outputs on the evaluation slice, computed once; :meth:`score` compares a model to them."""

    def __init__(self, original: nn.Module, facts: ModelFacts, tokenizer, texts: list[str], *,
                 windows: int = EVAL_WINDOWS, window_len: int = EVAL_LEN, sentences: int = SENTENCES):
        self.encoder = facts.hidden_states
        self.fingerprint = fingerprint(texts)
        device = facts.device  # the inputs and the cached outputs stay where the model and its copies are
        with torch.no_grad():
            if self.encoder:
                rows = _sentences(texts, sentences)
                encoded = tokenizer(rows, padding=True, truncation=True, max_length=window_len, return_tensors="pt")
                self.inputs = {key: value.to(device) for key, value in encoded.items()}
                self.target = mean_pooled(original, self.inputs)
                self.tokens = int(self.inputs["attention_mask"].sum())
            else:
                self.inputs = token_blocks(tokenizer, texts, windows, window_len).to(device)
                self.tokens = int(self.inputs[:, 1:].numel())
                self.target = [torch.log_softmax(_logits(original, row).float(), -1) for row in self.inputs]
                self.nll = self._nll(self.target)
        self._check_comparable()

    def _check_comparable(self) -> None:
        """Every score is relative to the original's outputs: where they are not finite (or its own perplexity
        overflows), a KL of 1e35 or a ratio of 0 would read as a measurement."""
        if self.encoder:
            if not torch.isfinite(self.target).all():
                raise ConversionError("the sensitivity map is not comparable: the original model's embeddings of the "
                                      "evaluation text are not finite. Fix: check the original's weights, or run "
                                      "it in float32 (--dtype float32)")
            return
        finite = all(bool(torch.isfinite(t).all()) for t in self.target) and math.isfinite(self.nll)
        own = perplexity(self.nll) if finite else math.inf
        if not math.isfinite(own):
            raise ConversionError(f"the sensitivity map is {not_comparable(own, f'{self.tokens} evaluation tokens')}")

    def describe(self) -> dict:
        shape = {"sentences": len(self.inputs["input_ids"])} if self.encoder else \
            {"windows": self.inputs.shape[0], "window_len": self.inputs.shape[1]}
        return dict(shape, tokens=self.tokens, fingerprint=self.fingerprint)

    def _nll(self, logps: list[torch.Tensor]) -> float:
        """Mean NLL of each window's next tokens (positions 1..L-1, predicted from 0..L-2)."""
        total = sum(-logp[:-1].gather(-1, row[1:, None]).sum() for logp, row in zip(logps, self.inputs))
        return float(total) / self.tokens

    @torch.no_grad()
    def score(self, model: nn.Module) -> Score:
        model.eval()
        if self.encoder:
            cosine = torch.nn.functional.cosine_similarity(self.target, mean_pooled(model, self.inputs), dim=-1)
            return Score(cosine=float(cosine.mean()))
        logps = [torch.log_softmax(_logits(model, row).float(), -1) for row in self.inputs]
        kl = sum(float((ref.exp() * (ref - logp)).sum(-1)[:-1].sum()) for ref, logp in zip(self.target, logps))
        return Score(kl=kl / self.tokens, ppl_ratio=math.exp(min(self._nll(logps) - self.nll, 700.0)))


def _logits(model: nn.Module, row: torch.Tensor) -> torch.Tensor:
    return first_tensor(model(input_ids=row[None], use_cache=False))[0]


def _sentences(texts: list[str], count: int) -> list[str]:
    rows = [line.strip() for text in texts for line in text.split("\n")
            if len(line.split()) >= 8 and not line.strip().startswith("=")]
    if not rows:
        raise ConversionError("the evaluation text has no sentence of 8 words or more")
    return rows[:count]


def exact(names: Iterable[str]) -> str:
    """A regular expression that matches exactly these module names (``convert``'s ``include``)."""
    return "^(" + "|".join(re.escape(n) for n in names) + ")$"


class Measurer:
    """``measurer(names)``: the :class:`Score` of a copy of ``original`` with exactly ``names`` converted and
    calibrated as ``convert`` calibrates them, against the original's cached outputs (``reference``)."""

    def __init__(self, original: nn.Module, reference: Reference, method: str, calibration=None, *,
                 roles: Iterable[str], per_channel: bool = False):
        self.original, self.reference, self.method = original, reference, method
        self.roles, self.per_channel = tuple(roles), per_channel
        self.summary = None if calibration is None else calibration.summary()
        if calibration is not None and not isinstance(calibration.data, (torch.Tensor, dict)):
            # tokenized once: each measurement would otherwise read and tokenize the whole calibration text again
            batches, _ = model_batches(original, calibration.data, calibration.tokenizer,
                                       num_blocks=calibration.num_blocks, block_len=calibration.block_len,
                                       batch_size=calibration.batch_size)
            data = {key: torch.cat([b[key] for b in batches]) for key in ("input_ids", "attention_mask")}
            calibration = dataclasses.replace(calibration, data=data)
        self.calibration = calibration

    def __call__(self, names: list[str]) -> Score:
        model = copy.deepcopy(self.original)
        convert(model, to=self.method, calibration=self.calibration, roles=self.roles, include=exact(names),
                per_channel=self.per_channel)
        return self.reference.score(model)


def doubling(count: int) -> list[int]:
    """Curve sizes 1, 2, 4, ... and ``count``."""
    sizes, size = [], 1
    while size < count:
        sizes.append(size)
        size *= 2
    return sizes + [count]


@dataclass
class CurvePoint:
    size: int
    score: Score
    last: str  # the norm this prefix ends with

    def to_dict(self) -> dict:
        return {"size": self.size, "last": self.last, **asdict(self.score)}


@dataclass
class SensitivityMap:
    method: str
    norms: list[dict]  # name, role, layer, kl / ppl_ratio or cosine, rank (0: least damage)
    curve: list[CurvePoint] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    calibration: dict | None = None
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    @property
    def order(self) -> list[str]:
        return [n["name"] for n in sorted(self.norms, key=lambda n: n["rank"])]

    @property
    def encoder(self) -> bool:
        return bool(self.norms) and self.norms[0].get("cosine") is not None

    def to_dict(self) -> dict:
        return {"method": self.method, "metric": "cosine" if self.encoder else "kl", "norms": self.norms,
                "order": self.order, "curve": [p.to_dict() for p in sorted(self.curve, key=lambda p: p.size)],
                "curve_sizes": "doubling: 1, 2, 4, ..., all (plus bisection points of a budget search)",
                "data": self.data, "calibration": self.calibration,
                "seconds": round(self.seconds, 1), "cpu_seconds": round(self.cpu_seconds, 1)}

    def table(self) -> str:
        cols = ("cosine",) if self.encoder else ("kl", "ppl_ratio")
        lines = [f"{'rank':>4}  {'norm':<50} {'role':<15} " + " ".join(f"{c:>10}" for c in cols)]
        for n in sorted(self.norms, key=lambda n: n["rank"]):
            lines.append(f"{n['rank']:>4}  {n['name']:<50} {n['role']:<15} " +
                         " ".join(f"{n[c]:>10.4g}" for c in cols))
        lines.append(f"\ngreedy curve (norms converted together, least damage first)\n{'size':>4}  " +
                     " ".join(f"{c:>10}" for c in cols) + "  last added")
        for p in sorted(self.curve, key=lambda p: p.size):
            lines.append(f"{p.size:>4}  " + " ".join(f"{getattr(p.score, c):>10.4g}" for c in cols) + f"  {p.last}")
        lines.append(f"\n{len(self.norms)} norms, {len(self.curve)} curve points, {self.data.get('tokens')} tokens "
                     f"scored: {self.seconds:.0f} s wall, {self.cpu_seconds:.0f} s CPU")
        return "\n".join(lines)


def measure_map(measurer: Measurer, selected: list, *, progress: bool = True,
                log: Callable[[dict], None] | None = None) -> SensitivityMap:
    """Each of the ``selected`` norms (``NormInfo``) converted alone, then the greedy curve at :func:`doubling`
    sizes; ``log`` gets every measurement as it is made (a cut-off run keeps its numbers)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    log = log or (lambda entry: None)
    norms, damage = [], {}
    for info in tqdm(selected, desc="sensitivity: alone", disable=not progress):
        score = measurer([info.name])
        damage[info.name] = score.damage
        norms.append({"name": info.name, "role": info.role, "layer": layer_of(info.name), **_values(score)})
        log(dict(norms[-1], cpu_seconds=round(time.process_time() - cpu_start, 1)))
    ranks = {name: rank for rank, name in enumerate(sorted(damage, key=damage.get))}
    for entry in norms:
        entry["rank"] = ranks[entry["name"]]
    result = SensitivityMap(measurer.method, norms, data=measurer.reference.describe())
    order = result.order
    for size in tqdm(doubling(len(order)), desc="sensitivity: curve", disable=not progress):
        result.curve.append(CurvePoint(size, measurer(order[:size]), order[size - 1]))
        log(dict(result.curve[-1].to_dict(), cpu_seconds=round(time.process_time() - cpu_start, 1)))
    if measurer.summary is not None:
        result.calibration = {k: measurer.summary.get(k) for k in ("data", "strategy", "num_blocks", "block_len",
                                                                    "tune_steps")}
    result.seconds, result.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return result


def _values(score: Score) -> dict:
    return {"cosine": score.cosine} if score.cosine is not None else {"kl": score.kl, "ppl_ratio": score.ppl_ratio}


def largest_within(order: list[str], curve: list[CurvePoint], measure: Callable[[list[str]], Score],
                   metric: str, limit: float) -> tuple[int, list[CurvePoint]]:
    """The largest prefix of ``order`` within ``metric`` <= ``limit`` (>= for cosine), and the points measured.

    Takes the largest curve size within the budget, then bisects between it and the next curve size (over the
    budget) with ``measure(names)``; new points are appended to ``curve``. A curve that is not monotone is taken
    as measured: the answer is the largest measured prefix within the budget whose successor is not.
    """
    if metric not in BUDGET_METRICS:
        raise ConversionError(f"unknown budget metric {metric!r}: choose from {', '.join(BUDGET_METRICS)}")
    points = {p.size: p for p in curve}
    within = [s for s, p in points.items() if p.score.within(metric, limit)]
    low = max(within, default=0)
    above = [s for s in points if s > low]
    high = min(above, default=low)
    while high - low > 1:
        middle = (low + high) // 2
        point = CurvePoint(middle, measure(order[:middle]), order[middle - 1])
        curve.append(point)
        points[middle] = point
        low, high = (middle, high) if point.score.within(metric, limit) else (low, middle)
    return low, curve


@dataclass
class Budget:
    """Which norms a budgeted conversion kept, and why: recorded in the report and in ``config.normswap``."""

    metric: str
    limit: float
    converted: list[str]
    kept: list[dict]  # name, role, rank, alone (score), reason
    measured: dict  # the chosen prefix's score on the slice, and the next prefix's

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        lines = [f"budget {self.metric} {'>=' if self.metric == 'cosine' else '<='} {self.limit:g}: "
                 f"{len(self.converted)} norms converted, {len(self.kept)} kept as they are"]
        lines += [f"  kept {k['name']} ({k['role']}): {k['reason']}" for k in self.kept]
        return "\n".join(lines)


def select_within_budget(sensitivity: SensitivityMap, measurer: Measurer, metric: str, limit: float) -> Budget:
    """Bisect the map's curve for the largest greedy prefix within the budget; every other norm stays."""
    order = sensitivity.order
    size, curve = largest_within(order, sensitivity.curve, measurer, metric, limit)
    points = {p.size: p.score for p in curve}
    chosen, following = points.get(size), points.get(size + 1)
    op = ">=" if metric == "cosine" else "<="
    why = (f"the largest greedy prefix within {metric} {op} {limit:g} has {size} norms "
           f"({metric} {getattr(chosen, metric):.4g} on the slice)" if chosen else
           f"no greedy prefix is within {metric} {op} {limit:g}")
    if following is not None:
        why += f"; {size + 1} norms measure {getattr(following, metric):.4g}"
    by_name = {n["name"]: n for n in sensitivity.norms}
    kept = []
    for name in order[size:]:
        entry = by_name[name]
        alone = {k: entry[k] for k in ("kl", "ppl_ratio", "cosine") if k in entry}
        kept.append({"name": name, "role": entry["role"], "rank": entry["rank"], "alone": alone,
                     "reason": f"rank {entry['rank'] + 1} of {len(order)} by damage alone "
                               f"({', '.join(f'{k} {v:.4g}' for k, v in alone.items())}); {why}"})
    measured = {"size": size, "score": asdict(chosen) if chosen else None,
                "next": asdict(following) if following else None, "data": sensitivity.data}
    return Budget(metric, limit, order[:size], kept, measured)


def load_order(path: str | Path) -> list[str]:
    """The greedy order (least damage first) of a sensitivity JSON file written by ``normswap sensitivity --json``."""
    try:
        data = json.loads(Path(path).read_text())
        order = data["order"] if "order" in data else [n["name"] for n in sorted(data["norms"], key=lambda n: n["rank"])]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a sensitivity map (`normswap sensitivity --json`): {error}") from None
    if not all(isinstance(n, str) for n in order):
        raise ValueError(f"{path}: the order must be a list of module names")
    return order


def plot(sensitivity: SensitivityMap, path: str | Path) -> Path:
    """Per-norm damage alone, as bars grouped by layer (x) and role (colour), and the greedy curve."""
    # lazy: matplotlib is slow to import and `import hf_normswap` must not load it; Agg is chosen before pyplot
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = "1 - cosine" if sensitivity.encoder else "KL(original || converted), nats/token"
    value = (lambda n: 1.0 - n["cosine"]) if sensitivity.encoder else (lambda n: n["kl"])  # noqa: E731
    def group(name: str, role: str) -> str:  # role and the name within its block: MiniLM has two post_norms a layer
        match = LAYER.search(name)
        return f"{role} ({name[match.end():] if match else name})"

    groups = list(dict.fromkeys(group(n["name"], n["role"]) for n in sensitivity.norms))
    layers = sorted({n["layer"] for n in sensitivity.norms if n["layer"] is not None})
    position = {layer: i for i, layer in enumerate(layers)}
    width = 0.8 / max(1, len(groups))
    fig, (bars, curve) = plt.subplots(2, 1, figsize=(max(8, 0.3 * len(layers) + 3), 8))
    for r, label in enumerate(groups):
        rows = [n for n in sensitivity.norms if group(n["name"], n["role"]) == label]
        xs = [position.get(n["layer"], len(layers)) + (r - (len(groups) - 1) / 2) * width for n in rows]
        bars.bar(xs, [max(value(n), 1e-9) for n in rows], width=width, label=label)
    ticks = [str(layer) for layer in layers] + (["outside"] if any(n["layer"] is None for n in sensitivity.norms)
                                                else [])
    bars.set_xticks(range(len(ticks)), ticks, fontsize=7)
    bars.set(yscale="log", xlabel="layer", ylabel=metric, title=f"{sensitivity.method.upper()}: each norm converted alone")
    bars.legend(fontsize=8)
    points = sorted(sensitivity.curve, key=lambda p: p.size)
    curve.plot([p.size for p in points], [max(p.score.damage, 1e-9) for p in points], "o-")
    curve.set(yscale="log", xlabel="norms converted (least damage first)", ylabel=metric,
              title="greedy cumulative curve (each set calibrated together)")
    curve.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
