"""Speed of the element-wise norms against the norms they replace, as side-by-side ratios taken in one run.

Every comparison interleaves its candidates (A B C A B C ...) and reports medians, so that a noisy shared machine
slows all candidates alike and the ratios stay meaningful. Sections:

* module: tokens x C in fp32 / bf16, forward (no grad) and forward+backward: each element-wise method (default fused
  path and the eager fallback) against a memory copy (``x.clone()``, the physical floor of a forward that reads x
  and writes y), ``nn.LayerNorm`` and transformers' ``LlamaRMSNorm``;
* model: SmolLM2-135M (packaged GGUF; ``smollm2-random``: its shapes with random weights, where the package is not
  installed) and a small GPT-2, batch x 512 tokens: forward tokens/s and training step (forward + loss + backward,
  no optimizer) time, original versus converted (a calibrated start, so that finite activations are timed), eager
  and ``torch.compile``;
* calibration: ``convert(..., calibration=...)`` time and peak RSS against plain forward passes over the same data,
  each measured in a fresh process;
* head: the distillation loss alone (CE + KL over the vocabulary, forward + backward) for tokens x C hidden states
  through a V x C head: from full logits against chunked (``hf_normswap.training.head_loss``); time interleaved in one
  process, peak RSS above the inputs in a fresh process each;
* sampling: the original's own samples (batched ``generate``, ``hf_normswap.data.generated``) against the recipe's
  training step, tokens/s of each interleaved: the cost of a sampled token in training time;
* train: one optimizer step of the converted model (all weights train), batch x seq tokens, as the recipe takes it
  (``NormSwapTrainer``: distillation from the original, chunked head loss, the precision ``auto`` picks by its probe)
  against the baseline, a plain ``transformers.Trainer`` step in fp32 with full logits (cross-entropy only). Tokens/s
  interleaved in one process; peak RSS of each variant alone in a fresh process (sampled, absolute).

    python scripts/bench_speed.py                 # everything; each section prints its time when done
    python scripts/bench_speed.py --quick         # a smoke run: one size, tiny GPT-2, no compile
    python scripts/bench_speed.py --sections module --sizes 576,4096 --dtypes fp32
    python scripts/bench_speed.py --sections train --models smollm2 --json train.json
    python scripts/bench_speed.py --device cuda --sections module,model --sizes 576,4096 --dtypes bf16 \
        --models smollm2-random --model-dtype bf16   # on a GPU (scripts/gpu_check.sh)

``--device cuda`` times the module, model and train sections on the GPU, waiting for its queued work after every
call (the train section then compares the recipe's step with a plain Trainer step, ``--train-precision bf16``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

from hf_normswap import convert, kernels
from hf_normswap.discovery.norms import find_norms
from hf_normswap.modules import METHODS
from hf_normswap.placement import check_device
from hf_normswap.training.recipe_models import trainable_dense

from _common import machine

kernels.install()  # modules built by hand here: route them through the fused path (--eager runs turn it off)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def log(*args):
    print(*args, flush=True)


def synchronize():
    """Wait for the GPU's queued work, so that a timing covers it (nothing to wait for on the CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def interleaved(candidates: dict, reps: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each candidate, calls interleaved round-robin."""
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in candidates}
    for _ in range(reps):
        for name, fn in candidates.items():
            synchronize()
            start = time.perf_counter()
            fn()
            synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def eager(fn):
    """``fn`` with the fused path switched off: the plain formula, as in remote code or without a compiler."""
    def run():
        with kernels.fallback():
            return fn()
    return run


