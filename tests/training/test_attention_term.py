"""The attention term (``distill.terms.attention``): KL of every layer's attention rows to the original's."""

from __future__ import annotations

import copy

import datasets
import pytest
import torch
from transformers import TrainerCallback

from hf_normswap.planning.sizes import model_sizes
from hf_normswap.training.config import DistillSettings
from hf_normswap.training.loss_terms.attention import Attention
from hf_normswap.training.recovery_loss import RecoveryLoss
from training.test_distill import trainer_for
from tiny_models import tiny_model

IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))


def attention_kl(model, original, ids=IDS) -> float:
    loss = RecoveryLoss.of(DistillSettings(weight=1.0, logits=False, terms={"attention": 1.0}), model, head_chunk=0)
    _, logged = loss(model, original, {"input_ids": ids, "labels": ids})
    return float(logged["attention_loss"].detach())


def by_hand(model, original, ids=IDS) -> float:
    """The mean over layers, batch, heads and queries of sum_k p log(p / q), from eager attention's weights."""
    rows = []
    for m in (model, original):
        m.set_attn_implementation("eager")
        with torch.no_grad():
            rows.append(m(input_ids=ids, output_attentions=True).attentions)
    kls = [(p * (p.clamp_min(1e-30).log() - q.clamp_min(1e-12).log())).sum(-1).mean() for q, p in zip(*rows)]
    return float(torch.stack(kls).mean())


def test_a_model_against_itself_has_no_attention_loss():
    original = tiny_model("llama").eval()
    assert attention_kl(copy.deepcopy(original), original) == pytest.approx(0.0, abs=1e-6)


def test_the_term_is_the_kl_of_the_attention_rows_and_trains_toward_the_original(tmp_path):
    model, original, trainer, optimizer = trainer_for("llama", tmp_path, logits=False, terms={"attention": 1.0})
    with torch.no_grad():  # the tiny model's rows are near uniform: sharper queries make them differ
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(20.0)
    start = attention_kl(model, original)
    assert start > 1e-2
    assert start == pytest.approx(by_hand(model, original), rel=1e-4)
    model.train()
    for _ in range(8):
        loss = trainer.compute_loss(model, {"input_ids": IDS, "labels": IDS})
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    assert attention_kl(model, original) < 0.8 * start


def test_the_memory_plan_counts_both_models_attention_weights():
    sizes = model_sizes(tiny_model("llama"))
    held = Attention.memory(sizes, tokens=2 * 24, value_bytes=4, seq_len=24)
    assert held == {"attention weights": 2 * sizes.layers * sizes.heads * 2 * 24 * 24 * 4}


def test_training_ends_with_both_models_back_on_their_own_attention(tmp_path):
    """Eager attention for the term while training; afterwards each model as it was, so the saved model reloads
    with the logits it was trained to."""
    model, original, trainer, _ = trainer_for("llama", tmp_path, terms={"attention": 1.0})
    before = (model.config._attn_implementation, original.config._attn_implementation)
    assert "eager" not in before
    rows = IDS.tolist()
    trainer.train_dataset = datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})
    trainer.args.max_steps, trainer.args.per_device_train_batch_size = 2, 2
    seen = []
    trainer.add_callback(type("Seen", (TrainerCallback,), {
        "on_step_end": lambda self, *a, **k: seen.append(model.config._attn_implementation)})())
    trainer.train()
    assert seen == ["eager", "eager"]
    assert (model.config._attn_implementation, original.config._attn_implementation) == before
