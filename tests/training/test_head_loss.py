"""The chunked head loss equals the full-logits loss and its gradients, and both training steps use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_normswap.training.head_loss import (fused_head_available, head_bypassed, head_is_plain, head_loss,
                                           next_token_targets)
from hf_normswap.training.config import DistillSettings
from hf_normswap.training.losses import distillation_loss
from hf_normswap.training.recovery_loss import RecoveryLoss
from hf_normswap.training.trainable import freeze_embeddings
from tiny_models import tiny_model


def _full(hidden, weight, labels, teacher_logits, mask, w, temperature):
    """The plain formula; with CE beside KD, both over the positions of ``mask`` that have a next-token target."""
    logits = hidden @ weight.T
    targets = next_token_targets(labels)
    if w < 1:
        targets = targets.masked_fill(mask == 0, -100)
        mask = mask * (targets != -100)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    kd = distillation_loss(logits, teacher_logits, temperature, mask)
    return (1 - w) * ce + w * kd, ce, kd


@pytest.mark.parametrize("chunk", [3, 64])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("w", [0.3, 1.0])
def test_chunked_loss_and_gradients_equal_the_full_logits_version(chunk, temperature, w):
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    teacher_hidden, teacher_weight = torch.randn(2, 9, 12), torch.randn(50, 12)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, 4] = -100
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 7:] = 0
    full = _full(hidden, weight, labels, teacher_hidden @ teacher_weight.T, mask, w, temperature)
    expected = torch.autograd.grad(full[0], (hidden, weight))
    chunked = head_loss(hidden, weight, labels, teacher=(teacher_hidden, teacher_weight), kd_mask=mask,
                        weights=(1 - w, w), temperature=temperature, chunk=chunk)
    for got, want in zip(chunked[:1] + chunked[2:] if w == 1 else chunked, full[:1] + full[2:] if w == 1 else full):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(torch.autograd.grad(2.0 * chunked[0], (hidden, weight)), expected):
        torch.testing.assert_close(got, 2.0 * want, rtol=1e-5, atol=1e-6)


def _tiny_pair_and_batch():
    student, teacher = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    student.train()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    return student, teacher, dict(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids))


def _flat(loss_and_logged):
    """``(loss, ce, kd, hidden, embedding, scale)`` of a :class:`RecoveryLoss` call."""
    loss, logged = loss_and_logged
    zero = torch.zeros(())
    return (loss, *(logged.get(k, zero) for k in ("ce_loss", "kd_loss", "hidden_loss", "embedding_loss", "scale_loss")))


def _outputs_and_grads_per_chunk(student, step):
    """``step(head_chunk)`` with full logits (0) and through the chunked head (5): its outputs and the gradients."""
    results = {}
    for chunk in (0, 5):
        student.zero_grad(set_to_none=True)
        outputs = step(chunk)
        outputs[0].backward()
        results[chunk] = (outputs, {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None})
    return results


@pytest.mark.parametrize("distill_weight", [0.0, 1.0])  # mixed, KD leaves out the last position: the test above
def test_distillation_step_through_the_bypassed_head_matches_full_logits_on_a_tiny_llama(distill_weight):
    student, teacher, inputs = _tiny_pair_and_batch()
    assert head_is_plain(student) and head_is_plain(teacher)
    loss = RecoveryLoss.of(DistillSettings(weight=distill_weight), student)
    results = _outputs_and_grads_per_chunk(student, lambda chunk: _flat(loss(student, teacher, inputs, chunk)))
    counted = [True, distill_weight < 1, distill_weight > 0]  # the loss, and CE and KD where they count
    for a, b, count in zip(results[0][0], results[5][0], counted):
        if count:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert results[0][1].keys() == results[5][1].keys()
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[5][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("distill_weight, logits", [(1.0, True), (0.0, True), (1.0, False)])
def test_layerwise_step_through_the_bypassed_head_matches_full_logits_on_a_tiny_llama(distill_weight, logits):
    """The layer-wise term beside the logit KL (or alone) gives the same loss, parts and gradients when CE and KD go
    through the chunked head: the hidden states are the same forward's."""
    student, teacher, inputs = _tiny_pair_and_batch()
    loss = RecoveryLoss.of(DistillSettings(weight=distill_weight, logits=logits, hidden=3.0), student)
    results = _outputs_and_grads_per_chunk(student, lambda chunk: _flat(loss(student, teacher, inputs, chunk)))

    def compared(outputs):  # loss, KD, layer-wise term, and CE where it counts
        loss, ce, kd, hidden, _, _ = outputs
        return (loss, kd if distill_weight > 0 else loss, hidden) + ((ce,) if distill_weight < 1 else ())

    _, kd, hidden = (float(t.detach()) for t in results[5][0][:1] + results[5][0][2:4])
    assert hidden > 0 and (kd > 0) == (logits and distill_weight > 0)
    for a, b in zip(compared(results[0][0]), compared(results[5][0])):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for name, grad in results[0][1].items():  # without CE and KD the full path gives the head a zero gradient
        torch.testing.assert_close(results[5][1].get(name, torch.zeros_like(grad)), grad, rtol=1e-4, atol=1e-6,
                                   msg=name)
    assert results[5][1].keys() <= results[0][1].keys()