# ------------------------------------------------------------------------------------------------ module level
def module_section(args) -> list[dict]:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    rows = []
    for size in args.sizes:
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            torch.manual_seed(0)
            x = (4 * torch.randn(args.tokens, size)).to(args.device, dtype)
            x[0] *= 100  # a massive activation
            grad = torch.randn(args.tokens, size).to(args.device, dtype)
            norms = {
                "layernorm": nn.LayerNorm(size),
                "rmsnorm": LlamaRMSNorm(size),
                **{key: cls(size, cls.analytic_shape_value("rmsnorm", size, 1.0), amplitude=size ** 0.5)
                   for key, cls in METHODS.items()},  # ELN beta = C, DyT alpha = 1 / sqrt(C), Derf slope-matched
            }
            norms = {k: v.to(args.device, dtype) for k, v in norms.items()}
            for mode in ("forward", "forward+backward"):
                candidates = {"copy": lambda: x.clone()} if mode == "forward" else {}
                if mode == "forward+backward":
                    xg = x.detach().clone().requires_grad_()

                    def copy_step():
                        xg.clone().backward(grad)
                        xg.grad = None
                    candidates["copy"] = copy_step
                for name, norm in norms.items():
                    if mode == "forward":
                        call = (lambda n: lambda: n(x))(norm)
                    else:
                        def call(n=norm):
                            n(xg).backward(grad)
                            xg.grad = None
                            n.zero_grad(set_to_none=True)
                    candidates[name] = call
                    if name in METHODS:
                        candidates[name + "-eager"] = eager(call)
                grad_context = torch.no_grad() if mode == "forward" else torch.enable_grad()
                with grad_context:
                    med = interleaved(candidates, args.reps, warmup=2)
                for name, seconds in med.items():
                    row = dict(section="module", C=size, dtype=dtype_name, mode=mode, impl=name, ms=seconds * 1e3,
                               vs_copy=seconds / med["copy"], vs_layernorm=seconds / med["layernorm"],
                               vs_rmsnorm=seconds / med["rmsnorm"])
                    rows.append(row)
                log(f"C={size:<5} {dtype_name} {mode:<17} " + "  ".join(
                    f"{n}={s * 1e3:.2f}ms ({s / med['copy']:.2f}x copy)" for n, s in med.items()))
    return rows


# ------------------------------------------------------------------------------------------------- model level
def gpt2_model():
    import transformers

    config = transformers.GPT2Config(vocab_size=8192, n_embd=256, n_layer=4, n_head=4, n_positions=512)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval(), config.vocab_size


def smollm2_model():
    from hf_normswap.checkpoint.loading import load_model

    model, _ = load_model("offline:smollm2", with_tokenizer=False)
    return model, model.config.vocab_size


