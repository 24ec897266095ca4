"""What one phase of a run holds, term by term, on the host (the main process and each other one) and on each
accelerator; and the sizes of the tensors those terms are made of.

The terms follow the code: ``training/sharding.py`` (what FSDP2 shards and gathers), ``training/losses.py`` and
``training/head_loss.py`` (the teacher's hidden states, the head's logits ``head_chunk`` tokens at a time),
``calibration/block_pass.py`` and ``activation_cache.py`` (one block on the compute device, the hidden states
between blocks), ``calibration/end_to_end.py`` (the original's logits on the tuning rows, kept for every step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .plan_settings import PlanSettings
from .sizes import ModelSizes

# Resident memory of a process that has imported torch, transformers, accelerate, datasets and the package, before
# any model: measured (scripts/benchmarks/bench_memory.py, the "runtime" row of BENCHMARKS.md), not derived.
RUNTIME_BYTES = 540 * 2**20
# What inductor adds to a process once the fused element-wise kernels (``kernels.py``) compile, on the first
# converted model's forward: measured as RUNTIME_BYTES is.
COMPILER_BYTES = 120 * 2**20
# An accelerator's own context (CUDA kernels, cuBLAS workspace), on the device: what torch reports reserved beyond
# the tensors on an idle GPU is about this; unmeasured here, so rounded up.
DEVICE_CONTEXT_BYTES = 2**30
HEAD_LOGIT_COPIES = 4  # the head loss's chunk: student and teacher logits, their log-softmaxes
EVAL_LOGIT_COPIES = 4  # a perplexity window: both models' logits and log-softmaxes


@dataclass
class Phase:
    """Bytes held at the peak of one phase: ``main`` / ``other`` on the host per process (the main process
    calibrates and saves; ``other`` is each of the N - 1 others), ``device`` per accelerator (empty on a CPU run)."""

    name: str
    main: dict[str, int] = field(default_factory=dict)
    other: dict[str, int] = field(default_factory=dict)
    device: dict[str, int] = field(default_factory=dict)

    @property
    def host_main(self) -> int:
        return sum(self.main.values())

    @property
    def host_other(self) -> int:
        return sum(self.other.values())

    @property
    def device_bytes(self) -> int:
        return sum(self.device.values())

    def host_node(self, processes: int) -> int:
        """The node's host memory: the main process and the N - 1 others, at once."""
        return self.host_main + (processes - 1) * self.host_other


def value_bytes(settings: PlanSettings) -> int:
    """Bytes of an activation: bf16 autocast halves the matmuls' outputs (norms and losses stay fp32)."""
    return 2 if settings.precision == "bf16" else 4


def layer_activations(sizes: ModelSizes, tokens: int, bytes_per_value: int) -> int:
    """What autograd keeps of one decoder block for ``tokens`` tokens: both norms' inputs and outputs, q / k / v
    and the attention output, the MLP's gate, up, activation and product (``12 d + 4 f`` values a token; the
    fused CPU / GPU attention keeps no score matrix)."""
    return tokens * (12 * sizes.hidden + 4 * sizes.intermediate) * bytes_per_value


def trainable_parameters(sizes: ModelSizes, settings: PlanSettings) -> int:
    """Elements that get gradients and AdamW moments: every parameter, the norms' (an element-wise module has as
    many as the norm it replaces, give or take a few scalars), or LoRA's adapters plus the norms."""
    if settings.trainable == "all":
        return sizes.parameters
    if settings.trainable == "norms":
        return sizes.norm_parameters
    return settings.lora_rank * sizes.lora_pairs + sizes.norm_parameters


def training_activations(sizes: ModelSizes, settings: PlanSettings) -> dict[str, int]:
    """One training step's activations on one process: the student's blocks (all of them, or with gradient
    checkpointing their inputs plus one block recomputed), the backward's gradient of one block, the teacher's
    hidden states (layer-wise term) and the head loss's chunk of logits."""
    tokens = settings.batch_size * settings.seq_len
    b = value_bytes(settings)
    block = layer_activations(sizes, tokens, b)
    if settings.gradient_checkpointing:
        student = sizes.layers * tokens * sizes.hidden * b + block
    else:
        student = sizes.layers * block
    teacher = (sizes.layers + 1) * tokens * sizes.hidden * b if settings.hidden_distill else block
    head = HEAD_LOGIT_COPIES * min(settings.head_chunk or tokens, tokens) * sizes.vocab * 4
    return {"activations": student + block, "teacher outputs": teacher, "head loss": head}


def others_models(weights: int, settings: PlanSettings) -> dict[str, int]:
    """The whole models each process but the main one holds before sharding: both (each process loads them), none
    under FSDP2 loading once a node (``load_once``: they receive their shards), or the original alone when the
    teacher is not sharded (every process holds it whole, so it reads it)."""
    if not (settings.sharded and settings.load_once and settings.processes > 1):
        return {"original": weights, "student": weights}
    return {} if settings.shard_teacher else {"original": weights}


def evaluation_activations(sizes: ModelSizes, settings: PlanSettings) -> int:
    """A perplexity window through both models, without gradients: one block's values and the logits."""
    return (layer_activations(sizes, settings.eval_len, 4)
            + EVAL_LOGIT_COPIES * settings.eval_len * sizes.vocab * 4)


def calibration_terms(sizes: ModelSizes, settings: PlanSettings, block_brought: bool) -> dict[str, dict[str, int]]:
    """Beside the model itself, what each stage of calibration holds: ``block pass`` and ``end-to-end steps``,
    each as ``{"host": ..., "compute": ...}`` (compute: where the block or the model is computed).

    The block pass holds one block on the compute device (a copy of its weights when they are ``block_brought``
    there: from host memory to an accelerator, or from disk) with, when its weights are tuned, their copy at the
    start, gradient and AdamW moments; the hidden states between blocks (peak ``2 (N + R) L d`` fp32 values,
    ``block_pass.py``) stay in host memory or in files. The original's logits on the tuning rows are kept from the
    start to the end-to-end steps, each of which backpropagates one row through the whole model."""
    n, length, d = settings.calibration_blocks, settings.calibration_len, sizes.hidden
    tuned = min(n, max(settings.block_rows, 16)) if settings.block_rows else 0
    tuned = min(n, -(-tuned // settings.calibration_batch) * settings.calibration_batch)  # whole batches
    cache = 0 if settings.cache_on_disk else 2 * (n + tuned) * length * d * 4
    rows = min(settings.tune_rows, n)
    logits = {"original's logits (tuning rows)": rows * length * sizes.vocab * 4} if rows else {}
    unit = sizes.largest_unit * 4
    tuned_copies = 4 * unit if settings.block_weights else 0
    block = (unit if block_brought else 0) + tuned_copies + layer_activations(sizes, length, 4)
    stages = {"block pass": {"host": {"hidden states between blocks": cache, **logits},
                             "compute": {"block being fitted": block}}}
    if rows:
        step = sizes.layers * layer_activations(sizes, length, 4) + 5 * length * sizes.vocab * 4
        stages["end-to-end steps"] = {"host": dict(logits), "compute": {"one row's forward and backward": step}}
    return stages
