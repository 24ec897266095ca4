"""The package's shape: imports run one way along the pipeline, with no cycle, the calibration config stays in two
stages, and importing the package changes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import hf_normswap
from static_package import Package, calibration_walk, walk

PACKAGE = Path(hf_normswap.__file__).parent

# The pipeline, bottom to top: a module may import its own stage (its subpackage) and the stages below it.
STAGES = [
    ("version", "modules", "hub_mirror"),
    ("triton_kernels",),
    ("offload",),
    ("kernels", "placement", "precision", "validation"),
    ("model_inputs",),
    ("settings",),
    ("data",),
    ("discovery",),
    ("checkpoint",),
    ("calibration",),
    ("planning",),
    ("convert", "fold"),
    ("evaluation",),
    ("training",),
    ("cli",),
]
RANK = {name: rank for rank, names in enumerate(STAGES) for name in names}


def package_imports() -> dict[str, set[str]]:
    """Every module of the package (dotted, without ``hf_normswap.``) -> the package modules it imports anywhere
    in its body, at the top or inside functions."""
    modules = Package(PACKAGE.parent, "hf_normswap").modules
    short = {name: name.partition(".")[2] for name in modules}
    return {short[name]: {short[t] for t in module.imported if t != name and short[t]}
            for name, module in modules.items()}


def test_every_module_has_a_stage():
    for name in package_imports():
        assert not name or name.split(".")[0] in RANK, f"hf_normswap.{name} belongs to no stage of STAGES"


def test_imports_run_from_earlier_stages_to_later_ones():
    wrong = []
    for name, targets in package_imports().items():
        if not name:  # the package's __init__: the public API, above every stage
            continue
        stage = name.split(".")[0]
        for target in targets:
            other = target.split(".")[0]
            if other != stage and RANK[other] >= RANK[stage]:
                wrong.append(f"{name} -> {target}")
    assert not wrong, wrong


def test_no_import_cycle():
    graph = package_imports()
    done, cycles = set(), []

    def visit(node, path):
        if node in path:
            cycles.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        for target in graph.get(node, ()):
            visit(target, path + [node])
        done.add(node)

    for node in graph:
        visit(node, [])
    assert not cycles, cycles


def test_the_calibration_config_stays_in_convert_and_calibration():
    """The config object, from ``convert`` to the last fitted block: the data, precision and placement stages get
    plain values from it (its data spec, its precision), never the object."""
    found = calibration_walk(PACKAGE.parent)
    assert {stop.split(".")[1] for stop in found.stops} == {"convert", "calibration"}, "\n".join(found.calls)
    assert len(found.stops) <= 20 and found.returns <= 8, "\n".join(found.calls)


WALKED = {
    "pkg/__init__.py": "",
    "pkg/config.py": """
from dataclasses import dataclass
@dataclass
class Config:
    size: int = 1
    def resolved(self) -> "Config":
        return Config(self.size)
    def summary(self) -> dict:
        return {"size": self.size}
""",
    "pkg/helpers.py": """
def scale(x, config):
    return x * config.size
def same(module):
    return module
def count(n):
    return n
""",
    "pkg/work.py": """
import dataclasses
from . import helpers
from .config import Config
class Holder:
    def __init__(self, config, build):
        self.config, self.build = config, build
    def __call__(self, x):
        made = self.build(x)
        helpers.same(made)
        return helpers.scale(x, self.config)
def run(config: Config, build):
    config = config.resolved()
    holder = Holder(dataclasses.replace(config, size=2), build)
    holder(1)
    helpers.count(config.size)
    return config.summary()
""",
}


def test_the_walk_follows_the_object_and_with_fields_its_fields(tmp_path):
    for name, text in WALKED.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    package = Package(tmp_path, "pkg")
    found = walk(package, ("pkg.work", "run"), "config", ("pkg.config", "Config"))
    # the object: its methods, the holder built from its copy, and a function handed the holder's attribute; not
    # what the holder's other attribute builds (helpers.same), nor a function handed a field (helpers.count)
    assert found.stops == {"pkg.config.Config.resolved", "pkg.work.Holder.__init__", "pkg.work.Holder.__call__",
                           "pkg.helpers.scale", "pkg.config.Config.summary"}
    assert found.returns == 3  # from config.py twice, and from helpers.py
    with_fields = walk(package, ("pkg.work", "run"), "config", ("pkg.config", "Config"), fields=True)
    assert with_fields.stops == found.stops | {"pkg.helpers.count"} and with_fields.returns == 4
    assert package.modules["pkg.work"].imported == {"pkg.helpers", "pkg.config"}


def test_the_public_api_is_what_all_names():
    assert set(hf_normswap.__all__) >= {"convert", "inspect", "load", "save_pretrained", "evaluate",
                                        "ConvertConfig", "CalibrationConfig", "DyT", "ELN", "ElementwiseNorm",
                                        "ConversionError", "CheckpointError", "ValidationError"}
    assert all(hasattr(hf_normswap, name) for name in hf_normswap.__all__)


IMPORT_CHECK = """
import json, logging, os, sys, warnings
import torch, accelerate, huggingface_hub, safetensors, tqdm, yaml  # what the package builds on
from transformers import PreTrainedModel, Trainer  # transformers' lazy modules set their own environment
loaded = set(sys.modules)
before = {"env": dict(os.environ), "filters": len(warnings.filters), "handlers": len(logging.getLogger().handlers),
          "threads": torch.get_num_threads(), "dtype": str(torch.get_default_dtype()), "cwd": sorted(os.listdir())}
import hf_normswap, hf_normswap.cli
after = {"env": dict(os.environ), "filters": len(warnings.filters), "handlers": len(logging.getLogger().handlers),
         "threads": torch.get_num_threads(), "dtype": str(torch.get_default_dtype()), "cwd": sorted(os.listdir())}
print(json.dumps({"same": before == after, "diff": sorted(k for k in before if before[k] != after[k]) + sorted(k for k in after["env"] if after["env"].get(k) != before["env"].get(k)), "fast_forward": repr(hf_normswap.ElementwiseNorm.fast_forward),
                  "heavy": sorted(m for m in ("matplotlib", "datasets", "peft", "lm_eval") if m in set(sys.modules) - loaded)}))
"""


def test_importing_the_package_has_no_side_effects(tmp_path):
    result = subprocess.run([sys.executable, "-c", IMPORT_CHECK], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == {"same": True, "diff": [], "fast_forward": "None", "heavy": []}


def test_convert_installs_the_fused_path(tmp_path):
    script = ("import hf_normswap, sys; sys.path.insert(0, sys.argv[1]); from tiny_models import tiny_model\n"
              "hf_normswap.convert(tiny_model('llama'), 'eln')\n"
              "print(hf_normswap.ElementwiseNorm.fast_forward.__name__)")
    result = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["fused_forward"]
