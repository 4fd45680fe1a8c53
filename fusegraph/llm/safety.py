"""The AST allow-list for untrusted kernel source: what an LLM-written kernel may *say* before anything runs.

An NKI kernel needs very little Python: imports of the ``nki`` modules (and ``math``), functions, loops,
arithmetic on shapes, calls into the NKI API and a few harmless builtins. Everything that could reach the
host (``os``, ``open``, ``subprocess``), compute the answer outside NKI (``torch``, ``numpy``), or get around
the checks by introspection (``getattr``, ``__class__``, ``__subclasses__``, format-string attribute access,
the interpreter's private ``_`` attributes that hold NumPy arrays) is rejected here, statically, with the line.
The rules are an allow-list: anything not named below is refused, so an unforeseen trick fails closed.

This is the first layer only; the kernel then runs in a separate, resource-limited process with scrubbed
builtins (:mod:`fusegraph.llm.worker`). See docs/llm.md for the threat model.
"""
from __future__ import annotations

import ast
import math
from dataclasses import dataclass

NKI_MODULES: frozenset[str] = frozenset({"nki", "nki.language", "nki.isa", "nki.collectives", "nki.typing"})
IMPORTABLE: frozenset[str] = NKI_MODULES | {"math"}

ALLOWED_BUILTINS: frozenset[str] = frozenset({
    "range", "len", "min", "max", "abs", "sum", "enumerate", "zip", "list", "tuple", "dict", "int", "float",
    "bool", "str", "isinstance", "print", "round", "all", "any", "sorted", "reversed", "divmod", "pow", "slice",
    "map", "filter", "ValueError", "AssertionError", "NotImplementedError", "RuntimeError",
})
"""Builtins a kernel may name; every other builtin (open, exec, getattr, type, vars, ...) is refused."""

ALWAYS_DENIED_BUILTINS: frozenset[str] = frozenset({
    "open", "exec", "eval", "compile", "__import__", "getattr", "setattr", "delattr", "hasattr", "globals",
    "locals", "vars", "breakpoint", "memoryview", "type", "object", "super", "dir", "help", "exit", "quit",
    "classmethod", "staticmethod", "property",
})
"""Builtins refused even where the file binds the same name (a binding in one scope does not shadow another)."""

FORBIDDEN_NAMES: dict[str, str] = {
    "torch": "computes with torch instead of NKI",
    "numpy": "computes with NumPy instead of NKI",
    "np": "computes with NumPy instead of NKI",
    "os": "reaches the operating system",
    "sys": "reaches the interpreter",
    "subprocess": "starts processes",
    "builtins": "reaches the builtins",
}

TENSOR_ATTRIBUTES: frozenset[str] = frozenset({
    "shape", "dtype", "buffer", "ndim", "size", "itemsize", "strides", "offset", "name",
    "reshape", "view", "ap", "get_pattern",
})
"""The NKI 0.3 tensor surface (attributes and view methods)."""

CONTAINER_METHODS: frozenset[str] = frozenset({
    "append", "extend", "insert", "pop", "index", "count", "items", "keys", "values", "get",
})
ALLOWED_ATTRIBUTES: frozenset[str] = TENSOR_ATTRIBUTES | CONTAINER_METHODS
"""Attributes allowed on anything that is not an imported module (whose attributes conformance checks)."""

ALLOWED_DECORATORS = ("nki.jit",)


@dataclass(frozen=True)
class Finding:
    line: int
    message: str
    severity: int = 1  # 0 = reaches the host or computes outside NKI; 1 = anything else (listed first: 0)
    cheat: bool = False  # the kernel would pass without computing: it returns an input, or computes nothing

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


def import_aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> what it refers to (``"nki.language"``, ``"nki.language.add"``, ``"math"``, ``"math.sqrt"``)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = a.name
                else:
                    out[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def qualname(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``nl.exp`` -> ``"nki.language.exp"`` when the chain starts at an import alias, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id], *reversed(parts)])
    return None


def _dunder(name: str) -> bool:
    return name.startswith("__")


