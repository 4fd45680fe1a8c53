"""Modeled speedup of a verified kernel over the per-op baseline of the same torch reference.

Both sides go through fusegraph's cost model (:mod:`fusegraph.perf.costmodel`) with the same sourced hardware
parameters, so the ratio is a *modeled* figure, never a measurement:

* **kernel**: the source (parsed, never executed here) joined with the profile the verification run recorded in
  the worker (:func:`fusegraph.llm.worker.cost_profile`) into a :class:`~fusegraph.perf.kernelview.KernelView`,
  list-scheduled as one instruction stream (:func:`~fusegraph.perf.costmodel.estimate`). Profiled work on lines
  the view cannot attribute to a ``nisa.*`` call of the kernel function (helpers, the high-level ``nl`` API) is
  kept, placed at the kernel statement that caused it and ordered against everything that statement names.
* **baseline**: the reference traced to ATen (:func:`fusegraph.matching.trace.trace_program`, as patterns are
  traced) and costed as fusegraph's per-op XLA-style baseline (:func:`fusegraph.perf.baselines.op_works`): every
  ATen op its own kernel, inputs loaded from and outputs stored to HBM, a boundary between ops.

LNC=2: one logical core is two physical cores. The kernel's counted work (both programs' together) is scaled to
the busier program's share — measured from the profile's per-program instruction counts when it kept every
record, else assumed to be an even split — and the baseline is assumed to split every op evenly.
"""
from __future__ import annotations

import ast
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from ..matching.trace import trace_program
from ..perf.baselines import op_costs, op_works
from ..perf.costmodel import estimate, line_work
from ..perf.kernelview import KernelLine, build_view
from ..perf.params import load_params
from .task import KernelTask

log = logging.getLogger(__name__)

SERIAL = "~unattributed"  # a pseudo variable chaining work the kernel view could not attribute to a line


@dataclass
class Speed:
    """Modeled seconds of the kernel and of the per-op baseline, and their ratio (None when not modeled)."""

    kernel_s: float | None = None
    baseline_s: float | None = None
    note: str = ""

    @property
    def speedup(self) -> float | None:
        if not self.kernel_s or self.baseline_s is None or self.kernel_s <= 0:
            return None
        return self.baseline_s / self.kernel_s

    def to_dict(self) -> dict[str, Any]:
        return {"modeled_kernel_us": None if self.kernel_s is None else round(self.kernel_s * 1e6, 3),
                "modeled_baseline_us": None if self.baseline_s is None else round(self.baseline_s * 1e6, 3),
                "modeled_speedup": None if self.speedup is None else round(self.speedup, 3), "note": self.note}


def _scale(works: list, share: float) -> list:
    """Each work item as ``share`` of itself (one core's part of work split between the cores)."""
    if share >= 1.0:
        return works
    out = []
    for w in works:
        out.append(dataclasses.replace(
            w, count=max(1, round(w.count * share)), busy=w.busy * share, nbytes=int(w.nbytes * share),
            occupancy=w.occupancy * share, own=w.own * share, ideal=w.ideal * share,
            hbm_read=int(w.hbm_read * share), hbm_write=int(w.hbm_write * share)))
    return out


def program_share(profile: dict[str, Any]) -> tuple[float, str]:
    """The busiest program's fraction of the counted work, and how it was obtained."""
    lnc = int(profile.get("lnc") or 1)
    if lnc <= 1:
        return 1.0, ""
    counts = profile.get("program_instructions")
    if isinstance(counts, list) and len(counts) == lnc and sum(counts) > 0:
        return max(counts) / sum(counts), f"LNC={lnc}: busiest program has {max(counts)} of {sum(counts)} instructions"
    return 1.0 / lnc, f"LNC={lnc}: work assumed split evenly between the programs"


def _anchors(tree: ast.Module, kernel: str) -> tuple[dict[int, ast.stmt], dict[str, ast.stmt], dict[int, tuple]]:
    """The kernel's simple statements by line, the first kernel statement through which each helper function is
    (transitively) called, and the enclosing loops of every kernel statement."""
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    kfn = funcs[kernel]
    stmts: dict[int, ast.stmt] = {}
    loops: dict[int, tuple] = {}

    def visit(body: list[ast.stmt], outer: tuple) -> None:
        for st in body:
            if isinstance(st, ast.For):
                visit(st.body, outer + (st.lineno,))
            elif isinstance(st, (ast.If, ast.With, ast.While)):
                visit(st.body, outer)
                visit(getattr(st, "orelse", []) or [], outer)
            else:
                for ln in range(st.lineno, (st.end_lineno or st.lineno) + 1):
                    stmts.setdefault(ln, st)
                loops[st.lineno] = outer

    visit(kfn.body, ())
    via: dict[str, ast.stmt] = {}
    for st in sorted(set(stmts.values()), key=lambda x: x.lineno):
        todo = [n.func.id for n in ast.walk(st) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
        while todo:
            name = todo.pop()
            if name in funcs and name != kernel and name not in via:
                via[name] = st
                todo += [n.func.id for n in ast.walk(funcs[name]) if isinstance(n, ast.Call)
                         and isinstance(n.func, ast.Name)]
    return stmts, via, loops


def _owner(tree: ast.Module, line: int) -> str | None:
    for n in tree.body:
        if isinstance(n, ast.FunctionDef) and n.lineno <= line <= (n.end_lineno or n.lineno):
            return n.name
    return None


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _place_allocs(tree: ast.Module, kernel: str, view: Any, lines: list) -> dict[int, list]:
    """The view's allocation events re-attached to the merged line order: each fresh tensor starts before the
    first line after its ``nl.ndarray`` statement (an inserted helper call may now come between)."""
    kfn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == kernel)
    at: dict[str, list[int]] = {}
    for n in ast.walk(kfn):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and len(n.targets) == 1 \
                and isinstance(n.targets[0], ast.Name) and ast.unparse(n.value.func).endswith("ndarray"):
            at.setdefault(n.targets[0].id, []).append(n.lineno)
    position = {id(ln): i for i, ln in enumerate(lines)}
    out: dict[int, list] = {}
    for i, names in view.allocs.items():
        if i >= len(view.lines):
            continue
        mine = position[id(view.lines[i])]
        for v in names:
            before = [x for x in at.get(v, []) if x < view.lines[i].line]
            j = mine
            if before:
                first = next((k for k, ln in enumerate(lines) if ln.line > max(before)), mine)
                j = min(first, mine)
            out.setdefault(j, []).append(v)
    return out


