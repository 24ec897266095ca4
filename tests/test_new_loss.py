"""A loss term and a hand-over are one file each: a copy of the package that gains ``training/loss_terms/X.py``
and ``training/hand_overs/Y.py`` alone recovers a tiny model with both (``distill.terms.KEY``, ``hand_over.kind``),
logs the term, draws it on the curve, writes both on the model card, and plans the term's memory."""

from __future__ import annotations

import json
import textwrap

import pytest

from package_copy import TESTS, copy_package, run_python

LAST_SCALE = '''
"""A loss term that only this test's copy of the package has: the first block's output log scale toward 0."""

import torch

from .base import LossTerm, Step, register


@register
class LastScale(LossTerm):
    key = "last_scale"
    logged = {"last_scale_loss": "first block scale (a test term)"}
    hidden_states = True

    @classmethod
    def memory(cls, sizes, tokens, value_bytes, seq_len):
        return {"last scale buffer (a test term)": tokens * sizes.hidden * value_bytes}

    def value(self, step: Step) -> torch.Tensor:
        first = step.outputs.hidden_states[1].float()
        return (0.5 * torch.log(first.pow(2).mean(dim=-1))).pow(2).mean()

    def describe(self) -> str:
        return f"the first block's output log scale toward 0 (weight {self.weight:.4g})"
'''

AT_ONCE = '''
"""A hand-over that only this test's copy of the package has: every norm swapped in at one step."""

from .base import HandOver, register
from .blend import Stage


@register
class AtOnce(HandOver):
    key = "at_once"
    fits_before_training = True

    def check(self):
        at = self.options.get("at", 1)
        return None if isinstance(at, int) and at >= 0 else f"hand_over.options.at must be a step, got {at!r}"

    def stages(self, roles, steps):
        return [Stage(self.options.get("at", 1), 0, list(roles))]

    def describe(self, callback):
        return f"Every norm was swapped in at step {callback.end} (a test hand-over)."
'''

RECOVER = textwrap.dedent("""
    import json, random, sys, types
    from pathlib import Path
    sys.path.insert(0, sys.argv[3])  # the recipe tests' tiny tokenizer and settings
    import matplotlib.figure
    import torch
    import hf_normswap
    from hf_normswap.planning import plan, run_plan_settings
    from hf_normswap.training import recipe
    from hf_normswap.training.config import read_recipe_config
    from hf_normswap.validation import ValidationError
    from test_finetune_recipe import WORDS, tiny_tokenizer, write_config
    from tiny_models import tiny_model
    assert Path(hf_normswap.__file__).parent == Path(sys.argv[1]), hf_normswap.__file__
    root = Path(sys.argv[2])
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20))) + " ." for _ in range(400)]
    (root / "train.txt").write_text("\\n".join(lines[:300]))
    (root / "eval.txt").write_text("\\n".join(lines[300:]))
    model_dir = root / "tiny-llama"
    torch.manual_seed(0)
    tiny_model("llama").save_pretrained(model_dir)
    tiny_tokenizer(model_dir, "\\n".join(lines))
    extra = dict(progressive={"enabled": False}, hand_over={"kind": "at_once", "options": {"at": 2}},
                 distill={"weight": 0.5, "temperature": 1.0, "terms": {"last_scale": 2.0}})
    config_path = write_config(root, model_dir, root / "run", **extra)
    drawn = []  # the curve's legend
    savefig = matplotlib.figure.Figure.savefig
    def legend_and_save(figure, *args, **kwargs):
        drawn.extend(t.get_text() for axes in figure.axes if axes.get_legend() for t in axes.get_legend().get_texts())
        return savefig(figure, *args, **kwargs)
    matplotlib.figure.Figure.savefig = legend_and_save
    refused = []
    for bad in ("hand_over.options.at=-1", "distill.terms.last_scale={weight: 1, depth: 2}", "taper.fraction=0.5",
                "distill.terms.last_scale=abc"):
        try:
            read_recipe_config(str(config_path), [bad])
        except ValidationError as error:
            refused.append(str(error))
    recipe.main(["--config", str(config_path)])
    config = read_recipe_config(str(config_path), [])
    run = types.SimpleNamespace(settings=config, processes=1, sharded=False, load_once=False, batch_size=2,
                                calibrates=True, calibration=config.calibration)
    steps = [p for p in plan(str(model_dir), run_plan_settings(run)).phases if p.name == "training step"]
    print(json.dumps({"summary": json.loads((root / "run" / "summary.json").read_text()),
                      "card": (root / "run" / "final" / "README.md").read_text(),
                      "planned": steps[0].main, "refused": refused, "drawn": drawn}))
""")


def test_a_loss_term_and_a_hand_over_added_as_one_file_each_train_show_and_are_planned(tmp_path):
    copy, env = copy_package(tmp_path)
    (copy / "training" / "loss_terms" / "last_scale.py").write_text(LAST_SCALE)
    (copy / "training" / "hand_overs" / "at_once.py").write_text(AT_ONCE)
    seen = json.loads(run_python(["-c", RECOVER, str(copy), str(tmp_path), str(TESTS / "training")], tmp_path,
                                 env).strip().splitlines()[-1])
    history = [h for h in seen["summary"]["history"] if "loss" in h]
    assert len(history) == 4 and all(h["last_scale_loss"] > 0.1 for h in history)  # logged each step
    for h in history:  # and trained: (1 - w) * CE + w * KD + (w * 2) * the new term
        assert h["loss"] == pytest.approx(0.5 * h["ce_loss"] + 0.5 * h["kd_loss"] + h["last_scale_loss"], rel=1e-3)
    assert "first block scale (a test term)" in seen["drawn"]
    assert [h["converted_fraction"] for h in history] == [0.0, 0.0, 1.0, 1.0]  # every norm in from step 2
    training = seen["summary"]["training"]
    assert training["loss"][-1] == "the first block's output log scale toward 0 (weight 2)"
    assert "the first block's output log scale toward 0 (weight 2)" in seen["card"]
    assert "Every norm was swapped in at step 2 (a test hand-over)." in seen["card"]
    tokens = 2 * 32  # a step's rows times block_len
    assert seen["planned"]["last scale buffer (a test term)"] == tokens * 32 * 4  # tiny_models: hidden 32, fp32
    assert "hand_over.options.at must be a step, got -1" in seen["refused"][0]
    assert "distill.terms.last_scale takes no options, got depth" in seen["refused"][1]
    assert "hand_over.kind=at_once and taper.fraction both hand the norms over" in seen["refused"][2]
    assert "distill.terms.last_scale must be a weight, or {weight: W, OPTION: VALUE}, got 'abc'" in seen["refused"][3]
