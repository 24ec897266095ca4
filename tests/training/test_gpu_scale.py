"""The step at a GPU's scale: the batch the memory plan fits and the accumulation to the tokens a step; each block
compiled (inductor, here on the CPU) gives the eager step's loss and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_normswap import convert
from hf_normswap.planning import PlanSettings, plan
from hf_normswap.training.config import DistillSettings
from hf_normswap.training.recovery_loss import RecoveryLoss
from hf_normswap.training.recovery_run import step_batches
from hf_normswap.training.compiled_blocks import compile_blocks, repeated_blocks
from tiny_models import tiny_model


def test_the_batch_is_the_largest_the_plan_fits_and_accumulation_makes_up_the_tokens():
    model = tiny_model("llama")
    roomy = plan(model, PlanSettings(device_memory=2**40, trainable="all", seq_len=512))
    assert step_batches(roomy, 65536, 512, 1) == (64, 2)  # 64 x 512 x 2 = 65,536
    assert step_batches(roomy, 65536, 512, 4) == (32, 1)  # four processes share the step
    assert step_batches(roomy, 1000, 512, 1) == (1, 2)  # fewer tokens than a sequence: at least one
    assert step_batches(replan_device(roomy, 8), 65536, 512, 1) == (8, 16)  # a device that holds 8 sequences


def replan_device(memory_plan, batch: int):
    """``memory_plan`` on a device that holds the batch ``batch`` and no more."""
    from hf_normswap.planning.memory_plan import replan

    return replan(memory_plan, device_memory=replan(memory_plan, batch_size=batch).peak()["device"])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_compiled_blocks_give_the_eager_step_s_loss_and_gradients():
    """The recipe's step (logit KL through the fused head plus every block's output) with each block of the
    student and the original compiled by inductor, against the same step eager."""
    student, teacher = tiny_model("llama", seed=0), tiny_model("llama", seed=1).requires_grad_(False)
    convert(student, to="eln")
    student.train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    inputs = dict(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids))
    results = []
    for compiled in (False, True):
        model, original = copy.deepcopy(student), copy.deepcopy(teacher)
        if compiled:
            assert compile_blocks([model, original]) == 2 * len(repeated_blocks(student)) > 0
        for _ in range(2):  # the second step runs the compiled code as it stays
            model.zero_grad(set_to_none=True)
            loss = RecoveryLoss.of(DistillSettings(weight=1.0, hidden=10.0), model)(model, original, inputs, 8)[0]
            loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert compiled_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