def kernel_seconds(source: str, kernel: str, profile: dict[str, Any], target: str = "trn2") -> tuple[float, str]:
    """Modeled time of one launch of ``kernel`` from its verification profile (see the module docstring).

    Profiled work the kernel view cannot attribute (helper functions, high-level ``nl`` calls) becomes extra
    lines at the kernel statement that caused it (the call of the helper), reading and writing every variable
    that statement names, so it is ordered against the rest; work with no such statement is serialised last.
    """
    hw = load_params(target)
    view = build_view(source, profile, kernel=kernel)
    tree = ast.parse(source)
    stmts, via, loops = _anchors(tree, kernel)
    attributed = {ln.line for ln in view.lines}
    extra: dict[tuple[int, int, str], KernelLine] = {}
    everything = tuple(sorted({v for ln in view.lines for v in ln.reads + ln.writes})) + (SERIAL,)
    for key in ("sites", "dmas"):
        for item in profile.get(key) or []:
            line = item.get("line")
            if item.get("file") != view.filename or line in attributed:
                continue
            owner = _owner(tree, line)
            anchor = stmts.get(line) if owner == kernel else via.get(owner or "")
            if anchor is not None:
                names = tuple(sorted(_names(anchor)))
                at, reads, writes, around = anchor.lineno, names, names, loops.get(anchor.lineno, ())
            else:
                at, reads, writes, around = 10**9, everything, (SERIAL,) + everything, ()
            k = (at, line, key)
            ln = extra.get(k)
            if ln is None:
                ln = extra[k] = KernelLine(0, at, item.get("opcode", "?"), "", "unattributed", None, reads, writes,
                                           False, around)
            (ln.sites if key == "sites" else ln.dmas).append(item)
    order = sorted([((ln.line, 0, i), ln) for i, ln in enumerate(view.lines)] +
                   [((k[0], 1, k[1]), ln) for k, ln in extra.items()], key=lambda x: x[0])
    lines = [ln for _, ln in order]
    allocs = _place_allocs(tree, kernel, view, lines)
    works = [line_work(hw, ln, i) for i, ln in enumerate(lines)]
    share, note = program_share(profile)
    notes = [note] if note else []
    if extra:
        n = sum(sum(x.get("count", 0) for x in ln.sites) + sum(d.get("count", 0) for d in ln.dmas)
                for ln in extra.values())
        notes.append(f"{n} instruction(s) on {len({k[1] for k in extra})} line(s) outside nisa calls of the kernel "
                     f"function, modeled at their call sites")
    if profile.get("truncated"):
        notes.append("profile truncated")
    est = estimate(_scale(works, share), hw, label="llm kernel", buffers=view.buffers, allocs=allocs)
    return est.seconds, "; ".join(notes)


def baseline_seconds(task: KernelTask, target: str = "trn2") -> float:
    """Modeled time of the reference as fusegraph's per-op baseline (every ATen op its own kernel)."""
    from .inputs import make_cases

    hw = load_params(target)
    _, inputs = make_cases(task)[0]
    program, _ = trace_program(task.reference, inputs, [s.name for s in task.inputs])
    works = op_works(op_costs(program), hw)
    if not works:
        return 0.0
    lnc = int(getattr(task, "lnc", 1) or 1)
    return estimate(_scale(works, 1.0 / lnc), hw, label="per-op baseline", barriers=True).seconds


def modeled_speedup(task: KernelTask, source: str, kernel: str, profile: dict[str, Any] | None,
                    target: str = "trn2") -> Speed:
    """Kernel vs per-op baseline on the cost model; never raises (a failure is the note)."""
    if not profile:
        return Speed(note="no verification profile")
    try:
        k, note = kernel_seconds(source, kernel, profile, target)
    except Exception as e:  # noqa: BLE001 - the profile and source are untrusted data; report, do not raise
        log.warning("cost model failed on the kernel for %s: %s", task.name, e)
        return Speed(note=f"kernel not modeled: {type(e).__name__}: {e}"[:300])
    try:
        b = baseline_seconds(task, target)
    except Exception as e:  # noqa: BLE001
        log.warning("per-op baseline failed for %s: %s", task.name, e)
        return Speed(kernel_s=k, note=f"baseline not modeled: {type(e).__name__}: {e}"[:300])
    if b <= 0:
        note = "; ".join(x for x in (note, "the reference launches no per-op kernel") if x)
        return Speed(kernel_s=k, baseline_s=None, note=note)
    return Speed(kernel_s=k, baseline_s=b, note=note)
