"""Static conformance check of NKI kernel source against the official API tables.

Generated kernels (and, later, kernels written by an untrusted LLM) must compile with the NKI that ships
with SDK 2.29 *and* keep compiling on later SDKs.  This module parses the source (it never executes it),
resolves the ``nki`` import aliases and checks every reference and call into the official namespaces:

* every ``nl.X`` / ``nisa.X`` / ``nccl.X`` / ``nki.X`` (and enum members such as ``nisa.dge_mode.hwdge``,
  constants such as ``nl.tile_size.pmax``) exists in **all** requested versions;
* every call names a function present in all versions, passes only parameters that exist in all versions,
  supplies every required parameter, does not bind a parameter twice, and does not use ``*args``/``**kwargs``
  splats (they cannot be checked);
* with ``require_keywords=True`` (the default) calls bind arguments **by keyword only** — parameters were
  inserted mid-signature in later SDKs (``dma_copy(priority=...)``), so positional arguments beyond the first
  are unsafe.  Exceptions, where positional use is conventional and the position is stable in every table:
  ``nl.ds``, ``nl.program_id``, ``nl.num_programs``, the loop helpers ``nl.affine_range``,
  ``nl.sequential_range``, ``nl.static_range``, and the top-level ``nki.jit`` / ``nki.simulate``;
* calls of ``NkiTensor`` methods that only exist from NKI 0.5 (``permute``, ``broadcast``, ``slice``,
  ``select``, ``expand_dim``, ``squeeze_dim``, ``reshape_dim``, ``flatten_dims``, ``rearrange``,
  ``vector_select``, ``indirect``) are violations: they are not available on 2.29.

Messages name the line and the exact problem, e.g.
``line 12: nisa.tensor_tensor has no parameter 'dtype' in NKI 0.3.0``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Iterable, Sequence

from .tables import MODULES, ApiTable, FunctionSig, load_table

TENSOR_METHODS_FROM_05: frozenset[str] = frozenset(
    {
        "permute",
        "broadcast",
        "slice",
        "select",
        "expand_dim",
        "squeeze_dim",
        "reshape_dim",
        "flatten_dims",
        "rearrange",
        "vector_select",
        "indirect",
    }
)
"""NkiTensor view methods added in NKI 0.5 (SDK 2.31)."""

POSITIONAL_ALLOWED: dict[str, frozenset[str]] = {
    "nki.language": frozenset(
        {"ds", "program_id", "num_programs", "affine_range", "sequential_range", "static_range"}
    ),
    "nki": frozenset({"jit", "simulate"}),
}
"""Functions that may take positional arguments even with ``require_keywords=True``."""

UNTABLED_MODULES: frozenset[str] = frozenset({"nki.typing"})
"""Official modules that exist in 0.3 but are not described by the tables (their attributes are not checked)."""


@dataclass(frozen=True)
class Violation:
    """One conformance problem; ``message`` already starts with ``line N:``."""

    line: int
    col: int
    message: str

    def __str__(self) -> str:
        return self.message


class ConformanceError(ValueError):
    """Raised by :func:`assert_conforms`; lists every violation."""

    def __init__(self, violations: Sequence[Violation], filename: str | None = None):
        self.violations = list(violations)
        self.filename = filename
        where = f" in {filename}" if filename else ""
        lines = "\n".join(f"  {v.message}" for v in self.violations)
        super().__init__(f"{len(self.violations)} NKI API conformance violation(s){where}:\n{lines}")


# --------------------------------------------------------------------------------------------------
# references


@dataclass(frozen=True)
class _Ref:
    kind: str  # "module", "attr" (function/class/name of a module), "member" (attribute of a class/instance)
    module: str
    name: str = ""
    owner: str = ""  # for "member": the class/instance name inside ``module``


def _versions_text(versions: Iterable[str]) -> str:
    vs = list(versions)
    return "NKI " + ", ".join(vs)


class _Checker(ast.NodeVisitor):
    def __init__(self, tables: list[ApiTable], require_keywords: bool):
        self.tables = tables
        self.require_keywords = require_keywords
        self.aliases: dict[str, _Ref] = {}
        self.violations: list[Violation] = []
        self._seen: set[tuple[int, int, str]] = set()

    # -- helpers -----------------------------------------------------------------------------------
    def add(self, node: ast.AST, text: str) -> None:
        line = getattr(node, "lineno", 0)
        col = getattr(node, "col_offset", 0)
        key = (line, col, text)
        if key in self._seen:
            return
        self._seen.add(key)
        self.violations.append(Violation(line, col, f"line {line}: {text}"))

    def _module_known(self, mod: str) -> list[str]:
        """Versions lacking the module ``mod`` (empty list = known everywhere)."""
        if mod in UNTABLED_MODULES:
            return []
        return [t.version for t in self.tables if not t.has_module(mod)]

    def _missing_attr(self, module: str, attr: str) -> list[str]:
        return [t.version for t in self.tables if not t.has_attr(module, attr)]

    # -- import aliases ----------------------------------------------------------------------------
    def collect_imports(self, tree: ast.AST) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    name = alias.name
                    if name != "nki" and not name.startswith("nki."):
                        continue
                    missing = self._module_known(name)
                    if missing:
                        self.add(node, f"module {name} is not part of the {_versions_text(missing)} API")
                        continue
                    if alias.asname:
                        self.aliases[alias.asname] = _Ref("module", name)
                    else:
                        self.aliases["nki"] = _Ref("module", "nki")
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level or (mod != "nki" and not mod.startswith("nki.")):
                    continue
                missing = self._module_known(mod)
                if missing:
                    self.add(node, f"module {mod} is not part of the {_versions_text(missing)} API")
                    continue
                for alias in node.names:
                    local = alias.asname or alias.name
                    if alias.name == "*":
                        self.add(node, f"'from {mod} import *' cannot be checked; import names explicitly")
                        continue
                    sub = f"{mod}.{alias.name}"
                    if sub in MODULES or sub in UNTABLED_MODULES:
                        self.aliases[local] = _Ref("module", sub)
                        continue
                    if mod in UNTABLED_MODULES:
                        continue
                    missing = self._missing_attr(mod, alias.name)
                    if missing:
                        self.add(node, f"{sub} is not in {_versions_text(missing)}")
                        continue
                    self.aliases[local] = _Ref("attr", mod, alias.name)

    # -- resolution --------------------------------------------------------------------------------
    def resolve(self, node: ast.AST, report: bool) -> _Ref | None:
        """Resolve an expression to an API reference; report a missing final attribute when asked."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if not isinstance(node, ast.Attribute):
            return None
        base = self.resolve(node.value, report=False)
        if base is None:
            return None
        attr = node.attr
        text = _expr_text(node)
        if base.kind == "module":
            if base.module in UNTABLED_MODULES:
                return None
            sub = f"{base.module}.{attr}"
            if sub in MODULES or sub in UNTABLED_MODULES:
                missing = self._module_known(sub)
                if missing and report:
                    self.add(node, f"{text} is not in {_versions_text(missing)}")
                return _Ref("module", sub)
            missing = self._missing_attr(base.module, attr)
            if missing:
                if report:
                    self.add(node, f"{text} is not in {_versions_text(missing)}")
                return None
            return _Ref("attr", base.module, attr)
        if base.kind == "attr":
            # attribute of a class (enum member, tile_size constant) or of an instance-like name
            spaces = [(t.version, t.attribute_namespace(base.module, base.name)) for t in self.tables]
            if all(space is None for _, space in spaces):
                return None  # a function or plain name: attributes of those are not API references
            missing = [v for v, space in spaces if space is None or attr not in space]
            if missing:
                if report:
                    self.add(node, f"{text} is not in {_versions_text(missing)}")
                return None
            return _Ref("member", base.module, attr, owner=base.name)
        return None

    # -- visitors ----------------------------------------------------------------------------------
    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.resolve(node, report=True)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        ref = self.resolve(func, report=False)
        if ref is not None and ref.kind == "attr":
            sigs = [(t.version, t.function(ref.module, ref.name)) for t in self.tables]
            if all(sig is not None for _, sig in sigs):
                self.check_call(node, _expr_text(func), ref, [(v, s) for v, s in sigs if s is not None])
        elif (
            ref is None
            and isinstance(func, ast.Attribute)
            and func.attr in TENSOR_METHODS_FROM_05
            and self.resolve(func.value, report=False) is None
        ):
            self.add(
                node,
                f"tensor method .{func.attr}() only exists from NKI 0.5 (SDK 2.31); not available in NKI 0.3.0 "
                f"(use slicing, .reshape, .view or .ap)",
            )
        self.generic_visit(node)

    def check_call(self, node: ast.Call, text: str, ref: _Ref, sigs: list[tuple[str, FunctionSig]]) -> None:
        npos = len(node.args)
        if any(isinstance(a, ast.Starred) for a in node.args):
            self.add(node, f"{text} is called with *args; arguments cannot be checked, pass them by keyword")
            return
        if any(kw.arg is None for kw in node.keywords):
            self.add(node, f"{text} is called with **kwargs; arguments cannot be checked, pass them by keyword")
            return
        allowed_pos = POSITIONAL_ALLOWED.get(ref.module, frozenset())
        if self.require_keywords and npos and ref.name not in allowed_pos:
            self.add(
                node,
                f"{text} is called with {npos} positional argument(s); pass every argument by keyword "
                f"(parameter order differs between NKI versions)",
            )
        kw_names = [kw.arg for kw in node.keywords if kw.arg is not None]
        problems: dict[str, list[str]] = {}

        def note(msg: str, version: str) -> None:
            problems.setdefault(msg, []).append(version)

        for version, sig in sigs:
            positional = sig.positional_params
            if npos > len(positional):
                note(f"{text} takes at most {len(positional)} positional argument(s), got {npos}", version)
            bound = [p.name for p in positional[:npos]]
            for kw in kw_names:
                if sig.param(kw) is None or sig.param(kw).is_variadic:
                    if not sig.accepts_var_keyword:
                        note(f"{text} has no parameter '{kw}'", version)
                elif kw in bound:
                    note(f"{text} got parameter '{kw}' both by position and by keyword", version)
            if len(set(kw_names)) != len(kw_names):
                note(f"{text} got a keyword argument more than once", version)
            supplied = set(bound) | set(kw_names)
            for req in sig.required:
                if req not in supplied:
                    note(f"{text} is missing required argument '{req}'", version)
        for msg, versions in problems.items():
            self.add(node, f"{msg} in {_versions_text(versions)}")


