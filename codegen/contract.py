"""The typed pattern-to-lowering contract: a lowering registered with the pattern objects it lowers
(``register_lowering(rmsnorm, ...)``) may read only the inputs, params, slots and outputs those patterns declare.

Checked when the op's module is imported (the decorator runs), from the source of the lowering and of its
``check``/``tokens`` functions, so a renamed input fails at import naming ``file:line`` instead of raising
``KeyError`` inside some user's decode step. What is read: ``L.input(m, "x")``, ``L.views(m, "x")``,
``L.output(m, "out")``, ``m.inputs["x"]``, ``m.inputs.get("x")``, ``"x" in m.inputs``, ``m.params["eps"]``,
``m.params.get("eps")`` and ``"eps" in m.params``, where ``m`` is the function's match argument. Helpers a lowering
calls are not followed (their reads are checked where they are the lowering itself).
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any, Callable, Iterable

_MATCH_ARGS = ("m", "match")


def declared_names(patterns: Iterable[Any]) -> dict[str, set[str]]:
    """What the patterns declare, by kind: ``inputs`` (input names), ``params`` (params, slots, derived params)
    and ``outputs``."""
    out: dict[str, set[str]] = {"inputs": set(), "params": set(), "outputs": set()}
    for p in patterns:
        out["inputs"] |= {i.name for i in p.inputs}
        out["params"] |= set(p.params) | set(p.slots) | set(getattr(p, "derived", ())) | _keywords(p.fn)
        out["outputs"] |= set(p.outputs)
    return out


def _keywords(fn: Callable) -> set[str]:
    """The keyword-only parameters of a pattern's function (its params, given per case)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return set()
    return {n for n, q in sig.parameters.items() if q.kind is q.KEYWORD_ONLY}


def _reads(fn: Callable) -> Iterable[tuple[str, str, int]]:
    """(kind, name, line) of every name ``fn`` reads from its match argument (see the module docstring)."""
    try:
        src = textwrap.dedent(inspect.getsource(fn))
        first = inspect.getsourcelines(fn)[1]
    except (OSError, TypeError):
        return
    tree = ast.parse(src)

    def is_match(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id in _MATCH_ARGS

    def field_of(node: ast.AST) -> str | None:  # m.inputs / m.params
        if isinstance(node, ast.Attribute) and node.attr in ("inputs", "params") and is_match(node.value):
            return node.attr
        return None

    def const(node: ast.AST) -> str | None:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    for node in ast.walk(tree):
        line = first + getattr(node, "lineno", 1) - 1
        if isinstance(node, ast.Subscript) and (kind := field_of(node.value)) and (name := const(node.slice)):
            yield kind, name, line
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            if (kind := field_of(node.comparators[0])) and (name := const(node.left)):
                yield kind, name, line
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr == "get" and (kind := field_of(f.value)) and node.args and (name := const(node.args[0])):
                yield kind, name, line
            elif (f.attr in ("input", "views", "output") and len(node.args) >= 2 and is_match(node.args[0])
                  and (name := const(node.args[1]))):
                yield ("outputs" if f.attr == "output" else "inputs"), name, line


def check_contract(fns: Iterable[Callable | None], patterns: Iterable[Any]) -> None:
    """Raise ``TypeError`` naming ``file:line`` when one of ``fns`` reads a name no pattern of ``patterns``
    declares (see the module docstring)."""
    patterns = list(patterns)
    declared = declared_names(patterns)
    names = ", ".join(p.name for p in patterns)
    for fn in fns:
        if fn is None:
            continue
        for kind, name, line in _reads(fn):
            if name not in declared[kind]:
                where = inspect.getsourcefile(fn) or getattr(fn, "__module__", "?")
                have = ", ".join(sorted(declared[kind])) or "none"
                raise TypeError(f"{where}:{line}: {fn.__qualname__} reads {kind[:-1]} {name!r}, which the pattern(s) "
                                f"it lowers ({names}) do not declare (their {kind}: {have})")
