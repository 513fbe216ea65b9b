"""Every import in ``src/tigon`` points down the layer order, read from the source with `ast`.

Each module belongs to a unit: ``tigon.<first name under tigon>`` (``tigon.patch.lora`` is in
``tigon.patch``), or ``tigon`` itself for the package's ``__init__``. The units stand on floors:

0. ``tigon.ops`` (the Triton kernels), ``tigon.timing`` and ``tigon.cuda_graphs`` (torch utilities),
   ``tigon.security`` (who may reach a server: the standard library alone);
1. ``tigon.functional``, ``tigon.nn``: the ops as functions and modules;
2. ``tigon.patch``: Hugging Face models onto the ops;
3. ``tigon``: the package's public names (``tigon.patch``, ``tigon.AutoModelForCausalLM``, ...);
4. ``tigon.train``, ``tigon.serve``, ``tigon.bench``, ``tigon.webui``: the applications;
5. ``tigon.cli``: the ``tigon`` command.

A module may import any unit on a lower floor and its own unit. Of the same floor, only the
edges in :data:`SAME_FLOOR` are allowed, each one way: ``tigon.nn``'s modules are built on
``tigon.functional``; serving, the benchmarks and the web UI load models, tokenizers, chat
templates and data the way training does (``tigon.train.modeling``, ``template``, ``data``,
``tiny``) rather than keeping copies.

Floors 0 and 1 import nothing outside tigon but torch, triton and the standard library: the
kernels and the functions and modules over them run without transformers; what reads
transformers' classes (its experts modules, its activation classes) lives in ``tigon.patch``.

Imports inside functions count as much as those at the top of a module: a lazy import is an
edge all the same.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

FLOORS: list[set[str]] = [
    {"tigon.ops", "tigon.timing", "tigon.cuda_graphs", "tigon.security"},
    {"tigon.functional", "tigon.nn"},
    {"tigon.patch"},
    {"tigon"},
    {"tigon.train", "tigon.serve", "tigon.bench", "tigon.webui"},
    {"tigon.cli"},
]

# (importer, imported) pairs of the same floor that are allowed.
SAME_FLOOR = {
    ("tigon.nn", "tigon.functional"),
    ("tigon.serve", "tigon.train"),
    ("tigon.bench", "tigon.train"),
    ("tigon.webui", "tigon.train"),
}

# Units that import no third-party package but these (the standard library aside).
TORCH_ONLY = {"tigon.ops", "tigon.timing", "tigon.cuda_graphs", "tigon.security", "tigon.functional", "tigon.nn"}
TORCH_ONLY_ALLOWED = {"torch", "triton"}


def _floor(unit: str) -> int | None:
    return next((i for i, units in enumerate(FLOORS) if unit in units), None)


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str | None:
    """The unit of a tigon module name, None for a name outside tigon."""
    parts = module.split(".")
    if parts[0] != "tigon":
        return None
    return ".".join(parts[:2])


def _is_module(name: str) -> bool:
    path = SRC.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_names(source: str, module: str, is_package: bool) -> list[tuple[int, str, str]]:
    """``(line, module imported, the statement)`` for every import in `source`, at any depth.
    ``from pkg import name`` imports ``pkg.name`` when that is a module of tigon (``from tigon
    import functional`` reaches ``tigon.functional``, not the package's ``__init__``)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, ast.unparse(node)) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if _unit(base) is not None and _is_module(sub) else base
                found.append((node.lineno, target, ast.unparse(node)))
    return found


def _sources():
    for path in sorted((SRC / "tigon").rglob("*.py")):
        yield path, _module_name(path), path.name == "__init__.py"


def upward_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """Each import in `source` (of `module`) that the layer order forbids, as a readable line."""
    unit = _unit(module)
    bad = []
    for line, target, statement in imported_names(source, module, is_package):
        target_unit = _unit(target)
        if target_unit is None or target_unit == unit:
            continue
        here, there = _floor(unit), _floor(target_unit)
        if here is None or there is None:
            bad.append(f"line {line}: `{statement}`: {unit} or {target_unit} has no floor in FLOORS")
        elif there > here or (there == here and (unit, target_unit) not in SAME_FLOOR):
            bad.append(f"line {line}: `{statement}`: {unit} (floor {here}) imports {target_unit} (floor {there})")
    return bad


def test_every_module_is_on_a_floor():
    placed = set().union(*FLOORS)
    unplaced = sorted({_unit(module) for _, module, _ in _sources()} - placed)
    assert not unplaced, f"units with no floor in tests/test_layers.py's FLOORS: {unplaced}"


def test_every_import_points_down_the_layer_order():
    bad = [
        f"{path.relative_to(SRC.parent)}: {line}"
        for path, module, is_package in _sources()
        for line in upward_imports(path.read_text(), module, is_package)
    ]
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_the_lowest_floors_import_only_torch_triton_and_the_standard_library():
    allowed = TORCH_ONLY_ALLOWED | set(sys.stdlib_module_names)
    bad = [
        f"{path.relative_to(SRC.parent)}: line {line}: `{statement}`"
        for path, module, is_package in _sources()
        if _unit(module) in TORCH_ONLY
        for line, target, statement in imported_names(path.read_text(), module, is_package)
        if _unit(target) is None and target.split(".")[0] not in allowed
    ]
    assert not bad, "third-party imports below tigon.patch:\n" + "\n".join(bad)


def test_an_upward_import_inside_a_function_is_caught():
    source = "from tigon import functional as F\n\ndef f():\n    from tigon.train import tiny\n"
    assert upward_imports(source, "tigon.nn.mlp") == [
        "line 4: `from tigon.train import tiny`: tigon.nn (floor 1) imports tigon.train (floor 4)"
    ]
    assert upward_imports("from . import loading\nfrom .. import cli\n", "tigon.serve", is_package=True) == [
        "line 2: `from .. import cli`: tigon.serve (floor 4) imports tigon.cli (floor 5)"
    ]
