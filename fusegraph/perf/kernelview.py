"""A kernel's source lines joined with the interpreter's counters: what the cost model schedules.

The interpreter's profile aggregates work per source line (``sites`` for engine instructions, ``dmas`` for
transfers) but carries no dependencies and no time. Generated megakernels are straight-line code (templates
only loop over tokens, chunks and heads), so the order of the lines is the program order, and the variables an
NKI call reads and writes give the dependencies. This module parses the source with :mod:`ast` (never executes
it) and returns one :class:`KernelLine` per executed ``nisa.*`` call: its counters, the variables it reads and
writes, the loops around it, its instruction ``name=`` and the region (codegen instruction) the name belongs to.
What the interpreter saw at run time -- operand dtypes, DMA queue, DGE mode and runtime-offset (indirect)
accesses -- comes from the profile (``sites[].input_dtypes``, ``dmas[].indirect``), not from the source.
"""
from __future__ import annotations

import ast
import logging
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

log = logging.getLogger(__name__)

#: keyword arguments through which NKI calls write
OUTPUT_KEYWORDS = frozenset({"dst", "reduce_res"})
_LAYER_KEY = re.compile(r"^(L\d+|top)\.[^.]+\.[^.]+")


@dataclass
class KernelLine:
    """One ``nisa.*`` call of the kernel source with every execution of it the profile counted."""

    index: int  # position in program order
    line: int
    opcode: str  # nisa function name
    name: str  # the name= literal ('' when absent)
    region: str  # codegen instruction key: "L3.q_proj.linear", "top.lm_head.linear", or "prologue"
    layer: int | None
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    partial_write: bool  # the destination is a slice/view of its tensor (other parts keep older writers)
    loops: tuple[int, ...]  # ids (line numbers) of the enclosing for-loops, outermost first
    sites: list[dict[str, Any]] = field(default_factory=list)  # profile sites on this line (as dicts)
    dmas: list[dict[str, Any]] = field(default_factory=list)  # profile DMA aggregates on this line

    @property
    def count(self) -> int:
        if self.dmas:
            return sum(d["count"] for d in self.dmas)
        return max((s["count"] for s in self.sites), default=0)

    @property
    def engine(self) -> str:
        if self.dmas or any(s["engine"] == "dma" for s in self.sites):
            return "dma"
        return self.sites[0]["engine"] if self.sites else "?"

    @property
    def indirect(self) -> str | None:
        """``"vector"`` / ``"scalar"`` when a DMA of this line used a runtime ``vector_offset`` / ``scalar_offset``
        (the profile's ``dmas[].indirect``), else None."""
        kinds = {d.get("indirect") or "" for d in self.dmas}
        if "vector" in kinds:
            return "vector"
        return "scalar" if "scalar" in kinds else None

    @property
    def input_dtypes(self) -> dict[str, list[str]]:
        """Input tensor argument -> dtypes over the line's profile sites (``{"stationary": ["bfloat16"], ...}``)."""
        out: dict[str, set[str]] = defaultdict(set)
        for s in self.sites:
            for arg, dts in (s.get("input_dtypes") or {}).items():
                out[arg].update(dts)
        return {a: sorted(v) for a, v in sorted(out.items())}


def region_of(name: str) -> tuple[str, int | None]:
    """Instruction key and decoder layer of an instruction name (``L3.q_proj.linear.mm`` -> ``L3.q_proj.linear``)."""
    m = _LAYER_KEY.match(name or "")
    if not m:
        return "prologue", None
    key = m.group(0)
    head = key.split(".", 1)[0]
    return key, (int(head[1:]) if head.startswith("L") else None)


def _base_name(node: ast.AST) -> tuple[str | None, bool]:
    """The variable an operand expression refers to, and whether it is a slice/view of it."""
    partial = False
    while True:
        if isinstance(node, ast.Name):
            return node.id, partial
        if isinstance(node, ast.Subscript):
            partial = True
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "ap":
                partial = True
            node = node.func.value
        elif isinstance(node, ast.Attribute):
            node = node.value
        else:
            return None, partial


def _names(node: ast.AST) -> Iterable[str]:
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            yield n.id


def _const_str(node: ast.AST | None) -> str:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""


def _kernel_function(tree: ast.Module, name: str | None) -> ast.FunctionDef:
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    if name:
        for f in funcs:
            if f.name == name:
                return f
    for f in funcs:
        for d in f.decorator_list:
            text = ast.unparse(d)
            if "jit" in text:
                return f
    if not funcs:
        raise ValueError("the kernel source defines no function")
    return funcs[0]


def _buffer_of(call: ast.Call) -> str:
    for kw in call.keywords:
        if kw.arg == "buffer":
            return ast.unparse(kw.value).replace("nl.", "")
    return "sbuf"


