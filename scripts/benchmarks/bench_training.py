"""What the recovery recipe's training costs, as side-by-side ratios taken in one run:

* head: the distillation loss alone (CE + KL over the vocabulary, forward + backward) for tokens x C hidden states
  through a V x C head: from full logits against chunked (``hf_normswap.training.head_loss``); time interleaved in one
  process, peak RSS above the inputs in a fresh process each;
* train: one optimizer step of the converted model (all weights train), batch x seq tokens, as the recipe takes it
  (``NormSwapTrainer``: distillation from the original, chunked head loss, the precision ``auto`` picks by its probe)
  against the baseline, a plain ``transformers.Trainer`` step in fp32 with full logits (cross-entropy only). Tokens/s
  interleaved in one process; peak RSS of each variant alone in a fresh process (sampled, absolute);
* sampling: the original's own samples (batched ``generate``, ``hf_normswap.data.generated``) against the recipe's
  training step, tokens/s of each interleaved: the cost of a sampled token in training time.

The recipe's trainer, losses and sampler are not public API: this benchmark measures them, so it imports them.

    python scripts/benchmarks/bench_training.py --sections train --models smollm2 --json train.json
    python scripts/benchmarks/bench_training.py --sections sampling --models smollm2 --seq 512 --train-batch 2
    python scripts/benchmarks/bench_training.py --quick --sections head,train   # a smoke run: tiny GPT-2
    python scripts/benchmarks/bench_training.py --device cuda --sections train --models smollm2-random \\
        --train-precision bf16
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from hf_normswap import METHODS
from hf_normswap.training.recipe_models import trainable_dense  # internal: the recipe's own trainable choice

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared harness (run by path)

from harness.flags import add_models
from harness.models import MODELS, load, model_variants
from harness.timing import PeakRSS, arguments, child_result, device_option, interleaved, log, run_sections, split_list


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
    """Forward + backward of 0.5 CE + 0.5 KD: from full logits, and chunked (Liger-Kernel's fused linear JSD)."""
    # internal: the recipe's head losses, timed against each other
    from hf_normswap.training.losses import distillation_loss
    from hf_normswap.training.head_loss import head_loss

    def full():
        logits = hidden @ weight.T
        with torch.no_grad():
            teacher_logits = teacher_hidden @ teacher_weight.T
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        (0.5 * ce + 0.5 * distillation_loss(logits, teacher_logits)).backward()
        hidden.grad = weight.grad = None

    def chunked():
        head_loss(hidden, weight, labels, teacher=(teacher_hidden, teacher_weight), weights=(0.5, 0.5))[0].backward()
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
        memory = child_result(__file__, [
            "--head-job", name, "--seq", str(args.seq), "--train-batch", str(args.train_batch),
            "--head-dims", ",".join(map(str, args.head_dims))], f"head job {name}")["peak_mib"]
        rows.append(dict(section="head", tokens=tokens, hidden=args.head_dims[0], vocab=args.head_dims[1],
                         variant=name, ms=seconds * 1e3, speedup=med["full-logits"] / seconds, peak_mib=memory))
        log(f"head loss {name:<12} {tokens} tokens x {args.head_dims[1]} vocabulary: {seconds * 1e3:.0f} ms "
            f"({med['full-logits'] / seconds:.2f}x), peak RSS above the inputs {memory:.0f} MiB")
    return rows


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
    original, vocab = load(args.models[0], args.layers)
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

    # internal: the recipe's loss, trainable choice, Trainer and precision, timed against a plain Trainer
    from hf_normswap.training.config import DistillSettings
    from hf_normswap.training.losses import head_chunk_for
    from hf_normswap.training.recovery_loss import RecoveryLoss
    from hf_normswap.training.trainable import freeze_embeddings
    from hf_normswap.training.trainer import NormSwapTrainer
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
                RecoveryLoss.of(DistillSettings(weight=0.5, hidden=hidden), student)(
                    student, teacher, one, chunk_used)[0].backward()
                student.zero_grad(set_to_none=True)
            student.train()
            choices[name] = choose_precision("auto", probe_step, repetitions=2)
        else:
            choices[name] = choose_precision(variant_precision)
        training = TrainingArguments(output_dir=directory, use_cpu=student.device.type == "cpu", report_to="none",
                                     bf16=choices[name].bf16,
                                     per_device_train_batch_size=inputs["input_ids"].shape[0])
        loss = RecoveryLoss.of(DistillSettings(weight=0.5, hidden=hidden), student, chunk)
        trainer = (NormSwapTrainer(model=student, args=training, teacher=teacher, loss=loss) if distill
                   else Trainer(model=student, args=training))
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
    """:func:`train_job` in a child process, so its peak memory is its own."""
    return child_result(__file__, [
        "--train-job", variant, "--models", args.models[0], "--methods", args.methods[0], "--layers", str(args.layers),
        "--seq", str(args.seq), "--train-batch", str(args.train_batch), "--train-precision", precision,
        *([] if args.model_calib else ["--no-model-calib"])], f"train job {variant}")


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

    # internal: the recipe's sampler of the original's text
    from hf_normswap.data.generated import SampleCache, SamplingSettings, draw

    logging.basicConfig(format="[bench_training] %(name)s: %(message)s")
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


def parse_args(argv=None):
    parser = arguments(__doc__, "tiny GPT-2, few repetitions", "train section: cpu, cuda, cuda:1 (default: cpu)")
    parser.add_argument("--sections", default="head,train,sampling")
    add_models(parser, MODELS, "smollm2", "the first is trained")
    parser.add_argument("--layers", type=int, default=30, help="smollm2-random: its layers (30, as SmolLM2-135M)")
    parser.add_argument("--methods", default="eln", help=f"the first is converted to: {', '.join(METHODS)}")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--train-reps", type=int, default=3)
    parser.add_argument("--no-model-calib", dest="model_calib", action="store_false",
                        help="train the analytic conversion instead of a saturating calibrated start")
    parser.add_argument("--train-batch", type=int, default=2, help="sequences per step")
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
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.train_reps = "gpt2", 2
    for name in ("sections", "models", "methods", "train_variants"):
        setattr(args, name, split_list(getattr(args, name)))
    args.head_dims, args.sample_batches = split_list(args.head_dims, int), split_list(args.sample_batches, int)
    args.sample_lengths = split_list(args.sample_lengths, int) if args.sample_lengths else None
    device_option(parser, args)
    if args.device != "cpu" and set(args.sections) - {"train"}:
        parser.error("--device applies to the train section; time the others on the cpu")
    return args


def main(argv=None) -> int:
    sections = {"head": head_section, "train": train_section, "sampling": sampling_section}
    return run_sections(__file__, parse_args(argv), sections, argv, train_summary,
                        children={"train_job": train_job, "head_job": head_job})


if __name__ == "__main__":
    sys.exit(main())
