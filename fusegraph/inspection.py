"""The inspection API: capture a step and say what was captured (the seed of the fused-region report)."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from .capture.session import CaptureSession, explicit_session, last_session
from .program import InputKind, Program
from .program.ir import value_nbytes as _nbytes
from .settings import Settings


@dataclass
class Capture:
    """The result of :func:`capture_step`: the linked program of one step, how it was captured, and its outputs."""

    program: Program
    session: CaptureSession
    outputs: Any = None
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return summarize(self.session)

    def format(self) -> str:
        return format_summary(self.summary())




def summarize(session: CaptureSession) -> dict[str, Any]:
    prog = session.program
    kinds: dict[str, dict[str, int]] = {}
    for inp in prog.inputs():
        k = kinds.setdefault(inp.kind.value, {"count": 0, "bytes": 0})
        k["count"] += 1
        k["bytes"] += _nbytes(inp.shape, inp.dtype) if inp.kind != InputKind.SCALAR else 0
    ops = prog.op_counts()
    reuse = session.current_layer_traces()
    return {
        "graphs": [dict(g.to_dict(), executor=session.executors.get(g.index, "eager")) for g in prog.graphs],
        "graph_count": len(prog.graphs) + len(session.refusals),
        "breaks": [b.to_dict() for b in prog.breaks],
        "links": [l.to_dict() for l in prog.links],
        "refused": [{"graph": r.graph_index, "reason": r.reason} for r in session.refusals],
        "op_count": sum(ops.values()),
        "ops": dict(ops.most_common()),
        "inputs": kinds,
        "state_writes": {s: prog.graph.nodes[n]["op"] for g in prog.graphs for s, n in g.state_writes.items()},
        "layers": len(prog.layers()),
        "compile_seconds": round(session.compile_seconds, 3),
        "layer_calls_reusing_traces": {"calls": sum(c for c, _ in reuse.values()),
                                       "traced": sum(t for _, t in reuse.values())},
        "recompiles": len(session.superseded),
        "settings": session.settings.to_dict(),
    }


def _reuse_note(reuse: Mapping[str, int] | None) -> str:
    if not reuse or not reuse.get("calls"):
        return ""
    return f" (dynamo traced {reuse['traced']} decoder layer(s) for {reuse['calls']} layer calls)"


def format_summary(s: Mapping[str, Any]) -> str:
    lines = [f"captured {len(s['graphs'])} graph(s), {s['op_count']} ATen ops, {s['layers']} decoder layers, "
             f"compile {s['compile_seconds']:.2f} s"
             + _reuse_note(s.get("layer_calls_reusing_traces"))]
    if s.get("recompiles"):
        lines.append(f"dynamo recompiled the step {s['recompiles']} time(s) (a guard failed); this is its latest version")
    for g in s["graphs"]:
        lines.append(f"  graph {g['index']}: {g['dynamo_nodes']} dynamo nodes -> {g['aten_nodes']} ATen ops, "
                     f"{g['inputs']} inputs, {g['outputs']} outputs, executor={g['executor']}")
    for r in s["refused"]:
        lines.append(f"  graph {r['graph']}: left to eager PyTorch: {r['reason']}")
    if s["breaks"]:
        lines.append(f"graph breaks ({len(s['breaks'])}):")
        for b in s["breaks"]:
            lines.append(f"  after graph {b['after_graph']}: {b['reason']}" + (f"  [{b['user_frame']}]" if b["user_frame"] else ""))
    if s["links"]:
        free = sum(1 for l in s["links"] if l["glue_free"])
        lines.append(f"cross-graph tensor links: {len(s['links'])} ({free} glue-free)")
    lines.append("inputs by class:")
    for kind, v in sorted(s["inputs"].items()):
        lines.append(f"  {kind:<7} {v['count']:>5}  {v['bytes'] / 2**20:10.2f} MiB")
    if s["state_writes"]:
        lines.append(f"state written in place: {len(s['state_writes'])} tensors ({', '.join(sorted(set(s['state_writes'].values())))})")
    lines.append("ATen ops:")
    top = list(s["ops"].items())
    for op, n in top[:25]:
        lines.append(f"  {n:>6}  {op}")
    if len(top) > 25:
        lines.append(f"  ... {len(top) - 25} more op types")
    return "\n".join(lines)


def capture_step(fn: Callable | torch.nn.Module, *args: Any, options: Mapping[str, Any] | None = None,
            **kwargs: Any) -> Capture:
    """Compile ``fn`` with the fusegraph backend, run it once on the inputs, and return what was captured.

    Runs under ``torch.no_grad()`` (fusegraph fuses inference steps) and resets dynamo's cache first so the
    capture is fresh even if ``fn`` was compiled before.
    """
    from .backend import fusegraph_backend

    settings = Settings.from_options(options)
    session = CaptureSession(settings=settings, name="capture")
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=fusegraph_backend, options=dict(options or {}) or None, dynamic=False)
    with explicit_session(session), torch.no_grad():
        out = compiled(*args, **kwargs)
    return Capture(program=session.program, session=session, outputs=out, extra={"compiled": compiled})


def last_capture() -> Capture | None:
    """What the backend captured most recently (for code that called ``torch.compile`` itself)."""
    s = last_session()
    return Capture(program=s.program, session=s) if s else None
