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
    file: str = ""  # the source file of the line (a kernel may span several files)

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
    fn = _kernel_function(ast.parse(source), kernel)
    parser = _SourceParser({a.arg: "hbm" for a in fn.args.args})
    parser.visit(fn.body, ())
    return parser.lines, parser.buffers, dict(parser.alloc_events)


class _SourceParser:
    """One walk over a kernel's statements: the ``nisa`` / ``nki.collectives`` calls as :class:`KernelLine`,
    the buffer of every tensor variable, and the allocations between calls.

    A class so the walk's state (buffers, pending allocations, allocation names) is shared by the steps of
    reading one call (its keywords, what it writes, what it reads) without passing it around."""

    def __init__(self, buffers: dict[str, str]) -> None:
        self.buffers = buffers  # the variables that name tensors, and where they live
        self.lines: list[KernelLine] = []
        self.pending_allocs: list[str] = []
        self.alloc_events: dict[int, list] = defaultdict(list)
        self.alloc_names: dict[str, str] = {}

    def visit(self, stmts: list[ast.stmt], loops: tuple[int, ...]) -> None:
        """Walk ``stmts`` in program order (into loop bodies, both branches of an if, and with blocks)."""
        for st in stmts:
            if isinstance(st, ast.For):
                self.visit(st.body, loops + (st.lineno,))
                continue
            if isinstance(st, (ast.If, ast.With)):
                self.visit(st.body, loops)
                self.visit(getattr(st, "orelse", []) or [], loops)
                continue
            if isinstance(st, ast.Assign) and isinstance(st.value, ast.Call):
                self._assignment(st)
                continue
            if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
                self._call(st, st.value, loops)

    def _assignment(self, st: ast.Assign) -> None:
        """``x = nl.ndarray(...)``: ``x`` is a (new) tensor in that buffer, allocated before the next call."""
        fn_text = ast.unparse(st.value.func)
        if fn_text.endswith("ndarray") and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            var = st.targets[0].id
            self.buffers[var] = _buffer_of(st.value)
            self.pending_allocs.append(var)
            self.alloc_names[var] = _const_str(next((k.value for k in st.value.keywords if k.arg == "name"), None))

    def _call(self, st: ast.Expr, call: ast.Call, loops: tuple[int, ...]) -> None:
        """A call statement: a ``nisa.*`` or ``nki.collectives.*`` call becomes the next :class:`KernelLine`."""
        f = call.func
        # nisa.* and nki.collectives.* (srcs=/dsts= lists; named after their first destination's name=)
        coll = isinstance(f, ast.Attribute) and ast.unparse(f.value) == "nki.collectives"
        if not (coll or isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "nisa"):
            return
        kws = self._keywords(call, coll)
        writes, partial = _writes(kws)
        reads = self._reads(kws)
        name = _const_str(kws.get("name"))
        region, layer = region_of(name)
        idx = len(self.lines)
        if self.pending_allocs:
            self.alloc_events[idx].extend(self.pending_allocs)
            self.pending_allocs.clear()
        self.lines.append(KernelLine(idx, st.lineno, f.attr, name, region, layer, tuple(reads), tuple(writes),
                                     partial, loops))

    def _keywords(self, call: ast.Call, coll: bool) -> dict[str, ast.AST]:
        """The call's keyword arguments; a collective's first ``dsts=`` entry stands for its ``dst`` (and names
        the call after that tensor's allocation when it has no ``name=``)."""
        kws = {kw.arg: kw.value for kw in call.keywords if kw.arg}
        if coll:
            dsts = kws.pop("dsts", None)
            if isinstance(dsts, (ast.List, ast.Tuple)) and dsts.elts:
                kws["dst"] = dsts.elts[0]
                if "name" not in kws:
                    base, _ = _base_name(dsts.elts[0])
                    kws["name"] = ast.Constant(self.alloc_names.get(base) or "")
        return kws

    def _reads(self, kws: dict[str, ast.AST]) -> list[str]:
        """Tensor variables the call reads: every known variable in its input arguments, then those used as
        indices inside its destinations (e.g. a runtime offset of a scatter), in first-seen order."""
        known = self.buffers
        reads: list[str] = []
        for k, v in kws.items():
            if k in ("name",) or k in OUTPUT_KEYWORDS:
                continue
            for n in _names(v):
                if n in known and n not in reads:
                    reads.append(n)
        for k in OUTPUT_KEYWORDS:
            if k in kws:
                base, _ = _base_name(kws[k])
                for n in _names(kws[k]):
                    if n in known and n != base and n not in reads:
                        reads.append(n)
        return reads


