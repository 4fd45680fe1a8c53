"""The capture summary of a session: graphs, breaks, links, inputs by class, ATen ops (what was captured).

It lives with the capture session, below everything that shows it: the capture API
(:meth:`fusegraph.api.Capture.summary`), the fused-region report (its ``capture`` section) and the pipeline (the
report file when the fused-region report fails).
"""
from __future__ import annotations

from typing import Any, Mapping

from ..program import InputKind
from ..program.ir import value_nbytes
from .session import CaptureSession


def summarize(session: CaptureSession) -> dict[str, Any]:
    """The session's latest program summarized as a plain dict (the report's ``capture`` section)."""
    prog = session.program
    kinds: dict[str, dict[str, int]] = {}
    for inp in prog.inputs():
        k = kinds.setdefault(inp.kind.value, {"count": 0, "bytes": 0})
        k["count"] += 1
        k["bytes"] += value_nbytes(inp.shape, inp.dtype) if inp.kind != InputKind.SCALAR else 0
    ops = prog.op_counts()
    reuse = session.current_layer_traces()
    return {
        "graphs": [dict(g.to_dict(), executor=session.executors.get(g.index, "eager")) for g in prog.graphs],
        "graph_count": len(prog.graphs) + len(session.refusals),
        "breaks": [b.to_dict() for b in prog.breaks],
        "links": [l.to_dict() for l in prog.links],
        "refused": [r.to_dict() for r in session.refusals],
        "op_count": sum(ops.values()),
        "ops": dict(ops.most_common()),
        "inputs": kinds,
        "state_writes": {s: prog.graph.nodes[n]["op"] for g in prog.graphs for s, n in g.state_writes.items()},
        "layers": len(prog.layers()),
        "compile_seconds": round(session.compile_seconds, 3),
        "layer_calls_reusing_traces": {"calls": sum(c for c, _ in reuse.values()),
                                       "traced": sum(t for _, t in reuse.values())},
        "recompiles": len(session.superseded),
        # dynamo's guard failures behind the recompiles (latest 8), position counters made dynamic (docs/capture.md)
        "recompile_reasons": session.recompiles.reasons[-8:],
        "made_dynamic": list(session.recompiles.made_dynamic),
        "settings": session.settings.to_dict(),
    }


def _reuse_note(reuse: Mapping[str, int] | None) -> str:
    if not reuse or not reuse.get("calls"):
        return ""
    return f" (dynamo traced {reuse['traced']} decoder layer(s) for {reuse['calls']} layer calls)"


def format_summary(s: Mapping[str, Any]) -> str:
    """:func:`summarize`'s dict as the text ``fusegraph report`` prints above the fused-region report."""
    lines = [f"captured {len(s['graphs'])} graph(s), {s['op_count']} ATen ops, {s['layers']} decoder layers, "
             f"compile {s['compile_seconds']:.2f} s"
             + _reuse_note(s.get("layer_calls_reusing_traces"))]
    if s.get("recompiles"):
        lines.append(f"dynamo recompiled the step {s['recompiles']} time(s) (a guard failed); this is its latest version")
    for g in s["graphs"]:
        lines.append(f"  graph {g['index']}: {g['dynamo_nodes']} dynamo nodes -> {g['aten_nodes']} ATen ops, "
                     f"{g['inputs']} inputs, {g['outputs']} outputs, executor={g['executor']}")
    for r in s["refused"]:
        size = f" ({r['ops']} dynamo ops)" if r.get("ops") else ""
        lines.append(f"  graph {r['graph']}{size}: left to eager PyTorch: {r['reason']}")
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