class _Checker(ast.NodeVisitor):
    def __init__(self, aliases: dict[str, str], bound: frozenset[str]):
        self.aliases = aliases
        self.bound = bound  # names the file binds itself (parameters, assignments): they shadow builtins
        self.findings: list[Finding] = []
        self.depth = 0  # function nesting

    def bad(self, node: ast.AST, message: str, severity: int = 1) -> None:
        self.findings.append(Finding(getattr(node, "lineno", 0), message, severity))

    # -- module structure ----------------------------------------------------------------------------
    def check_module(self, tree: ast.Module) -> None:
        for i, stmt in enumerate(tree.body):
            if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.Assign, ast.AnnAssign)):
                continue
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
                continue  # docstring / string comment
            self.bad(stmt, f"{type(stmt).__name__.lower()} statement at module level; a kernel file holds only "
                           f"imports, constants and functions")
        self.visit(tree)

    # -- imports -------------------------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        if self.depth:
            self.bad(node, "imports belong at the top of the file")
        for a in node.names:
            if a.name not in IMPORTABLE:
                self.bad(node, f"import of '{a.name}' is not allowed (only {', '.join(sorted(IMPORTABLE))})", 0)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if self.depth:
            self.bad(node, "imports belong at the top of the file")
        mod = node.module or ""
        if node.level or mod not in IMPORTABLE:
            self.bad(node, f"import from '{'.' * node.level}{mod}' is not allowed "
                           f"(only {', '.join(sorted(IMPORTABLE))})", 0)
        for a in node.names:
            if a.name == "*":
                self.bad(node, "'import *' is not allowed")
            elif _dunder(a.name) or a.name.startswith("_"):
                self.bad(node, f"importing the private name '{a.name}' is not allowed")

    # -- definitions ---------------------------------------------------------------------------------
    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        for dec in node.decorator_list:
            target = dec.func if isinstance(dec, ast.Call) else dec
            if qualname(target, self.aliases) not in ALLOWED_DECORATORS:
                self.bad(dec, "only @nki.jit may decorate a function")
        if _dunder(node.name):
            self.bad(node, f"function name '{node.name}' is not allowed")
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self.bad(node, "async functions are not allowed")

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.bad(node, "class definitions are not allowed in a kernel")

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.generic_visit(node)

    # -- statements the NKI tracer does not support or that hide failures ----------------------------
    def visit_Try(self, node: ast.AST) -> None:
        self.bad(node, "try/except is not allowed (it would hide interpreter and hardware-rule errors)")

    visit_TryStar = visit_Try

    def visit_Global(self, node: ast.Global) -> None:
        self.bad(node, "global statements are not allowed")

    def visit_Yield(self, node: ast.AST) -> None:
        self.bad(node, "generators are not allowed in a kernel")

    visit_YieldFrom = visit_Yield
    visit_Await = visit_Yield

    def visit_With(self, node: ast.With) -> None:
        for item in node.items:
            ctx = item.context_expr
            q = qualname(ctx.func, self.aliases) if isinstance(ctx, ast.Call) else None
            if q != "nki.language.no_reorder":
                self.bad(node, "only 'with nl.no_reorder():' is allowed as a with statement")
        self.generic_visit(node)

    visit_AsyncWith = visit_AsyncFunctionDef

    # -- names and attributes ------------------------------------------------------------------------
    def visit_Name(self, node: ast.Name) -> None:
        name = node.id
        if name in FORBIDDEN_NAMES:
            self.bad(node, f"'{name}' is not allowed: the kernel {FORBIDDEN_NAMES[name]}", 0)
        elif _dunder(name):
            self.bad(node, f"the name '{name}' is not allowed (dunder names reach interpreter internals)", 0)
        elif name in ALWAYS_DENIED_BUILTINS or (
            name in _BUILTIN_NAMES and name not in ALLOWED_BUILTINS and name not in self.bound
        ):
            self.bad(node, f"the builtin '{name}' is not allowed in a kernel", 0)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        attr = node.attr
        if attr.startswith("_"):
            self.bad(node, f"access to the private attribute '.{attr}' is not allowed", 0)
        else:
            q = qualname(node, self.aliases)
            if q is None:
                if attr not in ALLOWED_ATTRIBUTES:
                    self.bad(node, f"attribute '.{attr}' is not part of the NKI tensor API "
                                   f"(allowed: {', '.join(sorted(TENSOR_ATTRIBUTES))})")
            elif q.split(".")[0] == "math" and not hasattr(math, attr):
                self.bad(node, f"math has no attribute '{attr}'")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and "__" in node.value and self.depth:
            self.bad(node, "string constants containing '__' are not allowed inside functions "
                           "(format-string attribute tricks)")
        if isinstance(node.value, bytes):
            self.bad(node, "bytes constants are not allowed")

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("format", "format_map"):
            self.bad(node, "str.format is not allowed (use f-strings)")
        self.generic_visit(node)


_BUILTIN_NAMES: frozenset[str] = frozenset(dir(__import__("builtins")))


def _bound_names(tree: ast.AST) -> frozenset[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
    return frozenset(names)


def check_safety(tree: ast.Module) -> list[Finding]:
    """Every allow-list violation in the parsed kernel file (empty = the file only says allowed things)."""
    aliases = import_aliases(tree)
    checker = _Checker(aliases, frozenset(aliases) | _bound_names(tree))
    checker.check_module(tree)
    return sorted(set(checker.findings), key=lambda f: (f.severity, f.line, f.message))