def _writes(kws: dict[str, ast.AST]) -> tuple[list[str], bool]:
    """The variables a call writes (its output keywords) and whether any write is to a slice/view only."""
    writes: list[str] = []
    partial = False
    for k in OUTPUT_KEYWORDS:
        if k in kws:
            var, part = _base_name(kws[k])
            if var is not None:
                writes.append(var)
                partial = partial or part
    return writes, partial


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
    unmatched_sites: int = 0  # profile sites of the kernel file whose line is not a nisa call of the source
    #: file -> instructions the profile counted in *other* files (helpers the kernel calls); not in ``lines`` --
    #: see :func:`file_lines` / :func:`view_from_trace` for kernels that span several files
    other_files: dict[str, int] = field(default_factory=dict)
    #: line numbers of the ``for`` headers that are hardware loops (``nl.dynamic_range``): the cost model schedules
    #: their iterations (:mod:`fusegraph.perf.hwloops`), not their lines
    hw_loops: frozenset[int] = frozenset()
    #: trace views only (:func:`view_from_trace` with the kernel source): line index -> header line of the hardware
    #: loop whose iteration ends after that line (the cost model puts a drain + cross-engine barrier there)
    iteration_ends: dict[int, int] = field(default_factory=dict)

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
    for ln in lines:
        ln.file = filename
    by_line: dict[int, KernelLine] = {ln.line: ln for ln in lines}
    unmatched, other = _attach_sites(sites, by_line, filename)
    _attach_dmas(dmas, prof, by_line, filename)
    executed = [ln for ln in lines if ln.sites or ln.dmas]
    new_allocs = _executed_allocs(lines, allocs)
    for i, ln in enumerate(executed):
        ln.index = i
    if unmatched:
        log.info("%d profile sites of %s are not nisa calls of the kernel source", unmatched, filename)
    if other:
        log.warning(
            "the kernel ran %d instructions from %d other file(s) (%s); this line view covers %s only -- use "
            "kernelview.file_lines or view_from_trace (run with trace=True) for a kernel split across files",
            sum(other.values()), len(other), ", ".join(sorted(other)[:3]), filename,
        )
    return KernelView(executed, buffers, dict(new_allocs), filename, unmatched, dict(other),
                      hardware_loops(source, kernel))


def _attach_sites(sites: list[dict[str, Any]], by_line: dict[int, KernelLine],
                  filename: str) -> tuple[int, dict[str, int]]:
    """Give each source line the profile sites of the kernel file on it; the sites on no ``nisa`` line and the
    instructions counted in other files (both reported, not viewed)."""
    unmatched = 0
    other: dict[str, int] = defaultdict(int)
    for s in sites:
        if s["file"] != filename:
            other[s["file"]] += s["count"]
            continue
        ln = by_line.get(s["line"])
        if ln is None:
            unmatched += 1
            continue
        ln.sites.append(s)
    return unmatched, other


