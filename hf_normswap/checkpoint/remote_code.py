"""Self-contained remote code for a converted checkpoint: ``modeling_normswap.py``, generated from the package.

The file carries the package's own element-wise modules (the source of ``modules.py``, copied verbatim), the
reader of the record's converted norms (``record.NormEntry``, ``record.from_dict``, ``record.norm_entries``, copied
verbatim) and the function that puts them back in place (:func:`rebuild_norms`, copied verbatim), plus two small
classes written
for the checkpoint: a config subclass with its own ``model_type`` (so a stock ``from_pretrained`` without
``trust_remote_code`` refuses the checkpoint instead of silently loading the unconverted architecture) and a
subclass of the original architecture class whose ``__init__`` swaps the recorded norms for element-wise modules
before the weights load. It imports only torch and transformers: it works where hf_normswap is not installed.
Because the code is copied from the package when a checkpoint is saved, the two cannot drift apart;
:func:`check_remote_modules` runs the generated modules against the package's on the same input.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
import types

import torch
import transformers
from torch import nn

from .. import modules
from ..modules import METHODS, replace_module
from ..version import __version__
from . import record
from .config_checks import check_base
from .record import OriginalArchitecture, norm_entries

FILE_NAME = "modeling_normswap.py"
MODULE_NAME = FILE_NAME[: -len(".py")]
MODEL_TYPE_PREFIX = "normswap_"
ALLOWED_IMPORTS = {"math", "torch", "transformers", "typing", "__future__"}
RECORD_READER = (record.NormEntry, record.from_dict, record.norm_entries)  # copied into the file: it reads the block
RECORD_IMPORTS = "import dataclasses\nimport reprlib\nimport typing\nfrom dataclasses import dataclass"


class RemoteCodeError(RuntimeError):
    """The package's modules cannot be turned into self-contained remote code."""


def rebuild_norms(model: nn.Module, normswap: dict) -> nn.Module:
    """Replace every norm recorded in a config's ``normswap`` block with an empty element-wise module.

    Shapes, bias, per-channel shape parameter and amplitude come from the block's entries (``norm_entries``); the
    values come from the checkpoint's weights, which load after this. Used by the remote code and by
    ``hf_normswap.load``.
    """
    for name, entry in norm_entries(normswap).items():
        old = model.get_submodule(name)
        new = METHODS[entry.method](entry.shape, 1.0, per_channel=entry.per_channel, bias=entry.bias,
                                    amplitude=entry.amplitude, kind=entry.kind)
        reference = next(old.parameters(), None)
        if reference is not None:
            new.to(device=reference.device)
            for param in (new.weight, new.bias):
                if param is not None:
                    param.data = param.data.to(reference.dtype)
        replace_module(model, name, new)
    return model


def _modules_source() -> str:
    """modules.py without its docstring and ``__future__`` import; refuses imports other than torch / stdlib math."""
    source = inspect.getsource(modules)
    tree = ast.parse(source)
    lines = source.splitlines()
    kept: list[str] = []
    kept_def = False
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue  # module docstring
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if getattr(node, "level", 0) or any(n.split(".")[0] not in ALLOWED_IMPORTS for n in names):
                raise RemoteCodeError(
                    f"hf_normswap/modules.py line {node.lineno} imports {ast.unparse(node)!r}: remote code may import "
                    "only torch and transformers; keep what the modules need inside modules.py"
                )
        start = node.lineno - 1 - len(getattr(node, "decorator_list", []) or [])
        text = "\n".join(lines[start: node.end_lineno])
        is_def = isinstance(node, (ast.FunctionDef, ast.ClassDef))
        if kept:  # PEP 8 spacing: two blank lines around definitions, none between simple statements
            kept.append("\n\n\n" if is_def or kept_def else "\n")
        kept.append(text)
        kept_def = is_def
    return "".join(kept)


@functools.cache
def auto_classes(architecture: str, model_type: str) -> tuple[str, ...]:
    """Names of the transformers Auto classes that map ``model_type`` to ``architecture`` (AutoModel when none).

    Cached: listing transformers' lazy namespace takes most of a small model's save time."""
    found = []
    for name in sorted(dir(transformers)):
        if not name.startswith("AutoModel"):
            continue
        mapping = getattr(getattr(getattr(transformers, name), "_model_mapping", None), "_model_mapping", None)
        target = mapping.get(model_type) if isinstance(mapping, dict) else None
        if target == architecture or (isinstance(target, (tuple, list)) and architecture in target):
            found.append(name)
    return tuple(found) or ("AutoModel",)


def class_names(architecture: str) -> tuple[str, str]:
    """(config class name, model class name) in the generated file."""
    return "NormSwapConfig", f"NormSwap{architecture}"


def render(architecture: str, config_class: str, model_type: str) -> str:
    """Text of ``modeling_normswap.py`` for a checkpoint of ``architecture`` (e.g. LlamaForCausalLM).

    ``model_type`` is the original one (``llama``); the generated config class gets ``normswap_llama``. The three
    names come from a config.json: each must name what transformers exports, or nothing is generated.
    """
    check_base(OriginalArchitecture(architecture, config_class, model_type))
    config_name, model_name = class_names(architecture)
    header = f'''"""Remote code for a checkpoint converted by hf-normswap {__version__}: {architecture} with its norms replaced by
element-wise modules. Generated from the hf-normswap package; imports only torch and transformers.

Load with ``AutoModel...from_pretrained(path, trust_remote_code=True)``, or with ``hf_normswap.load(path)``.
"""

from __future__ import annotations

{RECORD_IMPORTS}

from transformers import {config_class}, {architecture}
'''
    classes = f'''
class {config_name}({config_class}):
    """{config_class} of the converted model; its own model_type keeps stock loaders from using the original class."""

    model_type = "{MODEL_TYPE_PREFIX}{model_type}"


class {model_name}({architecture}):
    """{architecture} whose recorded norms are element-wise modules (built in __init__, before weights load)."""

    config_class = {config_name}

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        rebuild_norms(self, config.normswap)
'''
    reader = [textwrap.dedent(inspect.getsource(part)) for part in RECORD_READER]
    parts = [header, _modules_source(), *reader, textwrap.dedent(inspect.getsource(rebuild_norms)),
             classes]
    text = "\n\n\n".join(p.strip("\n") for p in parts) + "\n"
    compile(text, FILE_NAME, "exec")
    return text


def check_remote_modules(text: str, seed: int = 0) -> None:
    """Run the generated file's modules against the package's on random input; raise unless bit-identical."""
    module = types.ModuleType("normswap_remote_check")  # a module, as transformers loads it: dataclasses look it up
    sys.modules[module.__name__] = module
    try:
        exec(compile(text, FILE_NAME, "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    namespace = module.__dict__
    generator = torch.Generator().manual_seed(seed)
    x = 30 * torch.randn(4, 6, generator=generator)
    for key, package_class in METHODS.items():
        remote_class = namespace["METHODS"][key]
        for per_channel, kind in ((False, "rmsnorm"), (True, "rmsnorm"), (True, "layernorm")):
            ours = package_class(6, 0.7, per_channel=per_channel, amplitude=2.0, kind=kind)
            theirs = remote_class(6, 0.7, per_channel=per_channel, amplitude=2.0, kind=kind)
            with torch.no_grad():
                for p in ours.parameters():
                    p.add_(0.1 * torch.randn(p.shape, generator=generator))
            theirs.load_state_dict(ours.state_dict())
            if not torch.equal(ours(x), theirs(x)):
                raise RemoteCodeError(f"generated {remote_class.__name__} differs from the package's {key} module")
