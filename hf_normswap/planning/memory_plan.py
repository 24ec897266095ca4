"""The memory plan: host and device bytes of every phase of a conversion and a recovery, whether they fit, and the
smallest change of settings that makes them fit.

    from hf_normswap.planning import plan
    p = plan("meta-llama/Meta-Llama-3-8B", processes=8, sharding="fsdp2", device_memory="80GB")
    print(p.table()); p.fits; p.smallest_change()
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .phases import Phase
from .recipe_memory import conversion_phases, recipe_phases
from .plan_settings import PlanSettings
from .sizes import ModelSizes, model_sizes

GB = 10**9


def gb(value: int) -> str:
    return f"{value / GB:,.1f} GB"


def exceeds(need: int, have: int) -> str:
    """``need > have`` in GB, with the decimals it takes for the two to read apart (0.73 GB > 0.7 GB, not 0.7 GB >
    0.7 GB)."""
    digits = next((d for d in range(1, 10) if f"{need / GB:.{d}f}" != f"{have / GB:.{d}f}"), 9)
    return f"{need / GB:,.{digits}f} GB > {have / GB:,.{digits}f} GB"


@dataclass
class MemoryPlan:
    sizes: ModelSizes
    settings: PlanSettings
    conversion: list[Phase]  # normswap convert: one process
    recipe: list[Phase]  # recipes/finetune.py on ``settings.processes`` processes

    @property
    def phases(self) -> list[Phase]:
        return self.recipe

    def peak(self, phases: list[Phase] | None = None, processes: int | None = None) -> dict[str, int]:
        """The largest of the phases: host of the main process, of another one, of the node; device."""
        phases = self.recipe if phases is None else phases
        n = self.settings.per_node if processes is None else processes
        return {"host_main": max(p.host_main for p in phases), "host_other": max(p.host_other for p in phases),
                "host_node": max(p.host_node(n) for p in phases), "device": max(p.device_bytes for p in phases)}

    def conversion_peak(self) -> dict[str, int]:
        return self.peak(self.conversion, processes=1)

    def problems(self) -> list[str]:
        """Every phase that does not fit the memory given, one line each (empty: it fits)."""
        s, found = self.settings, []
        for run, phases, n in (("convert", self.conversion, 1), ("recipe", self.recipe, s.per_node)):
            for phase in phases:
                if s.host_memory is not None and phase.host_node(n) > s.host_memory:
                    found.append(f"{run}, {phase.name}: host {exceeds(phase.host_node(n), s.host_memory)}")
                if s.device_memory is not None and phase.device_bytes > s.device_memory:
                    found.append(f"{run}, {phase.name}: device {exceeds(phase.device_bytes, s.device_memory)}")
        return found

    @property
    def fits(self) -> bool:
        return not self.problems()

    def smallest_change(self, most: int = 3) -> dict | None:
        """The fewest changes of :data:`CHANGES` (in their order: the ones that alter the result least first) with
        which every phase fits; {} when it fits as it is, None when no combination of up to ``most`` does."""
        if self.fits:
            return {}
        options = [(name, change(self.settings)) for name, change in CHANGES]
        options = [(name, values) for name, values in options if values]
        for count in range(1, most + 1):
            for chosen in itertools.combinations(options, count):
                values = {k: v for _, change in chosen for k, v in change.items()}
                if len(values) < sum(len(change) for _, change in chosen):
                    continue  # two changes of one setting
                if replan(self, **values).fits:
                    return values
        return None

    def table(self) -> str:
        """Phases by rows: host memory of the main process, of each other, of the node, and of each device."""
        n = self.settings.per_node
        rows = [("phase", "host, main", "host, other" if n > 1 else "", "host, node" if n > 1 else "", "device")]
        for run, phases, count in (("convert", self.conversion, 1), ("recipe", self.recipe, n)):
            for p in phases:
                rows.append((f"{run}: {p.name}", gb(p.host_main), gb(p.host_other) if count > 1 else "",
                             gb(p.host_node(count)) if count > 1 else "", gb(p.device_bytes) if p.device else "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                         .rstrip() for r in rows)

    def describe(self) -> str:
        """The plan as ``normswap plan`` prints it: the model, the settings, the phases, the verdict."""
        s, z = self.settings, self.sizes
        nodes = f" ({s.per_node} a node)" if s.per_node < s.processes else ""
        where = (f"{s.processes} x {gb(s.device_memory)} devices{nodes}" if s.device_memory else
                 f"{s.processes} CPU process{'es' if s.processes > 1 else ''}")
        lines = [f"{z.name}: {z.parameters:,} parameters ({gb(z.parameter_bytes(4))} fp32), {z.units} blocks of "
                 f"{z.largest_unit:,}",
                 f"{where}, {s.sharding if s.processes > 1 else 'one process'}, trainable {s.trainable}, {s.precision}"
                 f", teacher {'sharded' if s.sharded and s.shard_teacher else 'whole'}, gradient checkpointing "
                 f"{'on' if s.gradient_checkpointing else 'off'}, {s.batch_size} x {s.seq_len} tokens a process"
                 + (", optimizer offload" if s.optimizer_offload else "")
                 + (", convert with the weights on disk" if s.weights_on_disk else "")
                 + (", weights read by every process" if s.sharded and not s.load_once else ""),
                 "", self.table(), ""]
        problems = self.problems()
        if s.host_memory is None and s.device_memory is None:
            lines.append("no memory given to check against (--host-memory, --device-memory)")
        elif not problems:
            lines.append("fits")
        else:
            lines += ["does not fit:", *[f"  {p}" for p in problems]]
            change = self.smallest_change()
            lines.append("smallest change that fits: " + (", ".join(f"{k}={v}" for k, v in change.items())
                                                           if change else "none of up to 3 changes; more memory"))
        return "\n".join(lines)


def _halve(name: str, least: int = 1):
    def change(s: PlanSettings) -> dict:
        return {name: getattr(s, name) // 2} if getattr(s, name) // 2 >= least else {}
    return change


# Changes the smallest-change search tries, those that alter the result least first: memory for time, then the
# recipe's shape, then what is trained.
CHANGES = [
    ("gradient checkpointing", lambda s: {} if s.gradient_checkpointing else {"gradient_checkpointing": True}),
    ("shard the teacher", lambda s: {"shard_teacher": True} if s.sharded and not s.shard_teacher else {}),
    ("FSDP2", lambda s: {"sharding": "fsdp2", "shard_teacher": True} if s.processes > 1 and not s.sharded
     else {}),
    ("hidden states between blocks on disk", lambda s: {} if s.cache_on_disk else {"cache_on_disk": True}),
    ("convert with the weights on disk (--max-host-memory)",
     lambda s: {} if s.weights_on_disk or s.device_memory else {"weights_on_disk": True}),
    ("half the batch", _halve("batch_size")),
    ("half the end-to-end rows", _halve("tune_rows", least=0)),
    ("optimizer offload", lambda s: {"optimizer_offload": True} if s.sharded and s.device_memory
     and not s.optimizer_offload else {}),
    ("bf16 autocast", lambda s: {"precision": "bf16"} if s.precision == "fp32" else {}),
    ("LoRA", lambda s: {"trainable": "lora"} if s.trainable == "all" else {}),
    ("norms alone", lambda s: {"trainable": "norms"} if s.trainable != "norms" else {}),
    ("twice the processes (nodes)", lambda s: {"processes": 2 * s.processes, "node_processes": s.per_node,
                                               "sharding": "fsdp2"} if s.device_memory and s.processes > 1 else {}),
]


def replan(plan_: MemoryPlan, **changes) -> MemoryPlan:
    settings = plan_.settings.replace(**changes)
    return MemoryPlan(plan_.sizes, settings, conversion_phases(plan_.sizes, settings),
                      recipe_phases(plan_.sizes, settings))


def plan(model, settings: PlanSettings | None = None, **values) -> MemoryPlan:
    """The memory plan of ``model`` (a Hub id, a directory, a config.json, ``offline:NAME``, a ``PreTrainedConfig``
    or an ``nn.Module``) under ``settings`` (:class:`PlanSettings`, or its fields as keywords). Raises
    :class:`PlanError` on a setting or a model it cannot use."""
    settings = (settings or PlanSettings()).replace(**values) if values else (settings or PlanSettings())
    sizes = model if isinstance(model, ModelSizes) else model_sizes(model)
    return MemoryPlan(sizes, settings, conversion_phases(sizes, settings), recipe_phases(sizes, settings))
