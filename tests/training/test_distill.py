"""Recovery methods on tiny models: each moves a converted model toward its original in a few steps.

The distance is the one each method trains on (layer-wise: mean relative block-output error; block-wise
reconstruction: a block's relative output error), measured before and after on the inputs it trained on: the tests
check that each method optimizes its objective, not that it generalizes (the benchmarks measure that).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import TrainingArguments

import hf_normswap
from hf_normswap.calibration.calibrate import CalibrationConfig
from hf_normswap.training.config import DistillSettings
from hf_normswap.training.losses import distillation_loss
from hf_normswap.training.recovery_loss import RecoveryLoss
from hf_normswap.training.trainable import disable_dropout, set_trainable
from hf_normswap.training.trainer import NormSwapTrainer
from hf_normswap.training.layerwise import embedding_cosine_error, relative_hidden_error
from hf_normswap.training.hand_overs.blend import ProgressiveSwap
from hf_normswap.training.hand_overs.progressive import schedule
from tiny_models import tiny_model


def converted_pair(arch: str = "llama"):
    """(converted tiny model, its original): ELN after the ``fast`` calibration on random tokens. ``bert``: the
    encoder alone (it ends in hidden states, as a sentence encoder does)."""
    original = tiny_model(arch).eval()
    original = original.bert if arch == "bert" else original
    torch.manual_seed(0)
    model = copy.deepcopy(original)
    calibration = CalibrationConfig(data=torch.randint(0, 128, (8, 32)), strategy="fast", progress=False)
    hf_normswap.convert(model, to="eln", calibration=calibration)
    return model, original


def trainer_for(arch: str, tmp_path, **distill):
    """(converted model with every weight trainable, its original, a NormSwapTrainer distilling with the
    ``distill`` settings at weight 1, its optimizer)."""
    model, original = converted_pair(arch)
    set_trainable(model, "all")
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-2, use_cpu=True, report_to="none")
    loss = RecoveryLoss.of(DistillSettings(weight=1.0, **distill), model)
    trainer = NormSwapTrainer(model=model, args=args, teacher=original, loss=loss, shape_lr=3e-2)
    return model, original, trainer, trainer.create_optimizer()


def test_relative_hidden_error_is_scale_free_and_masks_the_sink():
    torch.manual_seed(0)
    teacher = tuple(torch.randn(2, 6, 8) * scale for scale in (1.0, 3.0, 100.0))
    student = tuple(t * 1.1 for t in teacher)  # 10 % off everywhere: relative error 0.01 at every depth
    assert float(relative_hidden_error(student, teacher)) == pytest.approx(0.01, rel=1e-5)
    broken_sink = tuple(s.clone() for s in student)
    for s in broken_sink:
        s[:, 0] *= 50.0
    assert float(relative_hidden_error(broken_sink, teacher)) == pytest.approx(0.01, rel=1e-5)  # masked
    assert float(relative_hidden_error(broken_sink, teacher, sink_weight=1.0)) > 100 * 0.01


@pytest.mark.parametrize("arch,logits", [("llama", False), ("llama", True), ("bert", False)],
                         ids=["layerwise", "layerwise+logits", "encoder"])
def test_layerwise_distillation_moves_the_converted_model_toward_the_original(tmp_path, arch, logits):
    model, original, trainer, optimizer = trainer_for(arch, tmp_path, logits=logits, hidden=1.0)
    # a random tiny model does not generalize across random tokens in a few steps: train and measure on one batch
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))

    @torch.no_grad()
    def distance():
        model.eval()
        student = model(input_ids=ids, output_hidden_states=True).hidden_states
        return float(relative_hidden_error(student, original(input_ids=ids, output_hidden_states=True).hidden_states))

    before = distance()
    model.train()
    for _ in range(30):
        optimizer.zero_grad()
        trainer.compute_loss(model, {"input_ids": ids} if arch == "bert" else {"input_ids": ids, "labels": ids}).backward()
        optimizer.step()
    assert distance() < 0.8 * before  # measured: llama 0.173 -> 0.092 (either loss), bert 0.374 -> 0.252
    assert trainer._component_sums["hidden_loss"] > 0 and (trainer._component_sums["kd_loss"] > 0) == logits


@pytest.mark.parametrize("arch,rates", [
    ("bert", dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)),  # nn.Dropout modules
    ("llama", dict(attention_dropout=0.1)),  # a float the attention reads in training
    ("gpt2", dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)),
    ("opt", dict(dropout=0.1, attention_dropout=0.1)),
])
def test_disable_dropout_makes_training_forwards_deterministic_and_keeps_the_config(arch, rates):
    model = tiny_model(arch, **rates).train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))

    def logits():
        return model(input_ids=ids).logits

    assert not torch.equal(logits(), logits())  # dropout is on in training mode
    assert disable_dropout(model) > 0
    assert torch.equal(logits(), logits())
    assert all(getattr(model.config, name) == rate for name, rate in rates.items())  # saved checkpoints keep it
    assert disable_dropout(model) == 0


def test_embedding_loss_moves_an_encoder_s_pooled_embeddings_toward_the_original(tmp_path):
    model, original, trainer, optimizer = trainer_for("bert", tmp_path, logits=False, embedding=1.0)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[2:, 20:] = 0  # padded rows: pooling weighs the real tokens only

    @torch.no_grad()
    def distance():
        model.eval()
        return float(embedding_cosine_error(model(input_ids=ids, attention_mask=mask).last_hidden_state,
                                            original(input_ids=ids, attention_mask=mask).last_hidden_state, mask))

    before = distance()
    model.train()
    for _ in range(20):
        optimizer.zero_grad()
        trainer.compute_loss(model, {"input_ids": ids, "attention_mask": mask}).backward()
        optimizer.step()
    assert distance() < 0.5 * before
    assert trainer._component_sums["embedding_loss"] > 0 and trainer._component_sums["hidden_loss"] == 0


def block_errors(block_weights_lr: float) -> list[float]:
    """Relative output error of each tiny-llama block after block tuning (``block`` strategy, no end-to-end steps)."""
    torch.manual_seed(0)
    model = tiny_model("llama").eval()
    calibration = CalibrationConfig(data=torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(2)),
                                    strategy="block", block_steps=30, tune_steps=0, progress=False,
                                    block_weights_lr=block_weights_lr)
    report = hf_normswap.convert(model, to="eln", calibration=calibration)
    return [row["error_after"] for row in report.calibration["block_tuning"] if isinstance(row["block"], int)]


def test_blockwise_reconstruction_fits_block_outputs_closer_than_the_norms_alone():
    norms_only, with_weights = block_errors(0.0), block_errors(1e-3)
    assert len(norms_only) == len(with_weights) == 2
    for alone, reconstructed in zip(norms_only, with_weights):
        assert reconstructed < 0.25 * alone  # measured: 0.0069 -> 0.00076, 0.020 -> 0.0017


def test_progressive_swap_training_ends_closer_to_the_original(tmp_path):
    model, original = converted_pair()
    set_trainable(model, "all")
    names = list(model.config.normswap["converted"])
    stages = schedule({name: "norm" for name in names}, every=4, ramp=4, group=1)  # fully converted at step 12
    swap = ProgressiveSwap(model, {name: original.get_submodule(name) for name in names}, stages)
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-2, use_cpu=True, report_to="none")
    trainer = NormSwapTrainer(model=model, args=args, teacher=original,
                              loss=RecoveryLoss.of(DistillSettings(weight=1.0), model), shape_lr=3e-2)
    optimizer = trainer.create_optimizer()
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))

    @torch.no_grad()
    def kl():
        swap.set_step(10 ** 6)  # measured fully converted
        model.eval()
        return float(distillation_loss(model(input_ids=ids).logits, original(input_ids=ids).logits))

    before = kl()
    model.train()
    for step in range(30):
        swap.set_step(step)
        optimizer.zero_grad()
        trainer.compute_loss(model, {"input_ids": ids, "labels": ids}).backward()
        optimizer.step()
    swap.remove()
    assert kl() < 0.5 * before  # measured: 0.0022 -> 0.00026


def test_the_loss_sums_its_terms_in_the_order_it_always_had():
    """``(1 - w) * CE + w * KD``, then ``w * (h * H + e * E)``, then ``(w * s) * S``: bit for bit, so that a run's
    numbers do not move with the terms' classes; each term is logged."""
    model, original = converted_pair()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    inputs = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    w, h, e, s = 0.9, 7.7, 1.3, 0.33  # weights at which other orders of the sum round differently on this batch
    loss = RecoveryLoss.of(DistillSettings(weight=w, temperature=2.0, hidden=h, embedding=e, scale=s), model,
                           head_chunk=0)
    total, logged = loss(model, original, inputs)
    ce, kd, hidden, embedding, scale = (logged[k] for k in ("ce_loss", "kd_loss", "hidden_loss", "embedding_loss",
                                                            "scale_loss"))
    assert all(float(v) > 0 for v in logged.values())
    assert torch.equal(total, ((1 - w) * ce + w * kd) + w * (h * hidden + e * embedding) + w * s * scale)
    assert len(loss.describe()) == 4 and loss.hidden_states
