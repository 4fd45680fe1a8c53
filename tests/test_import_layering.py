"""Imports go one way down the pipeline: no package-level import cycle, no private name imported across packages.

Every module of ``fusegraph/``, ``codegen/`` (installed as ``fusegraph.codegen``) and ``patterns/``
(``fusegraph.patterns``) is parsed with :mod:`ast`; every import counts, at module level and inside functions
alike (a function-level import hides a cycle from Python, not from this test). A *package* is the first name
under ``fusegraph`` (``fusegraph.matching.regions`` -> ``matching``; a top-level module such as
``fusegraph.pipeline`` is its own package). Failures name the offending edge and each importing file:line.
"""
from __future__ import annotations

import ast
import functools
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> its installed package name (setup.py maps codegen/ and patterns/ under fusegraph)
TREES = {"fusegraph": "fusegraph", "codegen": "fusegraph.codegen", "patterns": "fusegraph.patterns"}
#: the root package: ``fusegraph/__init__.py`` is the lazy public facade (``fusegraph.capture_step``...), it
#: imports nothing itself; the one name other packages take from it is the version
FACADE = "fusegraph"
FACADE_NAMES = {"__version__"}

#: the layering (docs/architecture.md, "Layers"), lowest first: a package imports only from its own layer or a
#: lower one (and the graph has no cycle, which orders packages within a layer)
LAYERS: list[set[str]] = [
    {"settings", "warnings", "nkiapi", "securefiles"},
    {"program", "nkisim"},
    {"capture", "models", "stablehlo"},
    {"matching"},
    {"codegen"},
    {"patterns"},  # the built-in ops: patterns and their lowerings, on the public codegen API (fusegraph.codegen.api)
    {"perf", "llm"},
    {"executors"},
    {"report"},
    {"pipeline", "backend", "api"},
    {"cli", "jax", "modelperf"},
]
#: upward edges that are known and being removed, with where and why; each must still occur (else delete it)
PENDING: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    src: str  # importing package
    dst: str  # imported package
    module: str  # the absolute module imported from
    name: str | None  # the name taken from it (``from m import name``), None for ``import m``
    where: str  # file:line

    def __str__(self) -> str:
        what = f"from {self.module} import {self.name}" if self.name else f"import {self.module}"
        return f"{self.where}: {what}"