def _attach_dmas(dmas: list[dict[str, Any]], prof: dict[str, Any], by_line: dict[int, KernelLine],
                 filename: str) -> None:
    """Give each source line the profile DMAs of the kernel file on it.

    A generated kernel's nki.collectives calls: the aggregate DMA of the call site (queue "cc") carries the
    call's collective record (per call), as a traced DMA does, so the cost model charges the ring, not a DMA."""
    colls = {(c["file"], c["line"]): c for c in prof.get("collectives", []) if c.get("program", 0) == 0}
    for d in dmas:
        if d["file"] != filename:
            continue
        c = colls.get((d["file"], d["line"])) if d.get("queue") == "cc" and "collective" not in d else None
        if c is not None and c.get("count"):
            n = c["count"]
            d = {**d, "collective": {"op": c["op"], "reduce": c.get("reduce"), "group_size": c["group_size"],
                                     "group": list(c["group"]), "buffer": c.get("buffer"), "dtype": c.get("dtype"),
                                     "tensors": c.get("tensors", 1), "bytes": c["bytes"] // n,
                                     "out_bytes": c["out_bytes"] // n, "lnc": prof.get("lnc", 1)}}
        ln = by_line.get(d["line"])
        if ln is not None:
            ln.dmas.append(d)


def _executed_allocs(lines: list[KernelLine], allocs: dict[int, list]) -> dict[int, list]:
    """The allocation events renumbered for the executed lines only: an event before a line the run never
    executed moves to the next executed line."""
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
    return new_allocs


@dataclass(frozen=True)
class Loop:
    """One ``for`` statement of a kernel function, as written (:func:`loops`)."""

    line: int  # the header's line number (what :attr:`KernelLine.loops` lists)
    var: str  # the loop target as written ("t", "_", "x_o_pos")
    kind: str  # the iterator's function name: "range", "dynamic_range", "affine_range", ... ("" for another iterable)
    #: the bounds: an int where the source has a literal, else the expression's text (a register, a name)
    start: int | str | None
    stop: int | str | None
    step: int | str | None
    outer: tuple[int, ...]  # header lines of the enclosing for loops, outermost first
    end_line: int  # the last line of its body

    @property
    def hardware(self) -> bool:
        """A hardware loop (``nl.dynamic_range``: the trip count known at run time), not one the trace unrolls."""
        return self.kind == "dynamic_range"

    @property
    def trips(self) -> int | None:
        """The trip count when start, stop and step are literals, else None."""
        if all(isinstance(v, int) for v in (self.start, self.stop, self.step)) and self.step:
            return max(0, -(-(self.stop - self.start) // self.step))
        return None


def _bound(node: ast.AST | None) -> int | str | None:
    if node is None:
        return None
    try:
        v = ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return ast.unparse(node)
    return v if isinstance(v, int) else ast.unparse(node)


def loops(source: str, kernel: str | None = None) -> list[Loop]:
    """The ``for`` loops of the kernel function in source order, with their kind and bounds (parsed with
    :mod:`ast`, never executed): ``range(n)`` / ``range(a, b, s)`` and the ``nl.*_range`` calls, positional or
    ``start=/stop=/step=`` arguments (a one-argument range is ``start=0, stop=n``; a missing step is 1)."""
    fn = _kernel_function(ast.parse(source), kernel)
    out: list[Loop] = []

    def visit(stmts: list[ast.stmt], outer: tuple[int, ...]) -> None:
        for st in stmts:
            if isinstance(st, ast.For):
                kind, start, stop, step = "", None, None, None
                it = st.iter
                if isinstance(it, ast.Call):
                    kind = ast.unparse(it.func).rsplit(".", 1)[-1]
                    args = list(it.args)
                    kw = {k.arg: k.value for k in it.keywords if k.arg}
                    if len(args) == 1 and "stop" not in kw:
                        args = [ast.Constant(0)] + args
                    named = dict(zip(("start", "stop", "step"), args)) | kw
                    start, stop = _bound(named.get("start")), _bound(named.get("stop"))
                    step = _bound(named["step"]) if "step" in named else 1
                    if start is None and stop is not None:
                        start = 0
                out.append(Loop(st.lineno, ast.unparse(st.target), kind, start, stop, step, outer,
                                st.end_lineno or st.lineno))
                visit(st.body, outer + (st.lineno,))
                visit(st.orelse, outer)
                continue
            for name in ("body", "orelse", "finalbody"):
                inner = getattr(st, name, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    visit(inner, outer)
            for h in getattr(st, "handlers", None) or ():
                visit(h.body, outer)

    visit(fn.body, ())
    return out


def hardware_loops(source: str, kernel: str | None = None) -> frozenset[int]:
    """Line numbers of the kernel's ``for`` statements over ``nl.dynamic_range`` (loops the hardware runs, with
    a runtime trip count, instead of loops the trace unrolls)."""
    fn = _kernel_function(ast.parse(source), kernel)
    return frozenset(st.lineno for st in ast.walk(fn)
                     if isinstance(st, ast.For) and ast.unparse(st.iter.func if isinstance(st.iter, ast.Call)
                                                                else st.iter).endswith("dynamic_range"))


def hardware_loop_bodies(source: str, kernel: str | None = None) -> dict[int, list[tuple[int, int, bool]]]:
    """Header line of every outermost ``nl.dynamic_range`` loop -> its body's direct statements as
    ``(first line, last line, simple)`` (``simple``: one call, executed once per iteration). Why: a trace has no
    loop markers; an iteration ends where the trace leaves the body or goes back to an earlier direct statement."""
    fn = _kernel_function(ast.parse(source), kernel)
    headers = hardware_loops(source, kernel)
    out: dict[int, list[tuple[int, int, bool]]] = {}

    def visit(stmts: list[ast.stmt]) -> None:
        for st in stmts:
            if isinstance(st, ast.For) and st.lineno in headers:
                out[st.lineno] = [(b.lineno, b.end_lineno or b.lineno, isinstance(b, ast.Expr)) for b in st.body]
                continue
            for name in ("body", "orelse", "finalbody"):
                inner = getattr(st, name, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    visit(inner)

    visit(fn.body)
    return out


def _statement_of(bodies: dict[int, list[tuple[int, int, bool]]], line: int) -> tuple[int, int, bool] | None:
    """(loop header, direct statement index, simple) of a kernel line inside a hardware loop's body, else None."""
    for header, stmts in bodies.items():
        for k, (a, b, simple) in enumerate(stmts):
            if a <= line <= b:
                return header, k, simple
    return None


def iteration_ends(lines: list[KernelLine], bodies: dict[int, list[tuple[int, int, bool]]],
                   kernel_file: str) -> dict[int, int]:
    """Line index -> loop header for every traced instruction that ends a hardware-loop iteration: the next
    instruction of the kernel file is outside that loop's body, or at a direct statement before (or, for a
    one-call statement, at) the one it was at. Instructions of other files (helpers) do not end an iteration."""
    out: dict[int, int] = {}
    cur: tuple[int, int, bool] | None = None
    last = -1
    for i, ln in enumerate(lines):
        if ln.file != kernel_file:
            continue
        at = _statement_of(bodies, ln.line) if bodies else None
        if cur is not None and (at is None or at[0] != cur[0] or at[1] < cur[1] or (at[1] == cur[1] and cur[2])):
            out[last] = cur[0]
        cur, last = at, i
    if cur is not None:
        out[last] = cur[0]
    return out


# ---- kernels split across several files --------------------------------------------------------------------------
@dataclass
class FileLine:
    """Everything the profile counted on one source line of any file (engine instructions and DMAs)."""

    file: str
    line: int
    opcodes: list[str]
    engines: list[str]
    count: int = 0
    elements: int = 0
    dma_count: int = 0
    dma_bytes: int = 0
    text: str = ""


def file_lines(profile: Any) -> list[FileLine]:
    """Per ``(file, line)`` totals over **every** file of the profile (a kernel calling helpers in other modules),
    with the source text from ``linecache``; ordered by file then line."""
    import linecache

    prof = profile if isinstance(profile, dict) else profile.to_dict()
    out: dict[tuple[str, int], FileLine] = {}
    for s in (_as_dict(x) for x in prof.get("sites", [])):
        fl = out.setdefault((s["file"], s["line"]), FileLine(s["file"], s["line"], [], []))
        fl.count += s["count"]
        fl.elements += s["elements"]
        if s["opcode"] not in fl.opcodes:
            fl.opcodes.append(s["opcode"])
        if s["engine"] not in fl.engines:
            fl.engines.append(s["engine"])
    for d in (_as_dict(x) for x in prof.get("dmas", [])):
        fl = out.setdefault((d["file"], d["line"]), FileLine(d["file"], d["line"], [d["opcode"]], ["dma"]))
        fl.dma_count += d["count"]
        fl.dma_bytes += d["bytes"]
    for fl in out.values():
        fl.text = linecache.getline(fl.file, fl.line).strip()
    return [out[k] for k in sorted(out)]


_EVENT_FIELDS = ("file", "line", "opcode", "engine", "partitions", "free", "dtype", "name", "inputs", "reads",
                 "writes", "partial", "buffers", "dma", "layer")


def view_from_trace(events: Iterable[Any], filename: str = "<trace>", source: str | None = None,
                    source_file: str | None = None) -> KernelView:
    """A :class:`KernelView` with one line per traced instruction (``nkisim.run(trace=True)``), in program order.

    For kernels the line view cannot describe -- loops over layers, helpers in other files, tensors passed between
    functions -- the trace is the program: each event's reads/writes are the storages it touched (so dependencies
    are real, across files and functions), its file and line attribute it, and ``layer`` is the traced layer
    variable. Regions are the instruction's ``name=`` key when it follows fusegraph's ``L<i>.<x>.<y>`` naming,
    else the file's base name. With the kernel's ``source`` (and ``source_file``, the file name its trace events
    carry), the ends of its hardware-loop iterations are marked (:attr:`KernelView.iteration_ends`)."""
    import os

    lines: list[KernelLine] = []
    buffers: dict[str, str] = {}
    for ev in events:
        e = ev if isinstance(ev, dict) else {k: getattr(ev, k) for k in _EVENT_FIELDS}
        for key, buf in e.get("buffers") or ():
            buffers.setdefault(key, buf)
        region, layer = region_of(e.get("name") or "")
        if region == "prologue":
            region = os.path.basename(e["file"])
        if e.get("layer") is not None:
            layer = e["layer"]
        by_arg: dict[str, list[str]] = defaultdict(list)
        for arg, dtype in e.get("inputs") or ():
            if dtype not in by_arg[arg]:
                by_arg[arg].append(dtype)
        site = {"file": e["file"], "line": e["line"], "opcode": e["opcode"], "engine": e["engine"], "count": 1,
                "elements": e["partitions"] * e["free"], "max_partitions": e["partitions"], "max_free": e["free"],
                "dtypes": [e["dtype"]], "names": [e["name"]] if e.get("name") else [], "input_dtypes": dict(by_arg)}
        dmas = []
        if e.get("dma"):
            dmas = [{**e["dma"], "file": e["file"], "line": e["line"], "opcode": e["opcode"], "count": 1,
                     "bytes_per_partition": e["dma"]["bytes"] // max(1, e["dma"]["partitions"]),
                     "max_bytes": e["dma"]["bytes"]}]
        lines.append(KernelLine(len(lines), e["line"], e["opcode"], e.get("name") or "", region, layer,
                                tuple(e["reads"]), tuple(e["writes"]), bool(e.get("partial")), (), [site], dmas,
                                e["file"]))
    ends: dict[int, int] = {}
    if source is not None and source_file is not None:
        ends = iteration_ends(lines, hardware_loop_bodies(source), source_file)
    return KernelView(lines, buffers, {}, filename, iteration_ends=ends)
