"""The package's shape: imports run one way along the pipeline, with no cycle, and importing it changes nothing."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import hf_normswap

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


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(dotted: str) -> bool:
    target = PACKAGE.joinpath(*dotted.split("."))
    return target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()


def package_imports() -> dict[str, set[str]]:
    """Every module of the package (dotted, without ``hf_normswap.``) -> the package modules it imports anywhere
    in its body, at the top or inside functions."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        package = [p for p in package if p]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                elif node.module and node.module.split(".")[0] == "hf_normswap":
                    base = []
                    node = ast.ImportFrom(module=node.module.partition(".")[2] or None, names=node.names, level=0)
                else:
                    continue
                module = base + (node.module.split(".") if node.module else [])
                for alias in node.names:
                    child = ".".join(module + [alias.name])
                    targets.add(child if _exists(child) else ".".join(module))
            elif isinstance(node, ast.Import):
                targets |= {a.name.partition(".")[2] for a in node.names if a.name.startswith("hf_normswap.")}
        graph[name] = {t for t in targets if t and t != name}
    return graph


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