def _module_of(path: Path) -> tuple[str, bool]:
    rel = path.relative_to(ROOT)
    parts = list(rel.with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    return ".".join([TREES[parts[0]], *parts[1:]]), is_pkg


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else FACADE


def _is_subpackage(name: str) -> bool:
    """``fusegraph.<name>`` is a module or package (not an attribute of the facade)."""
    return name in {"codegen", "patterns"} or (ROOT / "fusegraph" / name).is_dir() or \
        (ROOT / "fusegraph" / f"{name}.py").is_file()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@functools.lru_cache(maxsize=1)
def scan() -> tuple[Import, ...]:
    """Every import of a fusegraph module by a fusegraph module, with the packages on both sides."""
    found: list[Import] = []
    for top in TREES:
        for path in sorted((ROOT / top).rglob("*.py")):
            module, is_pkg = _module_of(path)
            here = module.split(".") if is_pkg else module.split(".")[:-1]
            src = _package(module)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.Import):
                    targets = [(a.name, None) for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = ".".join(here[: len(here) - node.level + 1]) if node.level else ""
                    mod = ".".join(p for p in (base, node.module or "") if p)
                    targets = [(mod, a.name) for a in node.names]
                else:
                    continue
                for mod, name in targets:
                    if mod != "fusegraph" and not mod.startswith("fusegraph."):
                        continue
                    dst = _package(mod)
                    if mod == "fusegraph" and name is not None and _is_subpackage(name):
                        dst = name  # ``from fusegraph import nkisim``: the subpackage
                    found.append(Import(src, dst, mod, name, where))
    return tuple(found)


def _graph(imports: tuple[Import, ...]) -> tuple[nx.DiGraph, dict[tuple[str, str], list[Import]]]:
    edges: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for imp in imports:
        if imp.src != imp.dst:
            edges[(imp.src, imp.dst)].append(imp)
    g = nx.DiGraph()
    g.add_edges_from(edges)
    return g, dict(edges)


def _describe(edges: dict[tuple[str, str], list[Import]], pairs: list[tuple[str, str]]) -> str:
    lines = []
    for a, b in pairs:
        lines.append(f"  {a} -> {b}:")
        names: dict[tuple[str, str], list[str]] = defaultdict(list)  # one line per import statement
        for imp in edges[(a, b)]:
            names[(imp.where, imp.module)].append(imp.name or "")
        for (where, module), taken in names.items():
            what = f"from {module} import {', '.join(taken)}" if any(taken) else f"import {module}"
            lines.append(f"      {where}: {what}")
    return "\n".join(lines)


def test_scan_sees_function_level_imports() -> None:
    """The scan is not blind to imports inside functions (the ones that used to hide the cycles)."""
    imports = scan()
    assert any(i.where.startswith("fusegraph/cli.py") and i.dst == "models" for i in imports)
    assert any(i.src == "patterns" and i.dst == "matching" for i in imports)
    assert len({i.src for i in imports}) >= 15


def test_no_package_level_import_cycle() -> None:
    g, edges = _graph(scan())
    cycles = [c for c in nx.strongly_connected_components(g) if len(c) > 1]
    if not cycles:
        return
    msg = []
    for comp in cycles:
        cycle = nx.find_cycle(g.subgraph(comp))
        msg.append(f"import cycle {' -> '.join([a for a, _ in cycle] + [cycle[0][0]])}:\n"
                   + _describe(edges, [(a, b) for a, b in cycle]))
    raise AssertionError("\n".join(msg))


def test_imports_go_down_the_layers() -> None:
    layer = {pkg: i for i, pkgs in enumerate(LAYERS) for pkg in pkgs}
    imports = scan()
    packages = {i.src for i in imports} | {i.dst for i in imports}
    unknown = sorted(packages - set(layer) - {FACADE})
    assert not unknown, f"packages not placed in LAYERS (tests/test_import_layering.py): {unknown}"
    _, edges = _graph(imports)
    upward = sorted(e for e in edges if e[1] != FACADE and layer[e[1]] > layer[e[0]])
    unexpected = [e for e in upward if e not in PENDING]
    assert not unexpected, "imports up the layers:\n" + _describe(edges, unexpected)
    stale = sorted(set(PENDING) - set(upward))
    assert not stale, f"PENDING lists edges that are gone; delete them: {stale}"


def test_only_the_version_is_taken_from_the_facade() -> None:
    bad = [i for i in scan() if i.dst == FACADE and i.src != FACADE and i.name not in FACADE_NAMES]
    assert not bad, "import from the lazy facade `fusegraph` (import the defining module instead):\n" + "\n".join(
        f"  {i}" for i in bad)


def test_no_private_name_imported_from_another_package() -> None:
    bad = [i for i in scan() if i.src != i.dst
           and ((i.name is not None and _private(i.name)) or any(_private(p) for p in i.module.split(".")))]
    assert not bad, "private names imported across packages (make them public where they are defined):\n" + \
        "\n".join(f"  {i.src} -> {i.dst}  {i}" for i in bad)


def _module_graph(package: str) -> tuple[nx.DiGraph, dict[tuple[str, str], list[Import]]]:
    """Module-level graph inside ``package`` (``fusegraph.codegen``): every import of one of its modules by
    another, at module level or inside a function (``from . import ir`` counts as an import of ``.ir``)."""
    edges: dict[tuple[str, str], list[Import]] = defaultdict(list)
    top = {v: k for k, v in TREES.items()}.get(package)
    if top is None:
        top = package.split(".", 1)[1].replace(".", "/")
    for path in sorted((ROOT / top).rglob("*.py")):
        module, is_pkg = _module_of(path)
        here = module.split(".") if is_pkg else module.split(".")[:-1]
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for b in ast.walk(tree) if isinstance(b, ast.If) and _is_type_checking(b.test)
                       for stmt in b.body for n in ast.walk(stmt)}  # annotations only: never executed
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[: len(here) - node.level + 1]) if node.level else ""
                mod = ".".join(p for p in (base, node.module or "") if p)
                sub = [f"{mod}.{a.name}" for a in node.names]
                targets = [t for t in sub if _is_module(t)] or [mod]
            else:
                continue
            for t in targets:
                if t.startswith(package + ".") and t != module:
                    edges[(module, t)].append(Import(module, t, t, None, where))
    g = nx.DiGraph()
    g.add_edges_from(edges)
    return g, dict(edges)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_module(name: str) -> bool:
    parts = name.split(".")
    if parts[:1] != ["fusegraph"] or len(parts) < 2:
        return False
    top = parts[1] if parts[1] in ("codegen", "patterns") else "fusegraph"
    rel = parts[2:] if top != "fusegraph" else parts[1:]
    base = ROOT / top / Path(*rel) if rel else ROOT / top
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def test_no_module_cycle_inside_codegen() -> None:
    """Inside the codegen core, modules import one way too: no cycle, not even one closed by a function-level
    import (the built-in ops are imported by name, ``registry.BUILTIN_MODULES``, and import only the core)."""
    g, edges = _module_graph("fusegraph.codegen")
    assert g.number_of_edges() > 20  # the scan sees the core's imports
    cycles = [c for c in nx.strongly_connected_components(g) if len(c) > 1]
    msg = []
    for comp in cycles:
        cycle = nx.find_cycle(g.subgraph(comp))
        msg.append(f"module cycle {' -> '.join([a for a, _ in cycle] + [cycle[0][0]])}:\n"
                   + "\n".join(f"      {imp.where}: {a} imports {b}" for a, b in cycle for imp in edges[(a, b)]))
    assert not msg, "\n".join(msg)


def test_ops_use_only_the_public_codegen_api() -> None:
    """A built-in op imports ``fusegraph.codegen.api`` and nothing else of codegen, exactly what a plugin may."""
    bad = [i for i in scan() if i.src == "patterns" and i.dst == "codegen" and i.module != "fusegraph.codegen.api"]
    assert not bad, "ops importing codegen internals (export what they need from fusegraph.codegen.api):\n" + \
        "\n".join(f"  {i}" for i in bad)


def test_the_core_names_no_op() -> None:
    """Nothing below or beside the ops imports one (the executors, the report, the CLI reach ops through the
    registry); the op folders import each other only where one op builds on another."""
    bad = [i for i in scan() if i.dst == "patterns" and i.src != "patterns"]
    assert not bad, "modules outside the op folders importing an op:\n" + "\n".join(f"  {i}" for i in bad)