def _expr_text(node: ast.AST) -> str:
    try:
        return ast.unparse(node)
    except Exception:  # pragma: no cover - ast.unparse handles every expression node
        return "<expr>"


def check_source(
    source: str, versions: Sequence[str] = ("0.3.0", "0.6.0"), require_keywords: bool = True
) -> list[Violation]:
    """Return every NKI API conformance violation in ``source`` (empty list = conforms).

    ``versions``: the NKI versions every reference and call must be valid in.
    ``require_keywords``: reject positional arguments (see the module docstring for the exceptions).
    The source is parsed, never executed.
    """
    if isinstance(versions, str):
        versions = (versions,)
    tables = [load_table(v) for v in versions]
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        line = exc.lineno or 0
        return [Violation(line, (exc.offset or 1) - 1, f"line {line}: syntax error: {exc.msg}")]
    checker = _Checker(tables, require_keywords)
    checker.collect_imports(tree)
    checker.visit(tree)
    return sorted(checker.violations, key=lambda v: (v.line, v.col, v.message))


def assert_conforms(
    source: str,
    versions: Sequence[str] = ("0.3.0", "0.6.0"),
    require_keywords: bool = True,
    filename: str | None = None,
) -> None:
    """Raise :class:`ConformanceError` listing all violations, if there are any."""
    violations = check_source(source, versions=versions, require_keywords=require_keywords)
    if violations:
        raise ConformanceError(violations, filename)
