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

from ..matching.analyze import Analysis
from ..matching.results import _jsonable
from ..program.ir import value_nbytes as _nbytes


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
        from .text import format_report

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
        nbytes = sum(_nbytes(G.nodes[v].get("shape"), G.nodes[v].get("dtype")) for v in values)
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
            # a break no region spans splits the step: one more launch, and every crossing tensor makes an
            # HBM round trip (written by one side, read back by the other)
            "extra_boundaries": 0 if spanned else 1,
            "hbm_round_trip_bytes": 0 if spanned else nbytes,
        })
    return out


def _execution(a: Analysis, regions: list[dict[str, Any]]) -> dict[str, Any]:
    """Who ran each region and how many kernel launches a step takes (filled in by the NKI executors)."""
    execution = getattr(a.program, "execution", {}) or {}
    executed_by: dict[int, str] = {}
    verification: dict[int, str] = {}
    kernels: list[dict[str, Any]] = []
    llm: list[dict[str, Any]] = []
    launches = 0
    for g, stats in sorted(execution.items()):
        executed_by.update(getattr(stats, "executed_by", {}))
        verification.update(getattr(stats, "verification", {}))
        run = getattr(stats, "run", None)
        planned = 0
        for k, plan in enumerate(getattr(run, "plans", []) or []):
            active = k in getattr(run, "active", ()) and not plan.disabled
            planned += active
            gen = plan.generated
            kernels.append({"graph": g, "region": plan.region.id, "name": gen.name, "active": active,
                            "cache_hit": plan.cache_hit, "codegen_seconds": round(plan.seconds, 3),
                            "lines": gen.stats.get("lines"), "instructions": gen.stats.get("instructions"),
                            "weight_chunks": gen.stats.get("chunks"), "lnc": gen.stats.get("lnc", 1),
                            "sbuf_peak_bytes": gen.budget.sbuf_peak, "sbuf_budget_bytes": gen.budget.sbuf_budget})
        islands = [i.to_dict() for i in getattr(stats, "llm", []) or []]
        llm += [dict(i, graph=g) for i in islands]
        planned += sum(1 for i in islands if (i.get("llm") or {}).get("accepted") and not i.get("disabled"))
        launches += stats.launches_per_call if getattr(stats, "calls", 0) else planned
    for r in regions:
        r["executed_by"] = executed_by.get(r["id"], "eager")
        if r["id"] in verification:
            r["verification"] = verification[r["id"]]
        reruns = sum(getattr(st, "guard_reruns", {}).get(r["id"], 0) for st in execution.values())
        if reruns:
            r["steps_recomputed_eagerly"] = reruns
    return {"kernel_launches_per_step": launches, "kernels": kernels, "llm_kernels": llm, "regions": regions}


def _ran_in_kernels(a: Analysis) -> set[str] | None:
    """Program ops that ran as part of a kernel: every op of a region whose kernel is active and not disabled
    (with its small host-side inputs, rotary tables and masks, which the region feeds the kernel by design) and
    the ops of accepted LLM-written islands; None when no kernel executor handled the step."""
    execution = getattr(a.program, "execution", {}) or {}
    if not execution:
        return None
    regions: set[int] = set()
    ran: set[str] = set()
    for stats in execution.values():
        run = getattr(stats, "run", None)
        for k, plan in enumerate(getattr(run, "plans", []) or []):
            if k in getattr(run, "active", ()) and not plan.disabled:
                regions.add(plan.region.id)
                ran |= set(plan.lowered.kernel_nodes)
        for island in getattr(stats, "llm", []) or []:
            if (island.to_dict().get("llm") or {}).get("accepted") and not island.disabled:
                ran |= set(island.nodes)
    return ran | {n for n, r in a.region_of.items() if r in regions}


def _executed(a: Analysis, ops: list[str], layer_ops: list[str], launches: int) -> dict[str, Any]:
    """Coverage and boundaries of what runs, not of what matched: a region whose kernel was refused, failed or
    was disabled by verification counts as eager ops. With no kernel executor (dry run, executor 'eager') the
    matched figures are all there is, and the report says so (``coverage_basis``)."""
    ran = _ran_in_kernels(a)
    if ran is None:
        return {"coverage": round(a.coverage, 6), "coverage_basis": "matched",
                "boundaries_per_step": len(a.regions) + a.fallback_segments()}
    G = a.program.graph
    base = layer_ops or ops
    cov = sum(1 for n in base if n in ran) / len(base) if base else 0.0
    eager = [n for n in ops if n not in ran and G.nodes[n]["op"] != "aten.alias.default"]
    segments = nx.number_connected_components(G.subgraph(eager).to_undirected(as_view=True)) if eager else 0
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


def build_report(analysis: Analysis, session: Any = None, extra: dict[str, Any] | None = None) -> Report:
    """The report dict of an analysis (plus the capture summary when the capture session is known)."""
    a = analysis
    G = a.program.graph
    ops = [n for n, d in G.nodes(data=True) if d["kind"] == "op"]
    layer_ops = [n for n in ops if G.nodes[n].get("layer") is not None]
    in_regions = sum(1 for n in ops if n in a.region_of)
    decisions = [d.to_dict() for d in a.decisions]
    counts = Counter(d["action"] for d in decisions)
    breaks = _breaks(a)
    fallback_segments = a.fallback_segments()
    execution = _execution(a, [r.to_dict() for r in a.regions])
    executed = _executed(a, ops, layer_ops, execution["kernel_launches_per_step"])
    data: dict[str, Any] = {
        "schema": SCHEMA,
        "coverage": executed["coverage"],
        "coverage_basis": executed["coverage_basis"],
        "coverage_matched": round(a.coverage, 6),
        "coverage_by_layer": {str(k): round(v, 6) for k, v in a.coverage_by_layer.items()},
        "coverage_all_ops": round(a.coverage_all, 6),
        "op_count": len(ops),
        "decoder_op_count": len(layer_ops),
        "ops_in_regions": in_regions,
        "layers": len(a.program.layers()),
        "graphs": len(a.program.graphs),
        "boundaries_per_step": executed["boundaries_per_step"],
        "boundaries_per_step_matched": len(a.regions) + fallback_segments,
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
        "settings": _jsonable(a.settings.to_dict()),
    }
    if "eager_segments" in executed:
        data["eager_segments"] = executed["eager_segments"]
    data.update(execution)
    if session is not None:
        from ..inspection import summarize

        data["capture"] = _jsonable(summarize(session))
    if extra:
        data.update(extra)
    return Report(data=data, analysis=a)


def _plugin_errors() -> dict[str, str]:
    from ..matching.pattern import REGISTRY

    return dict(REGISTRY.plugin_errors)