def parse_source(source: str, kernel: str | None = None) -> tuple[list[KernelLine], dict[str, str], dict[int, list]]:
    """Parse ``source``: the ``nisa`` calls in order, the buffer of every variable, and allocation events.

    Returns ``(lines, buffers, allocs)`` where ``allocs[i]`` lists the variables (re)allocated just before
    line ``i`` (a fresh ``nl.ndarray`` starts a new tensor under an old name: new writers, and for PSUM no
    write-after-read hazard with the old one).
    """
    tree = ast.parse(source)
    fn = _kernel_function(tree, kernel)
    params = {a.arg for a in fn.args.args}
    buffers: dict[str, str] = {p: "hbm" for p in params}  # the variables that name tensors, and where they live
    lines: list[KernelLine] = []
    pending_allocs: list[str] = []
    alloc_events: dict[int, list] = defaultdict(list)

    def visit(stmts: list[ast.stmt], loops: tuple[int, ...]) -> None:
        for st in stmts:
            if isinstance(st, ast.For):
                visit(st.body, loops + (st.lineno,))
                continue
            if isinstance(st, (ast.If, ast.With)):
                visit(st.body, loops)
                visit(getattr(st, "orelse", []) or [], loops)
                continue
            if isinstance(st, ast.Assign) and isinstance(st.value, ast.Call):
                fn_text = ast.unparse(st.value.func)
                if fn_text.endswith("ndarray") and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
                    var = st.targets[0].id
                    buffers[var] = _buffer_of(st.value)
                    pending_allocs.append(var)
                continue
            if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Call)):
                continue
            call = st.value
            f = call.func
            if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "nisa"):
                continue
            kws = {kw.arg: kw.value for kw in call.keywords if kw.arg}
            writes: list[str] = []
            partial = False
            for k in OUTPUT_KEYWORDS:
                if k in kws:
                    var, part = _base_name(kws[k])
                    if var is not None:
                        writes.append(var)
                        partial = partial or part
            known = buffers
            reads: list[str] = []
            for k, v in kws.items():
                if k in ("name",) or k in OUTPUT_KEYWORDS:
                    continue
                for n in _names(v):
                    if n in known and n not in reads:
                        reads.append(n)
            # indices inside the destination (e.g. a runtime offset of a scatter) are reads too
            for k in OUTPUT_KEYWORDS:
                if k in kws:
                    base, _ = _base_name(kws[k])
                    for n in _names(kws[k]):
                        if n in known and n != base and n not in reads:
                            reads.append(n)
            name = _const_str(kws.get("name"))
            region, layer = region_of(name)
            idx = len(lines)
            if pending_allocs:
                alloc_events[idx].extend(pending_allocs)
                pending_allocs.clear()
            lines.append(KernelLine(idx, st.lineno, f.attr, name, region, layer, tuple(reads), tuple(writes), partial,
                                    loops))

    visit(fn.body, ())
    return lines, buffers, dict(alloc_events)


def _as_dict(x: Any) -> dict[str, Any]:
    if isinstance(x, dict):
        return x
    from dataclasses import asdict

    return asdict(x)


@dataclass
class KernelView:
    """The executed lines of one kernel run, in program order, with the buffers of the variables."""

    lines: list[KernelLine]
    buffers: dict[str, str]
    allocs: dict[int, list]
    filename: str
    unmatched_sites: int = 0  # profile sites whose line is not a nisa call of the source (helper files)

    def regions(self) -> list[str]:
        seen: dict[str, None] = {}
        for ln in self.lines:
            seen.setdefault(ln.region, None)
        return list(seen)


def build_view(source: str, profile: Any, filename: str | None = None, kernel: str | None = None) -> KernelView:
    """Join the parsed ``source`` with ``profile`` (a :class:`~fusegraph.nkisim.profile.Profile` or its dict).

    Lines the run never executed are dropped. ``filename`` selects the profile entries of the kernel file
    (default: the file with most sites).
    """
    prof = profile if isinstance(profile, dict) else profile.to_dict()
    sites = [_as_dict(s) for s in prof.get("sites", [])]
    dmas = [_as_dict(d) for d in prof.get("dmas", [])]
    if filename is None:
        files: dict[str, int] = defaultdict(int)
        for s in sites:
            files[s["file"]] += s["count"]
        filename = max(files, key=files.get) if files else ""
    lines, buffers, allocs = parse_source(source, kernel)
    by_line: dict[int, KernelLine] = {ln.line: ln for ln in lines}
    unmatched = 0
    for s in sites:
        if s["file"] != filename:
            continue
        ln = by_line.get(s["line"])
        if ln is None:
            unmatched += 1
            continue
        ln.sites.append(s)
    for d in dmas:
        if d["file"] != filename:
            continue
        ln = by_line.get(d["line"])
        if ln is not None:
            ln.dmas.append(d)
    executed = [ln for ln in lines if ln.sites or ln.dmas]
    # renumber, keeping allocation events attached to the next executed line
    remap: dict[int, int] = {}
    new_allocs: dict[int, list] = defaultdict(list)
    carry: list = []
    for ln in lines:
        carry.extend(allocs.get(ln.index, []))
        if ln.sites or ln.dmas:
            remap[ln.index] = len(remap)
            if carry:
                new_allocs[remap[ln.index]].extend(carry)
                carry = []
    for i, ln in enumerate(executed):
        ln.index = i
    if unmatched:
        log.info("%d profile sites of %s are not nisa calls of the kernel source", unmatched, filename)
    return KernelView(executed, buffers, dict(new_allocs), filename, unmatched)
