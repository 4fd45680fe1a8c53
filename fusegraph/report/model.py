"""The fused-region report: one plain dict (the JSON schema of ``docs/report.md``) built from an Analysis.

Everything the terminal table prints comes from this dict, so the table, the JSON file and the Python object can
never disagree.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from ..capture.session import CaptureSession
from ..capture.summary import summarize
from ..matching.analyze import Analysis, is_host_arithmetic
from ..matching.tensor_ops import VIEW
from ..matching.pattern import REGISTRY
from ..matching.results import jsonable
from ..program.execution import ExecutionRecord, RegionRun
from ..program.ir import value_nbytes
from .text import format_report


SCHEMA = "fusegraph.report/1"




@dataclass
class Report:
    """A fused-region report. ``to_dict()`` is the JSON document; ``format()`` the terminal table."""

    data: dict[str, Any]
    analysis: Analysis | None = field(default=None, repr=False)
    outputs: Any = field(default=None, repr=False)  # what the step returned while being explained

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.data, indent=indent, default=str)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    def format(self, **kwargs: Any) -> str:
        return format_report(self.data, **kwargs)

    def explain(self, target: str) -> list[str]:
        """Why a pattern (by name) or a program node (by id) did or did not match."""
        return self.analysis.explain(target) if self.analysis is not None else []

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    @property
    def coverage(self) -> float:
        return self.data["coverage"]

    def __str__(self) -> str:
        return self.format()


def _breaks(a: Analysis) -> list[dict[str, Any]]:
    """Each dynamo graph break: what crosses it, whether a region spans it, and what it costs."""
    prog = a.program
    G = prog.graph
    out = []
    for b in prog.breaks:
        g = b.after_graph
        crossing = [l for l in prog.links if l.src_graph <= g < l.dst_graph]
        values = sorted({l.src_node for l in crossing})
        nbytes = sum(value_nbytes(G.nodes[v].get("shape"), G.nodes[v].get("dtype")) for v in values)
        glue_free = bool(crossing) and all(l.glue_free for l in crossing)
        spanned = [r.id for r in a.regions if g in r.graphs and (g + 1) in r.graphs]
        out.append({
            "after_graph": g,
            "reason": b.reason,
            "user_frame": b.user_frame,
            "crossing_tensors": len(values),
            "crossing_bytes": nbytes,
            "glue_free": glue_free,
            "spanned_by_regions": spanned,
            # fusegraph runs each graph of a step by itself: a region across the break is cut there (each graph's
            # part its own kernel, executors.kernels), so every break is one more launch and every crossing tensor
            # an HBM round trip (written by one side, read back by the other)
            "extra_boundaries": 1,
            "hbm_round_trip_bytes": nbytes,
        })
    return out


def _records(a: Analysis) -> list[ExecutionRecord]:
    """The executors' records of the program's graphs, in graph order (none: no kernel executor ran it)."""
    return [rec for _, rec in sorted(a.program.execution.items())]


def _kernel_entry(rec: ExecutionRecord, run: RegionRun) -> dict[str, Any]:
    k = run.kernel
    return {"graph": rec.graph, "region": run.region_id, "name": k.name, "active": run.runs_kernel,
            "cache_hit": k.cache_hit, "codegen_seconds": round(k.codegen_seconds, 3), "lines": k.lines,
            "instructions": k.instructions, "weight_chunks": k.weight_chunks, "lnc": k.lnc,
            "sbuf_peak_bytes": k.sbuf_peak_bytes, "sbuf_budget_bytes": k.sbuf_budget_bytes}


def _execution(a: Analysis, regions: list[dict[str, Any]]) -> dict[str, Any]:
    """Who ran each region and how many kernel launches a step takes (from the executors' records)."""
    records = _records(a)
    executed_by: dict[int, str] = {}
    verification: dict[int, str] = {}
    reruns: Counter = Counter()
    kernels: list[dict[str, Any]] = []
    llm: list[dict[str, Any]] = []
    launches = 0
    for rec in records:
        executed_by.update(rec.executed_by)
        verification.update(rec.verification)
        reruns.update(rec.guard_reruns)
        kernels += [_kernel_entry(rec, run) for run in rec.regions]
        llm += [dict(i.to_dict(), graph=rec.graph) for i in rec.llm]
        launches += rec.launches_per_call if rec.calls else rec.planned_launches()
    for r in regions:
        r["executed_by"] = executed_by.get(r["id"], "eager")
        if r["id"] in verification:
            r["verification"] = verification[r["id"]]
        if reruns[r["id"]]:
            r["steps_recomputed_eagerly"] = reruns[r["id"]]
    return {"kernel_launches_per_step": launches, "kernels": kernels, "llm_kernels": llm, "regions": regions}


def _ran_in_kernels(a: Analysis) -> set[str] | None:
    """Program ops that ran as part of a kernel: every op of a region whose kernel is active and not disabled
    (with its small host-side inputs, rotary tables and masks, which the region feeds the kernel by design) and
    the ops of accepted LLM-written islands; None when no kernel executor handled the step."""
    records = _records(a)
    if not records:
        return None
    ran: set[str] = set()
    for rec in records:
        for run in rec.regions:
            if run.runs_kernel:
                ran |= run.kernel_nodes | run.host_nodes
        for island in rec.llm:
            if island.runs_kernel:
                ran |= set(island.nodes)
    return ran


@dataclass(frozen=True)
class _Refused:
    """What graphs fusegraph refused leave uncovered: they run eagerly, each one more eager segment per step."""

    graphs: list[dict[str, Any]]
    ops: int = 0
    decoder_ops: int = 0

    @classmethod
    def of(cls, session: CaptureSession | None) -> "_Refused":
        graphs = [r.to_dict() for r in (session.refusals if session is not None else [])]
        return cls(graphs, sum(g["ops"] for g in graphs), sum(g["decoder_ops"] for g in graphs))

    def coverage(self, ops: list[str], layer_ops: list[str], inside: Any, default: float) -> float:
        """The fraction of the decoder layers' ops (all ops when the step has none in layers) for which
        ``inside(node)`` holds, a refused graph's ops counting as outside; ``default`` when there is no op."""
        if layer_ops or self.decoder_ops:
            base, extra = layer_ops, self.decoder_ops
        else:
            base, extra = ops, self.ops
        total = len(base) + extra
        return sum(1 for n in base if inside(n)) / total if total else default

    def all_ops_coverage(self, ops: list[str], inside: Any, default: float) -> float:
        total = len(ops) + self.ops
        return sum(1 for n in ops if inside(n)) / total if total else default


#: ops that launch nothing when they run outside a kernel: views are metadata (clone/contiguous copy: not here)
_METADATA_ONLY = (VIEW - {"aten.clone.default", "aten.contiguous.default", "aten.lift_fresh_copy.default"}) | {
    "aten.alias.default"}


def _executed(a: Analysis, ops: list[str], layer_ops: list[str], launches: int, refused: _Refused) -> dict[str, Any]:
    """Coverage and boundaries of what runs, not of what matched: a region whose kernel was refused, failed or
    was disabled by verification counts as eager ops, and so does every op of a graph fusegraph refused. With no
    kernel executor (dry run, executor 'eager') the matched figures are all there is, and the report says so
    (``coverage_basis``)."""
    ran = _ran_in_kernels(a)
    if ran is None:
        return {"coverage": round(refused.coverage(ops, layer_ops, a.region_of.__contains__, a.coverage), 6),
                "coverage_basis": "matched",
                "boundaries_per_step": a.region_launches + a.fallback_segments() + len(refused.graphs)}
    G = a.program.graph
    cov = refused.coverage(ops, layer_ops, ran.__contains__, 0.0)
    # not a launch: a size's arithmetic (the host's, like launch arguments) or a view (metadata, no data moves)
    eager = [n for n in ops if n not in ran and G.nodes[n]["op"] not in _METADATA_ONLY
             and not is_host_arithmetic(G.nodes[n])]
    segments = nx.number_connected_components(G.subgraph(eager).to_undirected(as_view=True)) if eager else 0
    segments += len(refused.graphs)
    return {"coverage": round(cov, 6), "coverage_basis": "executed", "boundaries_per_step": launches + segments,
            "eager_segments": segments}


def _layer_counts(a: Analysis) -> dict[str, dict[str, int]]:
    per: dict[str, Counter] = {}
    for m in a.matches:
        key = str(m.layer) if m.layer is not None else "none"
        per.setdefault(key, Counter())[m.pattern.name] += 1
    return {k: dict(sorted(v.items())) for k, v in sorted(per.items(), key=lambda kv: (kv[0] == "none", _int(kv[0])))}


def _int(s: str) -> int:
    try:
        return int(s)
    except ValueError:
        return 1 << 30


def build_report(analysis: Analysis, session: CaptureSession | None = None, extra: dict[str, Any] | None = None) -> Report:
    """The report dict of an analysis (plus the capture summary when the capture session is known)."""
    a = analysis
    G = a.program.graph
    ops = [n for n, d in G.nodes(data=True) if d["kind"] == "op"]
    layer_ops = [n for n in ops if G.nodes[n].get("layer") is not None]
    in_regions = sum(1 for n in ops if n in a.region_of)
    decisions = [d.to_dict() for d in a.decisions]
    counts = Counter(d["action"] for d in decisions)
    breaks = _breaks(a)
    refused = _Refused.of(session)
    fallback_segments = a.fallback_segments() + len(refused.graphs)
    execution = _execution(a, [r.to_dict() for r in a.regions])
    executed = _executed(a, ops, layer_ops, execution["kernel_launches_per_step"], refused)
    data: dict[str, Any] = {
        "schema": SCHEMA,
        "coverage": executed["coverage"],
        "coverage_basis": executed["coverage_basis"],
        "coverage_matched": round(refused.coverage(ops, layer_ops, a.region_of.__contains__, a.coverage), 6),
        "coverage_by_layer": {str(k): round(v, 6) for k, v in a.coverage_by_layer.items()},
        "coverage_all_ops": round(refused.all_ops_coverage(ops, a.region_of.__contains__, a.coverage_all), 6),
        "refused_graphs": refused.graphs,
        "refused_op_count": refused.ops,
        "op_count": len(ops),
        "decoder_op_count": len(layer_ops),
        "ops_in_regions": in_regions,
        "layers": len(a.program.layers()),
        "graphs": len(a.program.graphs),
        "boundaries_per_step": executed["boundaries_per_step"],
        "boundaries_per_step_matched": a.region_launches + fallback_segments,
        "fallback_segments": fallback_segments,
        "regions": execution.pop("regions"),
        "unmatched": [u.to_dict() for u in a.unmatched],
        "breaks": breaks,
        "pattern_counts": a.pattern_counts(),
        "pattern_counts_per_layer": _layer_counts(a),
        "matches": [m.to_dict() for m in a.matches],
        "decisions": decisions,
        "decision_counts": dict(sorted(counts.items())),
        "patterns": [p.to_dict() for p in a.patterns],
        "pattern_errors": dict(a.pattern_errors),
        "disabled_patterns": dict(a.disabled_patterns),
        "plugin_errors": _plugin_errors(),
        "debug": list(a.debug),
        "timings": {k: round(v, 4) for k, v in a.timings.items()},
        "settings": jsonable(a.settings.to_dict()),
    }
    if "eager_segments" in executed:
        data["eager_segments"] = executed["eager_segments"]
    data.update(execution)
    if session is not None:
        data["capture"] = jsonable(summarize(session))
    if extra:
        data.update(extra)
    return Report(data=data, analysis=a)


def _plugin_errors() -> dict[str, str]:
    return dict(REGISTRY.plugin_errors)
