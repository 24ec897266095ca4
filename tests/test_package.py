"""The package's shape: imports run one way along the layers (import-linter's contracts in pyproject.toml), with no
cycle, the docs list the same layers, the calibration config stays in two stages, and importing the package changes
nothing."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import subprocess
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter brings tomli
    import tomli as tomllib
from pathlib import Path

import hf_normswap
from static_package import Package, calibration_walk, recovery_walk, walk

PACKAGE = Path(hf_normswap.__file__).parent

PYPROJECT = PACKAGE.parent / "pyproject.toml"
SCRIPTS = PACKAGE.parent / "scripts"


def layers() -> list[str]:
    """The layers of pyproject.toml's import-linter contract, top first (siblings joined by " | ")."""
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    return next(c["layers"] for c in contracts if c["type"] == "layers")


def test_imports_follow_the_layers_without_cycles(tmp_path):
    """import-linter's contracts (pyproject.toml): each module imports only the layers below its own (imports
    inside functions count), every module is in a layer, and no package's modules import each other in a circle."""
    from importlinter.cli import lint_imports

    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        code = lint_imports(config_filename=str(PYPROJECT), cache_dir=str(tmp_path), no_logo=True)
    assert code == 0, output.getvalue()[-3000:]


def test_the_docstring_and_the_readme_list_the_same_layers():
    """One list of the layers (pyproject.toml); the package docstring lists them bottom first, one a line, and
    README.md's code map in one paragraph, bottom first."""
    expected = [layer.split(" | ") for layer in reversed(layers())]
    listed = re.findall(r"^    ([a-z_]+(?: \| [a-z_]+)*)  ", hf_normswap.__doc__, re.MULTILINE)
    assert [line.split(" | ") for line in listed] == expected
    readme = (PACKAGE.parent / "README.md").read_text()
    line = re.search(r"Layers, bottom first \(each imports only those before it\): (.+?)\.\n", readme, re.DOTALL).group(1)
    assert [item.strip(" `").split("|") for item in " ".join(line.split()).split(", ")] == expected


def test_the_calibration_config_stays_in_surgery_and_calibration():
    """The config object, from ``convert`` to the last fitted block: the data, precision and placement stages get
    plain values from it (its data spec, its precision), never the object."""
    found = calibration_walk(PACKAGE.parent)
    assert {stop.split(".")[1] for stop in found.stops} == {"surgery", "calibration"}, "\n".join(found.calls)
    assert len(found.stops) <= 20 and found.returns <= 8, "\n".join(found.calls)


RECOVERY_WALK_BEFORE = (30, 19)  # stops, returns of the recovery settings' walk on d961173 (the object rule)


def test_the_recovery_settings_walk_from_the_verb_to_the_trainer():
    """The recipe's settings object and the run resolved from it, from ``normswap recover`` to the Trainer and the
    save: at most half the stops and half the returns before the run was resolved once. The data, the context
    checks, the trainable choice and the precision get plain values from the run (its ``text``, its ``context``),
    never the settings."""
    found = recovery_walk(PACKAGE.parent)
    assert found.calls[0] == "hf_normswap.cli.recover.run -> hf_normswap.training.recipe.main"
    assert len(found.stops) <= RECOVERY_WALK_BEFORE[0] / 2 and found.returns <= RECOVERY_WALK_BEFORE[1] / 2, \
        "\n".join(found.calls)


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


def test_no_file_above_450_lines():
    """One concept a file: the package, the recipes and the scripts stay at or below 450 lines a file."""
    long = [f"{path.relative_to(PACKAGE.parent)}: {n}" for folder in ("hf_normswap", "recipes", "scripts")
            for path in sorted((PACKAGE.parent / folder).rglob("*")) if path.suffix in (".py", ".sh")
            for n in [len(path.read_text().splitlines())] if n > 450]
    assert not long, long


def unexplained_internal_imports(path: Path, public: set[str]) -> list[int]:
    """The lines of ``path``'s imports of the package beyond its public names that give no reason: a comment saying
    ``internal`` on the statement or among the comments and package imports just above it."""
    lines = path.read_text().splitlines()
    found = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, ast.ImportFrom) and node.module == "hf_normswap":
            internal = not {alias.name for alias in node.names} <= public
        elif isinstance(node, ast.ImportFrom):
            internal = (node.module or "").startswith("hf_normswap.")
        elif isinstance(node, ast.Import):
            internal = any(alias.name.startswith("hf_normswap.") for alias in node.names)
        else:
            continue
        start = node.lineno - 1
        while start and lines[start - 1].lstrip().startswith(("#", "from hf_normswap", "import hf_normswap")):
            start -= 1
        if internal and not any(re.search(r"#.*\binternal\b", line) for line in lines[start:node.end_lineno]):
            found.append(node.lineno)
    return found


def test_scripts_import_the_public_names_or_say_why():
    """The scripts are programs run by path, not a package, so import-linter's graph (importable packages) does not
    reach them: this holds them instead. A script imports ``hf_normswap``'s public names (``__all__``); where it
    measures or reuses something inside (a kernel, the recipe's phases, the reader of --data), the import says why."""
    public = set(hf_normswap.__all__)
    found = [f"{path.relative_to(SCRIPTS.parent)}:{line}" for path in sorted(SCRIPTS.rglob("*.py"))
             for line in unexplained_internal_imports(path, public)]
    assert not found, found


# Triton kernels take every pointer, stride and block size as a parameter of their own: a kernel cannot take a
# struct, so their parameter lists are as long as the tensors they read.
LONG_SIGNATURES = {("hf_normswap/triton_kernels.py", "_forward_kernel"), ("hf_normswap/triton_kernels.py",
                                                                        "_backward_kernel")}


def test_functions_keep_to_80_lines_and_8_parameters():
    """The house's limits in the package and the scripts: no function above 80 lines, no parameter list above 8.
    Every parameter counts, ``self`` and ``cls`` too (a method has 7 besides its object), ``*args`` and ``**kwargs``
    one each; the only exemptions are the Triton kernels of ``LONG_SIGNATURES``, with the reason there."""
    over, exempt = [], set()
    for path in sorted([*PACKAGE.rglob("*.py"), *SCRIPTS.rglob("*.py")]):
        where = path.relative_to(PACKAGE.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                count = len([*args.posonlyargs, *args.args, *args.kwonlyargs, *filter(None, (args.vararg, args.kwarg))])
                lines = node.end_lineno - node.lineno + 1
                if (where, node.name) in LONG_SIGNATURES and lines <= 80:
                    exempt.add((where, node.name))
                elif lines > 80 or count > 8:
                    over.append(f"{where}:{node.lineno} {node.name}: {lines} lines, {count} parameters")
    assert not over, over
    assert exempt == LONG_SIGNATURES  # an exemption whose function is gone or renamed goes too
