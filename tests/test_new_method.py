"""A method is one class: a copy of the package whose ``modules.py`` alone gains a class (and its entry in
``METHODS``) converts with it (the analytic start, and the block, least-squares and KL calibrations), runs it
fused, saves, reloads through the package and through remote code, and shows it on the model card and the command
line."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import torch

from package_copy import REMOTE, copy_package, run_python


SOFTSIGN = '''

class Softsign(ElementwiseNorm):
    """``y = weight * alpha x / (1 + |alpha x|) + bias``: a method that only this test's copy of the package has."""

    key = "softsign"
    title = "Softsign (a test method)"
    formula = "y = weight * alpha * x / (1 + |alpha * x|) + bias"
    shape_note = "`alpha` is one learnable scalar per module (or per channel)"
    citation = "@misc{softsign_test_method, title = {A method added in modules.py alone}}"
    shape_name = "alpha"
    log_limit = LOG_ALPHA_LIMIT
    scale_power = -1

    def squash(self, x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        z = alpha * x
        return z / (1 + z.abs())

    @staticmethod
    def grads(x: torch.Tensor, alpha: torch.Tensor):
        z = alpha * x
        d = 1 / (1 + z.abs()) ** 2
        return z / (1 + z.abs()), alpha * d, x * d  # f, df/dx, df/dalpha

    @staticmethod
    def analytic_shape_value(kind: str, size: int, input_scale: float) -> float:
        return slope_at_zero(kind, size, input_scale) / amplitude_for(kind, size)

'''

CONVERT = textwrap.dedent("""
    import contextlib, io, json, sys
    from pathlib import Path
    import torch
    import hf_normswap
    from hf_normswap import CalibrationConfig, kernels
    from hf_normswap.cli import main
    from hf_normswap.modules import ElementwiseNorm
    from tiny_models import tiny_model
    assert Path(hf_normswap.__file__).parent == Path(sys.argv[1]), hf_normswap.__file__
    torch.manual_seed(0)
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (8, 16))
    hf_normswap.convert(model, "softsign", calibration=CalibrationConfig(
        data=ids, num_blocks=8, block_len=16, batch_size=4, block_steps=2, tune_steps=2, progress=False))
    norms = [m for m in model.modules() if isinstance(m, ElementwiseNorm)]
    assert norms and {type(m).__name__ for m in norms} == {"Softsign"}
    x = 8 * torch.randn(kernels.MIN_NUMEL // norms[0].weight.numel() + 8, norms[0].weight.numel())
    fused = kernels.fused_forward(norms[0], x, norms[0].shape_parameter())
    assert fused is not None, "the fused path did not take the new method"
    torch.testing.assert_close(fused, norms[0].reference_forward(x, norms[0].shape_parameter()))
    for start in (None, CalibrationConfig(data=ids, num_blocks=8, block_len=16, tune_steps=2, progress=False)):
        masked_lm = tiny_model("bert")  # LayerNorms: the analytic start, and least squares then KL steps
        hf_normswap.convert(masked_lm, "softsign", calibration=start)
        with torch.no_grad():
            assert masked_lm(input_ids=ids[:2]).logits.isfinite().all()
    hf_normswap.save_pretrained(model, sys.argv[2])
    inputs = {"input_ids": ids[:2]}
    torch.save(inputs, Path(sys.argv[2]).parent / "inputs.pt")
    with torch.no_grad():
        logits = model(**inputs).logits
        reloaded = hf_normswap.load(sys.argv[2])(**inputs).logits
    torch.save(logits, Path(sys.argv[2]).parent / "logits.pt")
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
        main(["convert", "--help"])
    print(json.dumps({"finite": bool(logits.isfinite().all()), "reloaded": torch.equal(logits, reloaded),
                      "help": help_text.getvalue()}))
""")

def test_a_method_added_in_modules_py_alone_works_everywhere(tmp_path):
    copy, env = copy_package(tmp_path)
    modules = copy / "modules.py"
    text = modules.read_text()
    listed = "{cls.key: cls for cls in (ELN, DyT, Derf, Linear)}"
    assert text.count(listed) == 1, "modules.METHODS changed form: update this test's edit"
    head, _, tail = text.partition("\nMETHODS")
    modules.write_text(head + SOFTSIGN + "\nMETHODS" + tail.replace(listed, listed[:-2] + ", Softsign)}"))
    checkpoint = tmp_path / "converted"
    seen = json.loads(run_python(["-c", CONVERT, str(copy), str(checkpoint)], tmp_path, env).strip().splitlines()[-1])
    assert seen["finite"] and seen["reloaded"]
    assert "softsign" in seen["help"]  # --to offers it
    card = (checkpoint / "README.md").read_text()
    assert "y = weight * alpha * x / (1 + |alpha * x|) + bias" in card and "softsign_test_method" in card
    assert json.loads((checkpoint / "config.json").read_text())["normswap"]["method"] == "softsign"
    run_python(["-I", "-c", REMOTE, str(checkpoint), str(tmp_path / "inputs.pt"), str(tmp_path / "remote.pt")],
         tmp_path, env)
    assert torch.equal(torch.load(tmp_path / "remote.pt"), torch.load(tmp_path / "logits.pt"))

