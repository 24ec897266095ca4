"""Downstream tasks against the original: lm-evaluation-harness run on both models, on the same examples, each
metric side by side with its recovery (converted / original, inverted for a metric where lower is better, so that 1
is no loss and below 1 is worse), as compression tools report it (recovery >= 0.95 passes).

The task scoring is lm-eval's own (``HFLM`` around the models already loaded, ``simple_evaluate``). Tasks are lm-eval
names (Hub datasets) and local task YAML files or folders (lm-eval's include path). The request is checked before
any model loads: lm-eval installed, every name known, every file parseable. A task file's ``!function`` runs its
folder's Python as lm-eval runs it, so a task file inside a model's checkpoint folder (which came with the
checkpoint) is refused unless the user trusts it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from .metrics import number
from .perplexity import REFERENCE, EvaluationError

EXTRA = "pip install 'hf-normswap[eval]'"
MIN_RECOVERY = 0.95
YAML_SUFFIXES = (".yaml", ".yml")


@dataclass
class TaskRequest:
    """The tasks to run: lm-eval names, and the folders holding the local ones (lm-eval's include path)."""

    names: list[str]
    include: list[str] = field(default_factory=list)
    builtin: bool = False  # whether a name needs lm-eval's own task index (slow to build)
    manager: object = field(default=None, repr=False)  # built once: the index of every task it can run

    def task_manager(self):
        from lm_eval.tasks import TaskManager  # lazy: lm-eval is optional (hf-normswap[eval]), slow to import

        if self.manager is None:
            self.manager = TaskManager(include_path=self.include or None, include_defaults=self.builtin)
        return self.manager


def _parse(path: Path) -> dict:
    """A task YAML as lm-eval reads it, without running its ``!function`` (so a bad file fails before any model)."""
    # lazy: lm-eval is optional (hf-normswap[eval]); its own reader: its ``include`` and tags
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        config = load_yaml(path, resolve_func=False)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or type(error).__name__
        raise EvaluationError(f"--tasks {path}: not a task file lm-eval can read ({problem}{where}); fix the "
                              "YAML") from None
    except (OSError, ValueError) as error:
        raise EvaluationError(f"--tasks {path}: not a task file lm-eval can read ({error})") from None
    return config


def _local_names(path: Path) -> list[str]:
    """The tasks a YAML file defines, or for a folder the groups its files define (else their tasks); files whose
    name starts with ``_`` are lm-eval's templates, included by others."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in YAML_SUFFIXES
                                                 and not p.name.startswith("_"))
    configs = [_parse(f) for f in files]
    groups = [c["group"] for c in configs if isinstance(c.get("group"), str)]
    tasks = [c["task"] for c in configs if isinstance(c.get("task"), str)]
    names = groups if groups and path.is_dir() else groups + tasks
    if not names:
        raise EvaluationError(f"--tasks {path}: defines no lm-eval task (no `task:` name); name a task YAML file "
                              "or a folder of them")
    return names


def _inside(path: Path, folders: list[Path]) -> Path | None:
    resolved = path.resolve()
    return next((f for f in folders if resolved == f or f in resolved.parents), None)


def check_tasks(spec: str, checkpoints: list[Path], trust_remote_code: bool = False) -> TaskRequest:
    """The request of ``--tasks SPEC`` (comma-separated names and paths), checked; ``checkpoints``: the local
    folders of the models, inside which a task file is refused unless ``trust_remote_code``."""
    if importlib.util.find_spec("lm_eval") is None:
        raise EvaluationError(f"--tasks runs lm-evaluation-harness, which is not installed: {EXTRA}")
    items = [item.strip() for item in spec.split(",") if item.strip()]
    if not items:
        raise EvaluationError("--tasks names no task: give lm-eval task names or task YAML files, comma-separated")
    folders = [Path(c).resolve() for c in checkpoints]
    request = TaskRequest([])
    for item in items:
        path = Path(item).expanduser()
        if not path.exists() and not item.endswith(YAML_SUFFIXES):
            request.names.append(item)
            request.builtin = True
            continue
        if not path.exists():
            raise EvaluationError(f"--tasks {item}: no such task file")
        folder = _inside(path, folders)
        if folder is not None and not trust_remote_code:
            raise EvaluationError(f"--tasks {item} lies inside the checkpoint folder {folder}: a task file can run "
                                  "Python (`!function`); pass --trust-remote-code if you trust it")
        request.names += _local_names(path)
        request.include.append(str((path if path.is_dir() else path.parent).resolve()))
    known = set(request.task_manager().all_tasks)
    unknown = [name for name in request.names if name not in known]
    if unknown:
        raise EvaluationError(f"--tasks: lm-eval knows no task {', '.join(unknown)} (`lm_eval ls tasks` lists "
                              "them; or give a task YAML file)")
    return request


@dataclass
class TaskMetric:
    """One metric of one task for both models; ``recovery`` is 1 for no loss, below 1 for worse."""

    task: str
    metric: str
    original: float
    converted: float
    original_stderr: float | None
    converted_stderr: float | None
    higher_is_better: bool

    @property
    def recovery(self) -> float | None:
        if self.converted == self.original:
            return 1.0
        better, worse = (self.converted, self.original) if self.higher_is_better else (self.original, self.converted)
        return better / worse if worse and math.isfinite(worse) else None


@dataclass
class TaskComparison:
    """Each task's metrics for the original and the converted model, on the same ``samples`` examples."""

    metrics: list[TaskMetric]
    samples: dict[str, int]
    limit: float | None
    num_fewshot: int | None
    min_recovery: float = MIN_RECOVERY
    seconds: dict = field(default_factory=dict)  # model -> {"wall": s, "cpu": s} of its lm-eval run

    def below(self, metric: TaskMetric) -> bool:
        return metric.recovery is not None and metric.recovery < self.min_recovery

    def table(self) -> str:
        lines = ["| task | metric | examples | original | converted | recovery |", "|---|---|---|---|---|---|"]
        for m in self.metrics:
            flag = f" **below {self.min_recovery:g}**" if self.below(m) else ""
            lines.append(f"| {m.task} | {m.metric} | {self.samples.get(m.task, '-')} | "
                         f"{_with_stderr(m.original, m.original_stderr)} | "
                         f"{_with_stderr(m.converted, m.converted_stderr)} | {number(m.recovery)}{flag} |")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        tasks = {}
        for m in self.metrics:
            entry = tasks.setdefault(m.task, {"examples": self.samples.get(m.task), "metrics": {}})
            entry["metrics"][m.metric] = dict(asdict(m), recovery=m.recovery, below=self.below(m))
            del entry["metrics"][m.metric]["task"], entry["metrics"][m.metric]["metric"]
        return {"limit": self.limit, "num_fewshot": self.num_fewshot, "min_recovery": self.min_recovery,
                "seconds": self.seconds, "tasks": tasks}


def _with_stderr(value: float, stderr: float | None) -> str:
    return number(value) + (f" ± {stderr:.2g}" if isinstance(stderr, float) and math.isfinite(stderr) else "")


def _metrics(output: dict) -> dict[tuple[str, str], tuple[float, float | None, bool]]:
    """``(task, metric)`` -> (value, stderr, higher is better) from ``simple_evaluate``'s output."""
    found = {}
    for task, values in output["results"].items():
        better = output.get("higher_is_better", {}).get(task, {})
        for key, value in values.items():
            metric, _, kind = key.partition(",")
            if not kind or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = values.get(f"{metric}_stderr,{kind}")
            name = metric if kind == "none" else f"{metric} ({kind})"
            found[task, name] = (float(value), stderr if isinstance(stderr, (int, float)) else None,
                                 better.get(metric, True))
    return found


def run_tasks(models: dict, tokenizer, request: TaskRequest, *, limit: float | None = None,
              num_fewshot: int | None = None, batch_size: int = 1,
              min_recovery: float = MIN_RECOVERY) -> TaskComparison:
    """lm-eval's ``simple_evaluate`` on the reference and on ``converted``, the same tasks and examples."""
    # lazy: lm-eval is optional (hf-normswap[eval]), slow to import
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    manager = request.task_manager()
    found, samples, seconds = {}, {}, {}
    for name in (REFERENCE, "converted"):
        wall, cpu = time.perf_counter(), time.process_time()
        lm = HFLM(pretrained=models[name], tokenizer=tokenizer, batch_size=batch_size)
        with contextlib.redirect_stdout(sys.stderr):  # lm-eval prints progress: stdout is the report's (--json)
            output = simple_evaluate(model=lm, tasks=request.names, limit=limit, num_fewshot=num_fewshot,
                                     task_manager=manager, log_samples=False)
        found[name] = _metrics(output)
        seconds[name] = {"wall": round(time.perf_counter() - wall, 1), "cpu": round(time.process_time() - cpu, 1)}
        samples = {task: n.get("effective") for task, n in output.get("n-samples", {}).items()}
    metrics = [TaskMetric(task, metric, *_pair(found, (task, metric))) for task, metric in found[REFERENCE]
               if (task, metric) in found["converted"]]
    return TaskComparison(metrics, samples, limit, num_fewshot, min_recovery, seconds)


def _pair(found: dict, key) -> tuple:
    (original, original_stderr, better), (converted, converted_stderr, _) = found[REFERENCE][key], found["converted"][key]
    return original, converted, original_stderr, converted_stderr, better