def smollm2_random_model(layers: int = 30):
    """SmolLM2-135M's shapes with random weights: its speed without its package (no GGUF reader, no download)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                      num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval(), config.vocab_size


def model_variants(original, method: str, calibrate: bool, vocab: int, seq: int):
    """The converted model and its folded copy. ``calibrate``: the ``fast`` strategy (``block``'s saturating
    per-channel start, no tuning steps) on 2 random blocks, seconds, so activations stay in the range a calibrated
    model has; the analytic conversion overflows on SmolLM2 (perplexity ~1e170), and timing it times
    non-finite arithmetic instead of the model."""
    from hf_normswap.calibration.calibrate import CalibrationConfig
    from hf_normswap.fold import fold

    converted = copy.deepcopy(original)
    calibration = None
    if calibrate:
        ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(3))
        calibration = CalibrationConfig(data=ids, num_blocks=2, block_len=seq, batch_size=2, strategy="fast",
                                        progress=False)
    convert(converted, to=method, calibration=calibration)
    folded = copy.deepcopy(converted)
    fold(folded)
    return converted, folded


def probe_forward(model, ids, norm_names: list[str]) -> dict:
    """One untimed forward: the largest |logit| (inf or nan when the conversion overflows, so a broken model shows)
    and the seconds spent inside the norms (or what replaced them), by hooks around each (on a GPU each waits for
    the queued work): the part of the forward that a faster norm can shorten."""
    spent, starts = [], {}

    def before(module, args):
        synchronize()
        starts[module] = time.perf_counter()

    def after(module, args, output):
        synchronize()
        spent.append(time.perf_counter() - starts[module])

    modules = [model.get_submodule(name) for name in norm_names]
    handles = [m.register_forward_pre_hook(before) for m in modules] + [m.register_forward_hook(after) for m in modules]
    try:
        synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        synchronize()
        total = time.perf_counter() - start
    finally:
        for handle in handles:
            handle.remove()
    return dict(largest_logit=logits.abs().max().item(), norm_seconds=sum(spent), norm_share=sum(spent) / total)


def model_section(args) -> list[dict]:
    rows = []
    for model_name in args.models:
        start = time.perf_counter()
        models = {"smollm2": smollm2_model, "gpt2": gpt2_model,
                  "smollm2-random": lambda: smollm2_random_model(args.layers)}
        original, vocab = models[model_name]()
        original.to(args.device, DTYPES[args.model_dtype]).config.use_cache = False
        norm_names = [info.name for info in find_norms(original)]
        log(f"{model_name}: loaded in {time.perf_counter() - start:.1f}s")
        torch.manual_seed(1)
        ids = torch.randint(0, vocab, (args.batch, args.seq)).to(args.device)
        tokens = ids.numel()
        for method in args.methods:
            converted, folded = model_variants(original, method, args.model_calib, vocab, args.seq)

            def forward(m):
                return lambda: m(input_ids=ids)

            models = {"original": original, method: converted, f"{method}-eager": converted,
                      f"{method}-folded": folded}
            candidates = {name: eager(forward(model)) if name.endswith("-eager") else forward(model)
                          for name, model in models.items()}
            with torch.no_grad():
                med = interleaved(candidates, args.model_reps)
            probes = {}  # after the timing's warm-up, which compiled the fused kernels
            for name, model in models.items():
                with kernels.fallback() if name.endswith("-eager") else contextlib.nullcontext():
                    probes[name] = probe_forward(model, ids, norm_names)
            log(f"{model_name}: largest |logit|, time inside the {len(norm_names)} norms (share of that forward): "
                + ", ".join(f"{n} {p['largest_logit']:.3g}, {p['norm_seconds'] * 1e3:.0f} ms ({p['norm_share']:.1%})"
                            for n, p in probes.items()))
            forward_rows = _model_rows(model_name, method, "forward", "eager", med, tokens)
            rows += [dict(row, **probes[row["variant"]]) for row in forward_rows]

            def train_step(m):
                m.train()

                def step():
                    out = m(input_ids=ids, labels=ids)
                    out.loss.backward()
                    m.zero_grad(set_to_none=True)
                return step

            if args.train_reps:
                candidates = {"original": train_step(original), method: train_step(converted),
                              f"{method}-eager": eager(train_step(converted))}
                med = interleaved(candidates, args.train_reps)
                rows += _model_rows(model_name, method, "train step", "eager", med, tokens)
                original.eval(), converted.eval()
            if args.compile:
                rows += _compiled_rows(model_name, method, original, converted, ids, args, forward, train_step)
            del converted, folded
    return rows


def _compiled_rows(model_name, method, original, converted, ids, args, forward, train_step) -> list[dict]:
    rows = []
    torch._dynamo.reset()
    compiled = {"original": torch.compile(original), method: torch.compile(converted)}
    with torch.no_grad():
        for name, m in compiled.items():
            start = time.perf_counter()
            m(input_ids=ids)
            log(f"{model_name}: torch.compile {name} forward warm-up {time.perf_counter() - start:.1f}s")
        med = interleaved({n: forward(m) for n, m in compiled.items()}, args.model_reps)
    rows += _model_rows(model_name, method, "forward", "compile", med, ids.numel())
    if args.compile_train:
        for name, m in compiled.items():
            start = time.perf_counter()
            train_step(m)()
            log(f"{model_name}: torch.compile {name} train-step warm-up {time.perf_counter() - start:.1f}s")
        med = interleaved({n: train_step(m) for n, m in compiled.items()}, args.train_reps)
        rows += _model_rows(model_name, method, "train step", "compile", med, ids.numel())
        for m in (original, converted):
            m.eval()
    return rows


def _model_rows(model_name, method, mode, execution, med, tokens) -> list[dict]:
    base = med["original"]
    rows = []
    for name, seconds in med.items():
        rows.append(dict(section="model", model=model_name, method=method, mode=mode, execution=execution,
                         variant=name, ms=seconds * 1e3, tokens_per_s=tokens / seconds, speedup=base / seconds))
    log(f"{model_name} {mode:<10} {execution:<7} " + "  ".join(
        f"{n}={s * 1e3:.0f}ms {tokens / s:.0f}tok/s ({base / s:.3f}x)" for n, s in med.items()))
    return rows


# ------------------------------------------------------------------------------------------------- calibration
class PeakRSS:
    """Peak resident memory of this process above its level at start, sampled every 2 ms in a thread.

    Only meaningful in a fresh process (see :func:`calibration_job`): a warm one serves new tensors from memory it
    freed earlier without growing, which is why an in-process reading came out near 0 MiB.
    """

    def __init__(self):
        import psutil

        self.process, self.peak, self.running = psutil.Process(), 0, False

    def __enter__(self):
        self.base = self.peak = self.process.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def mib(self) -> float:
        return (self.peak - self.base) / 2 ** 20

    @property
    def absolute_mib(self) -> float:
        return self.peak / 2 ** 20


def calibration_job(args) -> dict:
    """One measurement in this (fresh) process: the plain forward passes over the calibration data, or one
    ``convert`` with calibration (``--calib-job forward`` / ``--calib-job STRATEGY``). Time and peak RSS above the
    loaded model."""
    import gc

    from hf_normswap.calibration.calibrate import CalibrationConfig

    original, vocab = {"smollm2": smollm2_model, "gpt2": gpt2_model,
                       "smollm2-random": lambda: smollm2_random_model(args.layers)}[args.models[0]]()
    original.config.use_cache = False
    torch.manual_seed(2)
    ids = torch.randint(0, vocab, (args.calib_blocks, args.seq))
    gc.collect()
    with PeakRSS() as memory:
        start = time.perf_counter()
        if args.calib_job == "forward":
            with torch.no_grad():
                for i in range(0, ids.shape[0], args.batch):
                    original(input_ids=ids[i:i + args.batch])
        else:
            config = CalibrationConfig(data=ids, num_blocks=args.calib_blocks, block_len=args.seq,
                                       batch_size=args.batch, strategy=args.calib_job, progress=False)
            convert(original, to=args.methods[0], calibration=config)
        seconds = time.perf_counter() - start
    return dict(seconds=seconds, peak_mib=memory.mib, tokens=ids.numel())


def run_calibration_job(args, model_name: str, job: str) -> dict:
    """:func:`calibration_job` in a child process, so its peak memory is its own."""
    command = [sys.executable, __file__, "--calib-job", job, "--models", model_name, "--methods", args.methods[0],
               "--calib-blocks", str(args.calib_blocks), "--seq", str(args.seq), "--batch", str(args.batch)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"calibration job {job} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def calibration_section(args) -> list[dict]:
    rows = []
    for model_name in args.models:
        for strategy in args.calib_strategies:
            runs = {"forward": [], strategy: []}
            for _ in range(args.calib_reps):  # interleaved: forward passes, then a calibration, and again
                for job in runs:
                    runs[job].append(run_calibration_job(args, model_name, job))
            forward, calib = ({key: statistics.median(r[key] for r in runs[job]) for key in ("seconds", "peak_mib")}
                              for job in ("forward", strategy))
            tokens = runs["forward"][0]["tokens"]
            rows.append(dict(section="calibration", model=model_name, method=args.methods[0], strategy=strategy,
                             tokens=tokens, forward_s=forward["seconds"], calibration_s=calib["seconds"],
                             ratio=calib["seconds"] / forward["seconds"], forward_peak_mib=forward["peak_mib"],
                             calibration_peak_mib=calib["peak_mib"]))
            log(f"{model_name} calibration {strategy:<9} {tokens} tokens: forward passes {forward['seconds']:.2f}s, "
                f"calibration {calib['seconds']:.2f}s ({calib['seconds'] / forward['seconds']:.2f}x), peak RSS above "
                f"the loaded model (fresh process each): forward {forward['peak_mib']:.0f} MiB, calibration "
                f"{calib['peak_mib']:.0f} MiB")
    return rows


# ---------------------------------------------------------------------------------------------------- head loss
def head_inputs(args):
    generator = torch.Generator().manual_seed(5)
    tokens, (size, vocab) = args.train_batch * args.seq, args.head_dims
    hidden = torch.randn(args.train_batch, args.seq, size, generator=generator).requires_grad_()
    weight = (torch.randn(vocab, size, generator=generator) / size ** 0.5).requires_grad_()
    teacher_hidden = torch.randn(args.train_batch, args.seq, size, generator=generator)
    teacher_weight = torch.randn(vocab, size, generator=generator) / size ** 0.5
    labels = torch.randint(0, vocab, (args.train_batch, args.seq), generator=generator)
    return tokens, hidden, weight, teacher_hidden, teacher_weight, labels


def head_steps(hidden, weight, teacher_hidden, teacher_weight, labels) -> dict:
    """Forward + backward of 0.5 CE + 0.5 KD: from full logits (the recipe's former loss), and chunked."""
    from hf_normswap.training.distill import distillation_loss
    from hf_normswap.training.head_loss import head_loss

    def full():
        logits = hidden @ weight.T
        with torch.no_grad():
            teacher_logits = teacher_hidden @ teacher_weight.T
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        (0.5 * ce + 0.5 * distillation_loss(logits, teacher_logits)).backward()
        hidden.grad = weight.grad = None

    def chunked():
        head_loss(hidden, weight, labels, teacher_hidden=teacher_hidden, teacher_weight=teacher_weight,
                  ce_weight=0.5, kd_weight=0.5)[0].backward()
        hidden.grad = weight.grad = None

    return {"full-logits": full, "chunked": chunked}


def head_job(args) -> dict:
    """Peak RSS of one loss variant (this fresh process) above its inputs: two forward + backward passes."""
    _, *inputs = head_inputs(args)
    step = head_steps(*inputs)[args.head_job]
    with PeakRSS() as memory:
        for _ in range(2):
            step()
    return dict(peak_mib=memory.mib)


def head_section(args) -> list[dict]:
    tokens, *inputs = head_inputs(args)
    med = interleaved(head_steps(*inputs), args.train_reps)
    rows = []
    for name, seconds in med.items():
        command = [sys.executable, __file__, "--head-job", name, "--seq", str(args.seq), "--train-batch",
                   str(args.train_batch), "--head-dims", ",".join(map(str, args.head_dims))]
        result = subprocess.run(command, capture_output=True, text=True, check=True)
        memory = json.loads(result.stdout.strip().splitlines()[-1])["peak_mib"]
        rows.append(dict(section="head", tokens=tokens, hidden=args.head_dims[0], vocab=args.head_dims[1],
                         variant=name, ms=seconds * 1e3, speedup=med["full-logits"] / seconds, peak_mib=memory))
        log(f"head loss {name:<12} {tokens} tokens x {args.head_dims[1]} vocabulary: {seconds * 1e3:.0f} ms "
            f"({med['full-logits'] / seconds:.2f}x), peak RSS above the inputs {memory:.0f} MiB")
    return rows


# ------------------------------------------------------------------------------------------------------ training
TRAIN_VARIANTS = {
    # name: (distillation with the recipe's trainer, head chunk, precision, freeze embeddings, layer-wise weight)
    "baseline": (False, 0, "fp32", False, 0.0),
    "recipe": (True, 256, "auto", False, 0.0),
    "recipe-fp32-full-logits": (True, 0, "fp32", False, 0.0),
    "recipe-frozen-embeddings": (True, 256, "auto", True, 0.0),
    # the layer-wise term beside the logit KL (bench_recovery's +layerwise methods), through the chunked head or not
    "recipe-layerwise": (True, 256, "auto", False, 10.0),
    "recipe-layerwise-full-logits": (True, 0, "auto", False, 10.0),
}


def train_setup(args):
    """(student, teacher, inputs): the converted model (a calibrated start), the original, one batch."""
    original, vocab = {"smollm2": smollm2_model, "gpt2": gpt2_model,
                       "smollm2-random": lambda: smollm2_random_model(args.layers)}[args.models[0]]()
    original.config.use_cache = False
    student = trainable_dense(model_variants(original, args.methods[0], args.model_calib, vocab, args.seq)[0])
    original.requires_grad_(False)
    ids = torch.randint(0, vocab, (args.train_batch, args.seq), generator=torch.Generator().manual_seed(4))
    device = torch.device(args.device)
    return student.to(device), original.to(device), dict(input_ids=ids.to(device), labels=ids.to(device))


def train_steps(variants, student, teacher, inputs, directory: str, precision: str | None = None) -> tuple[dict, dict]:
    """``({variant: step()}, {variant: PrecisionChoice})``: one Trainer step each (the Trainer's ``training_step``,
    gradient clipping at 1.0, AdamW, zero_grad) sharing the student and one optimizer (parameters a variant
    freezes get no gradient and AdamW skips them). ``precision``: use it instead of probing (a child measuring
    memory takes the parent's choice)."""
    from transformers import Trainer, TrainingArguments

    from hf_normswap.training.distill import NormSwapTrainer, freeze_embeddings, head_chunk_for, training_loss
    from hf_normswap.precision import choose_precision

    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-5)
    steps, choices = {}, {}
    for name in variants:
        distill, chunk, variant_precision, frozen, hidden = TRAIN_VARIANTS[name]
        if precision is not None:
            variant_precision = precision

        def trainable(frozen=frozen):
            student.requires_grad_(True)
            if frozen:
                freeze_embeddings(student)

        if variant_precision == "auto":  # the recipe's probe: its own step on one sequence
            one = {k: v[:1] for k, v in inputs.items()}
            chunk_used = head_chunk_for(student, teacher, chunk)

            def probe_step(trainable=trainable, chunk_used=chunk_used, hidden=hidden):
                trainable()
                training_loss(student, teacher, one, distill_weight=0.5, hidden_weight=hidden,
                              head_chunk=chunk_used)[0].backward()
                student.zero_grad(set_to_none=True)
            student.train()
            choices[name] = choose_precision("auto", probe_step, repetitions=2)
        else:
            choices[name] = choose_precision(variant_precision)
        training = TrainingArguments(output_dir=directory, use_cpu=student.device.type == "cpu", report_to="none",
                                     bf16=choices[name].bf16,
                                     per_device_train_batch_size=inputs["input_ids"].shape[0])
        trainer = (NormSwapTrainer(model=student, args=training, teacher=teacher, distill_weight=0.5, head_chunk=chunk,
                                   hidden_weight=hidden) if distill else Trainer(model=student, args=training))
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(), which this bypasses

        def step(trainer=trainer, trainable=trainable):
            trainable()
            trainer.training_step(student, dict(inputs))
            torch.nn.utils.clip_grad_norm_([p for p in student.parameters() if p.grad is not None], 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        steps[name] = step
    return steps, choices


def train_job(args) -> dict:
    """Peak RSS of one variant alone (this fresh process): two steps after loading."""
    import tempfile

    student, teacher, inputs = train_setup(args)
    with tempfile.TemporaryDirectory() as directory:
        steps, _ = train_steps([args.train_job], student, teacher, inputs, directory, args.train_precision)
        with PeakRSS() as memory:
            for _ in range(2):
                steps[args.train_job]()
    return dict(peak_rss_mib=memory.absolute_mib)


def run_train_job(args, variant: str, precision: str) -> dict:
    command = [sys.executable, __file__, "--train-job", variant, "--models", args.models[0], "--methods",
               args.methods[0], "--seq", str(args.seq), "--train-batch", str(args.train_batch), "--train-precision",
               precision]
    if not args.model_calib:
        command.append("--no-model-calib")
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"train job {variant} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def train_section(args) -> list[dict]:
    import gc
    import tempfile

    student, teacher, inputs = train_setup(args)
    tokens = inputs["input_ids"].numel()
    with tempfile.TemporaryDirectory() as directory:
        steps, choices = train_steps(args.train_variants, student, teacher, inputs, directory, args.train_precision)
        for name, choice in choices.items():
            log(f"train {name}: {choice.describe()}")
        med = interleaved(steps, args.train_reps)
    log("train speed (before the memory runs): " + ", ".join(
        f"{name} {seconds:.2f}s/step ({med['baseline'] / seconds:.2f}x)" for name, seconds in med.items()))
    del student, teacher, steps  # the children below measure memory: leave them the RAM
    gc.collect()
    memory = {name: run_train_job(args, name, choices[name].precision)["peak_rss_mib"] if args.device == "cpu"
              else float("nan") for name in args.train_variants}  # host memory says nothing of a GPU run
    base = med["baseline"]
    rows = [dict(section="train", model=args.models[0], variant=name, tokens=tokens, seconds=seconds,
                 tokens_per_s=tokens / seconds, speedup=base / seconds, precision=choices[name].precision,
                 probe_fp32_s=choices[name].fp32_seconds, probe_bf16_s=choices[name].bf16_seconds,
                 probe_matmul_speedup=choices[name].matmul_speedup,
                 peak_rss_mb=memory[name], rss_ratio=memory[name] / memory["baseline"])
            for name, seconds in med.items()]
    for row in rows:
        log(f"train {row['variant']:<25} {row['precision']}: {row['seconds']:.2f}s/step {row['tokens_per_s']:.1f} "
            f"tok/s ({row['speedup']:.2f}x baseline), peak RSS {row['peak_rss_mb']:.0f} MiB "
            f"({row['rss_ratio']:.2f}x)")
    return rows


SAMPLING_TRAIN = ["recipe", "recipe-layerwise"]  # logit KL alone; with the layer-wise term (the SmolLM2 configs)


def sampling_section(args) -> list[dict]:
    """The original's samples (``hf_normswap.data.generated``) against the recipe's training step: tokens/s of each,
    interleaved in one process, sampling in the precision ``generated`` chooses (``precision=auto``), each batch size
    at each sample length (``sample-B`` at the training length, ``sample-BxL`` at another). A sample costs
    ``train tokens/s / sample tokens/s`` of a training step on the same number of tokens."""
    import tempfile
    import types

    from hf_normswap.data.generated import SampleCache, SamplingSettings, draw

    logging.basicConfig(format="[bench_speed] %(name)s: %(message)s")
    logging.getLogger("hf_normswap.data.packed_linear").setLevel(logging.INFO)  # whether each draw packed its weights

    student, teacher, inputs = train_setup(args)
    teacher.config.use_cache = True
    bos = teacher.config.bos_token_id
    bos = bos if bos is not None and bos < teacher.get_input_embeddings().num_embeddings else 0
    tokenizer = types.SimpleNamespace(bos_token_id=bos, eos_token_id=None)  # no EOS: every sequence at full length
    with tempfile.TemporaryDirectory() as directory:
        steps, choices = train_steps(SAMPLING_TRAIN, student, teacher, inputs, directory)
        counter, drawn_in = iter(range(10 ** 6)), {}

        shapes = {(f"sample-{b}" if length == args.seq else f"sample-{b}x{length}"): (b, length)
                  for b in args.sample_batches for length in args.sample_lengths or [args.seq]}

        def sampler(name):
            batch, length = shapes[name]
            cache = SampleCache(teacher, SamplingSettings(length=length, batch_size=batch), Path(directory) / "samples")

            def sample():
                drawn_in[name] = draw(teacher, tokenizer, cache, [next(counter)], progress=False)
            return sample

        candidates = {**{name: steps[name] for name in SAMPLING_TRAIN}, **{name: sampler(name) for name in shapes}}
        med = interleaved(candidates, args.train_reps)
    train_tok_s = {name: inputs["input_ids"].numel() / med[name] for name in SAMPLING_TRAIN}
    rows = [dict(section="sampling", model=args.models[0], variant=name, precision=choices[name].precision,
                 tokens=inputs["input_ids"].numel(), seconds=med[name], tokens_per_s=train_tok_s[name])
            for name in SAMPLING_TRAIN]
    for name, (batch, length) in shapes.items():
        tokens, seconds = batch * length, med[name]
        rows.append(dict(section="sampling", model=args.models[0], variant=name, length=length,
                         precision=drawn_in[name], tokens=tokens, seconds=seconds,
                         tokens_per_s=tokens / seconds,
                         **{f"cost_of_{step}": rate / (tokens / seconds) for step, rate in train_tok_s.items()}))
    for row in rows:
        costs = ", ".join(f"{row[f'cost_of_{name}']:.2f}x {name}" for name in SAMPLING_TRAIN if f"cost_of_{name}" in row)
        log(f"sampling {row['variant']:<16} {row['precision']}: {row['tokens_per_s']:.1f} tok/s"
            + (f" ({costs}: the training time of its tokens)" if costs else ""))
    return rows


def train_summary(rows: list[dict]) -> dict:
    """The keys a script checks: baseline and recipe tokens/s and peak RSS (MiB)."""
    by = {r["variant"]: r for r in rows if r["section"] == "train"}
    return {f"{key}_{measure}": by[key][field] for key in ("baseline", "recipe") if key in by
            for measure, field in (("tokens_per_s", "tokens_per_s"), ("peak_rss_mb", "peak_rss_mb"))}


# ----------------------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: C=576 fp32, tiny GPT-2, few reps, no compile")
    parser.add_argument("--device", default="cpu", help="module and model sections: cpu, cuda, cuda:1 (default: cpu)")
    parser.add_argument("--sections", default="module,model,calibration")
    parser.add_argument("--sizes", default="576,2048,4096")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=15, help="module-level repetitions per candidate")
    parser.add_argument("--models", default="smollm2,gpt2", help="comma-separated: smollm2, smollm2-random, gpt2")
    parser.add_argument("--model-dtype", choices=sorted(DTYPES), default="fp32", help="model section: weights' dtype")
    parser.add_argument("--layers", type=int, default=30, help="smollm2-random: its layers (30, as SmolLM2-135M)")
    parser.add_argument("--methods", default="eln", help=f"comma-separated: {', '.join(METHODS)}")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--model-reps", type=int, default=5)
    parser.add_argument("--train-reps", type=int, default=3, help="0: no training-step rows")
    parser.add_argument("--no-model-calib", dest="model_calib", action="store_false",
                        help="model section: time the analytic conversion (overflows on SmolLM2) instead of a "
                             "saturating calibrated start")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile runs")
    parser.add_argument("--compile-train", action="store_true", help="also time compiled training steps (slow)")
    parser.add_argument("--calib-blocks", type=int, default=4)
    parser.add_argument("--calib-strategies", default="fast,block")
    parser.add_argument("--calib-reps", type=int, default=1)
    parser.add_argument("--calib-job", help=argparse.SUPPRESS)  # internal: one calibration measurement (a child)
    parser.add_argument("--train-batch", type=int, default=2, help="train section: sequences per step")
    parser.add_argument("--train-variants", default="baseline,recipe",
                        help=f"train section, comma-separated: {', '.join(TRAIN_VARIANTS)}")
    parser.add_argument("--train-job", help=argparse.SUPPRESS)  # internal: one variant's peak RSS (a child)
    parser.add_argument("--train-precision", choices=("fp32", "bf16"),
                        help="train section: every variant in this precision instead of its own (bf16 on a GPU)")
    parser.add_argument("--sample-batches", default="8,32", help="sampling section: sequences a generate call")
    parser.add_argument("--sample-lengths", default=None,
                        help="sampling section: tokens a sample, comma-separated (default: --seq, the training length)")
    parser.add_argument("--head-dims", default="576,49152", help="head section: hidden size, vocabulary (SmolLM2)")
    parser.add_argument("--head-job", help=argparse.SUPPRESS)  # internal: one loss variant's peak RSS (a child)
    parser.add_argument("--json", help="write all rows to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.dtypes, args.reps, args.models = "576", "fp32", 5, "gpt2"
        args.model_reps, args.train_reps, args.compile, args.calib_blocks = 3, 2, False, 2
    for name in ("sections", "dtypes", "models", "methods", "calib_strategies", "train_variants"):
        setattr(args, name, [s.strip() for s in getattr(args, name).split(",") if s.strip()])
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.head_dims = [int(s) for s in args.head_dims.split(",")]
    args.sample_batches = [int(s) for s in args.sample_batches.split(",")]
    args.sample_lengths = [int(s) for s in args.sample_lengths.split(",")] if args.sample_lengths else None
    try:
        check_device(args.device, "--device")
    except ValueError as error:
        parser.error(str(error))
    if args.device != "cpu" and set(args.sections) - {"module", "model", "train"}:
        parser.error("--device applies to the module, model and train sections; time the others on the cpu")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.calib_job:
        print(json.dumps(calibration_job(args)))
        return 0
    if args.train_job:
        print(json.dumps(train_job(args)))
        return 0
    if args.head_job:
        print(json.dumps(head_job(args)))
        return 0
    info = dict(machine(), device=args.device)
    if torch.device(args.device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(args.device)
    log(f"machine: {info}")
    log(f"command: python scripts/bench_speed.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    rows = []
    sections = {"module": module_section, "model": model_section, "calibration": calibration_section,
                "head": head_section, "train": train_section, "sampling": sampling_section}
    for name in args.sections:
        start = time.perf_counter()
        rows += sections[name](args)
        log(f"[{name} section: {time.perf_counter() - start:.0f}s]")
    info["load_average_end"] = os.getloadavg()[0]
    if args.json:
        Path(args.json).write_text(json.dumps(dict(machine=info, args=vars(args), rows=rows, cpu=info["cpu"],
                                                   cpu_flags=info["cpu_flags"], **train_summary(rows)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
