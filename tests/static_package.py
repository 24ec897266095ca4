"""The package read statically: its modules, what each imports, and a walk of one object through its calls.

``test_package.py`` checks the import graph and bounds the calibration config's walk from ``convert``;
``python tests/static_package.py [ROOT] [--fields]`` prints that walk, a line per call it follows.

The walk follows the config object (with ``fields``, its fields too: a function handed ``config.num_blocks``).

* Carriers: the start parameter; a copy of a carrier (``dataclasses.replace``, ``copy.copy``); what a package
  function or method returns when its annotation names the config's class (``config.resolved()``); a package
  object built from a carrier (``_Fitter(config, build)``, a dataclass with it as a field), and its attributes
  assigned from one (``self.config``). A name assigned a carrier anywhere in a function is one throughout it.
* A stop: a package function that a call passing a carrier, a method called on a carrier, or a call of a carrier
  (its ``__call__``) lands in, counted once however often it is reached. A class counts as its ``__init__`` or
  ``__post_init__``. A function's body is walked at its first call; a call back into a function on the stack is
  not followed.
* A return: each followed call into another file than the caller's (the walk comes back to a file it had left).
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass, field
from pathlib import Path

COPIES = {"replace", "copy", "deepcopy"}  # dataclasses.replace(config, ...), copy.copy(config)


@dataclass
class Module:
    path: Path
    tree: ast.Module
    functions: dict[str, ast.FunctionDef]
    classes: dict[str, dict[str, ast.FunctionDef]]
    fields: dict[str, list[str]]  # a class's annotated attributes, in order (a dataclass's fields)
    names: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # imported name -> (module, attribute)


@dataclass
class Walk:
    calls: list[str] = field(default_factory=list)  # every call it follows: "caller -> callee", indented by depth
    files: set[Path] = field(default_factory=set)  # the files of its stops
    returns: int = 0

    @property
    def stops(self) -> set[str]:
        """The functions it passes through, each once."""
        return {call.split(" -> ")[1] for call in self.calls}


class Package:
    """The modules of a package under ``root``, keyed by dotted name."""

    def __init__(self, root: Path, package: str):
        self.modules: dict[str, Module] = {}
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            tree = ast.parse(path.read_text())
            classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
            self.modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = Module(
                path, tree, functions={n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)},
                classes={c.name: {m.name: m for m in c.body if isinstance(m, ast.FunctionDef)} for c in classes},
                fields={c.name: [a.target.id for a in c.body if isinstance(a, ast.AnnAssign)] for c in classes})
        for name, module in self.modules.items():
            base = name.split(".") if module.path.name == "__init__.py" else name.split(".")[:-1]
            for node in ast.walk(module.tree):
                if not isinstance(node, ast.ImportFrom):
                    continue
                source = ".".join(base[:len(base) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    module.names[alias.asname or alias.name] = \
                        (full, None) if full in self.modules else (source, alias.name)

    def lookup(self, module: str, name: str, depth: int = 0) -> tuple[str, str] | None:
        """``(module, name)`` of the function or class that ``name`` means in ``module``, through re-exports."""
        found = self.modules.get(module)
        if found is None or depth > 5:
            return None
        if name in found.functions or name in found.classes:
            return module, name
        target = found.names.get(name)
        if target and target[1] is None and "." in target[0]:  # ``from .planning import recipe_settings``: the
            parent, _, attribute = target[0].rpartition(".")  # package's own name (a function it re-exports)
            return self.lookup(parent, attribute, depth + 1) if parent != module else None  # shadows its module
        return self.lookup(target[0], target[1], depth + 1) if target and target[1] else None

    def node(self, key: tuple[str, str]) -> ast.FunctionDef | None:
        """The function ``(module, "function")`` or method ``(module, "Class.method")``; None for a class."""
        module, qualified = key
        found = self.modules[module]
        if "." in qualified:
            cls, method = qualified.split(".")
            return found.classes[cls].get(method)
        return found.functions.get(qualified)

    def constructor(self, module: str, cls: str) -> tuple[str, str] | None:
        methods = self.modules[module].classes[cls]
        hook = "__init__" if "__init__" in methods else "__post_init__" if "__post_init__" in methods else None
        return (module, f"{cls}.{hook}") if hook else None


FIELD = ("", "a field")  # the class of a carrier that is a field of the config (the ``fields`` rule)


def walk(package: Package, start: tuple[str, str], parameter: str, config_class: tuple[str, str],
         fields: bool = False, entry: tuple[tuple[str, str], ...] = (),
         also: dict[str, tuple[str, str]] | None = None) -> Walk:
    """The stops and returns of the object passed as ``parameter`` to the function ``start`` (or, where ``start``
    makes the object itself, held by its name ``parameter`` there); with ``fields``, of its fields too
    (``config.data`` carries, and so does each attribute of a carrier that is a field). ``entry``: the calls that
    lead to ``start`` before the object exists (a verb's ``run``), each counted as a stop and, across files, a
    return. ``also``: other names of ``start`` that carry an object made from it (``run = resolve(config)``: the run
    holds the settings), each with its class; a call passing one is followed as a call passing the config, and a
    call whose annotation returns one of those classes returns a carrier (``self.run = resolve_run(config)``)."""
    result, stack, expanded = Walk(), [start], set()
    for depth, (caller, callee) in enumerate(zip(entry, (*entry[1:], start))):
        result.calls.append(f"{'  ' * depth}{caller[0]}.{caller[1]} -> {callee[0]}.{callee[1]}")
        result.files.add(package.modules[callee[0]].path)
        result.returns += package.modules[caller[0]].path != package.modules[callee[0]].path
    held: dict[tuple[str, str], dict[str, tuple[str, str]]] = {}  # a class -> its attributes holding a carrier
    resolved = {cls[1]: cls for cls in (also or {}).values()}  # what a call annotated as returning one returns

    def constructed(key) -> bool:
        return key[1].endswith((".__init__", ".__post_init__"))

    def method(owner, name):
        if owner == FIELD:
            return None
        return (owner[0], f"{owner[1]}.{name}") if name in package.modules[owner[0]].classes[owner[1]] else None

    def function(found):
        if found is None or found[1] not in package.modules[found[0]].classes:
            return found
        return package.constructor(*found) or found  # a class without either hook: no body to walk

    def visit(key: tuple[str, str], carried: dict[str, tuple[str, str]]) -> None:
        """Walk a function whose names in ``carried`` hold a carrier (of the class they map to)."""
        module, qualified = key
        node, here = package.node(key), package.modules[module]
        cls = qualified.split(".")[0] if "." in qualified else None
        carried = dict(carried)

        def resolve(func) -> tuple[str, str] | None:
            owner = carrier(func)
            if owner not in (None, FIELD):
                return method(owner, "__call__")
            if isinstance(func, ast.Name):
                return function(package.lookup(module, func.id))
            if not isinstance(func, ast.Attribute):
                return None
            owner = carrier(func.value)
            if owner is not None:
                return method(owner, func.attr)
            if isinstance(func.value, ast.Name) and func.value.id == "self" and cls:
                return method((module, cls), func.attr)
            if isinstance(func.value, ast.Name):
                target = here.names.get(func.value.id)
                if target and target[1] is None:  # module.function
                    return function(package.lookup(target[0], func.attr))
                found = package.lookup(module, func.value.id)
                if found and found[1] in package.modules[found[0]].classes:  # Class.method
                    return method(found, func.attr)
            return None

        def carrier(expr) -> tuple[str, str] | None:
            """The class of the carrier that ``expr`` evaluates to, or None."""
            if isinstance(expr, ast.Name):
                return carried.get(expr.id)
            if isinstance(expr, ast.Attribute):
                owner = carrier(expr.value)
                if fields and owner in (config_class, FIELD):
                    return FIELD
                return held.get(owner, {}).get(expr.attr) if owner else None
            if isinstance(expr, ast.IfExp):
                return carrier(expr.body) or carrier(expr.orelse)
            if isinstance(expr, ast.BoolOp):
                return next(filter(None, map(carrier, expr.values)), None)
            if not isinstance(expr, ast.Call):
                return None
            if isinstance(expr.func, ast.Attribute) and expr.func.attr in COPIES and expr.args:
                return carrier(expr.args[0])
            callee = resolve(expr.func)
            if callee is None:
                return None
            callee_node = package.node(callee)
            returns = ast.unparse(callee_node.returns).strip("'\"") if callee_node and callee_node.returns else ""
            if returns == config_class[1]:
                return config_class
            if returns in resolved:  # ``run = resolve_run(config)``: the run holds the settings
                return resolved[returns]
            built = callee if callee[1] in package.modules[callee[0]].classes else \
                (callee[0], callee[1].split(".")[0]) if constructed(callee) else None
            if built is None:
                return None
            declared = package.modules[built[0]].fields[built[1]]
            given = [(f, carrier(a)) for f, a in zip(declared, expr.args)] + \
                [(k.arg, carrier(k.value)) for k in expr.keywords if k.arg in declared]
            if built != config_class:  # a config holds no config: ``CalibrationConfig(data=ids)`` in as_config
                held.setdefault(built, {}).update({f: found for f, found in given if found})
            return built if passes(expr) else None

        def passes(call) -> bool:
            return any(carrier(a) for a in call.args) or any(carrier(k.value) for k in call.keywords)

        def bind(target, value) -> None:
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
                for t, v in zip(target.elts, value.elts):
                    bind(t, v)
                return
            found = carrier(value)
            if found is None:
                return
            if isinstance(target, ast.Name):
                carried[target.id] = found
            elif isinstance(target, ast.Attribute) and carrier(target.value):  # self.config = config
                held.setdefault(carrier(target.value), {})[target.attr] = found

        def arguments(callee, call, receiver) -> dict[str, tuple[str, str]]:
            """The callee's names that receive a carrier: its parameters, and ``self`` when it is one."""
            args = package.node(callee).args
            params = [a.arg for a in args.posonlyargs + args.args]
            is_method = "." in callee[1] and params[:1] == ["self"]
            names = {p: found for p, a in zip(params[1:] if is_method else params, call.args) if (found := carrier(a))}
            names.update({k.arg: found for k in call.keywords if k.arg and (found := carrier(k.value))})
            if is_method and receiver is not None:
                names["self"] = receiver
            elif is_method and constructed(callee):
                names["self"] = (callee[0], callee[1].split(".")[0])  # the object being built holds the carrier
            return names

        body = list(ast.walk(node))
        for _ in range(2):  # a name assigned late in a loop carries on its first lines too
            for n in body:
                if isinstance(n, ast.Assign):
                    for t in n.targets:
                        bind(t, n.value)
                elif isinstance(n, ast.AnnAssign) and n.value is not None:
                    bind(n.target, n.value)
        for call in sorted((n for n in body if isinstance(n, ast.Call)), key=lambda c: (c.lineno, c.col_offset)):
            receiver = carrier(call.func.value if isinstance(call.func, ast.Attribute) else call.func)
            if receiver is None and not passes(call):
                continue
            callee = resolve(call.func)
            if callee is None or callee in stack or package.node(callee) is None:
                continue
            result.calls.append(f"{'  ' * (len(stack) - 1)}{module}.{qualified} -> {callee[0]}.{callee[1]}")
            if callee not in expanded:
                expanded.add(callee)
                stack.append(callee)
                visit(callee, arguments(callee, call, receiver))
                stack.pop()
            result.files.add(package.modules[callee[0]].path)
            if package.modules[callee[0]].path != here.path:
                result.returns += 1

    visit(start, {parameter: config_class, **(also or {})})
    return result


def calibration_walk(root: Path, fields: bool = False) -> Walk:
    """The calibration config's walk, from ``convert``'s ``calibration`` to the last fitted block."""
    return walk(Package(root, "hf_normswap"), ("hf_normswap.surgery", "convert"), "calibration",
                ("hf_normswap.calibration.calibrate", "CalibrationConfig"), fields=fields)


# where the settings are read and the recipe object is built from them: ``RecoveryRecipe(load_config(argv))``
RECOVERY_START = ("hf_normswap.training.recipe", "main")
RECOVERY_CLASS = ("hf_normswap.training.config", "RecipeConfig")
RESOLVED = {"run": ("hf_normswap.training.recovery_run", "RecoveryRun")}  # the run resolved from the settings


def recovery_walk(root: Path, fields: bool = False) -> Walk:
    """The recovery settings' walk, from ``normswap recover`` (``cli/recover.py:run``) through the recipe's
    ``main``, where the settings object is read, to the Trainer and the save: the settings, the run resolved from
    them (which holds them) and the recipe object holding both (each of its methods a stop) are followed alike."""
    return walk(Package(root, "hf_normswap"), RECOVERY_START, "config", RECOVERY_CLASS, fields=fields,
                entry=(("hf_normswap.cli.recover", "run"),), also=RESOLVED)


WALKS = {"calibration": calibration_walk, "recovery": recovery_walk}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="A config object's walk (calibration from convert, or the recovery "
                                                 "settings from `normswap recover`), a line per call.")
    parser.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the folder holding hf_normswap/ (default: this checkout)")
    parser.add_argument("--fields", action="store_true", help="follow the config's fields too")
    parser.add_argument("--object", choices=sorted(WALKS), default="calibration", help="which walk (default: calibration)")
    args = parser.parse_args()
    found = WALKS[args.object](args.root, fields=args.fields)
    print("\n".join(found.calls))
    print(f"{len(found.stops)} stops ({len(found.calls)} calls) in {len(found.files)} files, {found.returns} returns")