def test_head_bypass_is_undone_and_a_biased_head_is_not_plain():
    model = tiny_model("llama")
    ids = torch.arange(6)[None]
    before = model(input_ids=ids).logits
    with head_bypassed(model):
        assert model(input_ids=ids).logits.shape[-1] == model.config.hidden_size
    torch.testing.assert_close(model(input_ids=ids).logits, before)
    head = model.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.zeros(head.out_features))
    assert not head_is_plain(model)


def test_freeze_embeddings_freezes_the_tied_matrix_and_nothing_else():
    model = tiny_model("llama")
    model.requires_grad_(True)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    assert freeze_embeddings(model) == total - embedding.numel() - (
        0 if model.get_output_embeddings().weight is embedding else model.get_output_embeddings().weight.numel())
    assert not embedding.requires_grad and not model.get_output_embeddings().weight.requires_grad
    assert all(p.requires_grad for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)


@pytest.mark.parametrize("hidden_weight", [0.0, 10.0])
def test_the_trainer_keeps_the_chunked_head_loss_under_bf16_autocast(tmp_path, monkeypatch, hidden_weight):
    """The head check runs before accelerate wraps the forward in bf16 autocast: under autocast the logits are not
    exactly ``hidden @ W.T`` in fp32, and a check made there would drop the chunked loss (or fail on the dtypes)."""
    import datasets
    from transformers import TrainingArguments

    from hf_normswap import convert
    from hf_normswap.training.loss_terms import logits
    from hf_normswap.training.trainer import NormSwapTrainer

    student, teacher = tiny_model("llama"), tiny_model("llama")
    convert(student, to="eln")
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0)).tolist()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, bf16=True,
                             use_cpu=True, save_strategy="no", report_to="none", disable_tqdm=True)
    loss = RecoveryLoss.of(DistillSettings(weight=1.0, hidden=hidden_weight), student, head_chunk=8)
    trainer = NormSwapTrainer(model=student, args=args, teacher=teacher, loss=loss,
                              train_dataset=datasets.Dataset.from_dict({"input_ids": ids, "labels": ids}))
    chunks = []
    monkeypatch.setattr(logits, "head_loss", lambda *a, **k: chunks.append(k["chunk"]) or head_loss(*a, **k))
    assert trainer.train().training_loss > 0
    assert chunks == [8, 8]  # both steps went through the chunked loss, with the layer-wise term or without


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_taking_off_accelerate_s_autocast_wrapper_gives_back_the_plain_model(arch):
    """After bf16 training the recipe evaluates and saves the model as it reloads: fp32, hidden states available."""
    from accelerate import Accelerator

    from hf_normswap.training.trainer import without_autocast_wrapper

    from accelerate.state import AcceleratorState

    model, fresh = tiny_model(arch).eval(), tiny_model(arch).eval()
    AcceleratorState._reset_state(reset_partial_state=True)  # accelerate's state is process-wide
    try:
        Accelerator(mixed_precision="bf16", cpu=True).prepare_model(model)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    wrapped = model(input_ids=ids).logits
    assert not torch.equal(wrapped, fresh(input_ids=ids).logits)  # computed under bf16 autocast
    plain = without_autocast_wrapper(model)(input_ids=ids, output_hidden_states=True)
    assert torch.equal(plain.logits, fresh(input_ids=ids).logits) and plain.hidden_states is not None


def test_without_the_fused_loss_the_recipe_takes_full_logits(monkeypatch):
    from hf_normswap.training import losses

    student, teacher = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    assert fused_head_available() and losses.head_chunk_for(student, teacher, 256) == 256
    monkeypatch.setattr(losses, "fused_head_available", lambda: False)  # liger-kernel not installed
    assert losses.head_chunk_for(student, teacher, 256) == 0
