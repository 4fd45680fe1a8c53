"""The fused-region report as a terminal table (rendered from the report dict only)."""
from __future__ import annotations

from typing import Any, Mapping


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _layers(layers: list[int]) -> str:
    if not layers:
        return "-"
    if layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 1:
        return f"{layers[0]}-{layers[-1]}"
    return ",".join(map(str, layers))


def _short(name: str) -> str:
    return name.split(".", 1)[1] if name.startswith("fusegraph.") else name


def _table(rows: list[list[str]], header: list[str], indent: str = "  ") -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    out = [indent + "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    out.append(indent + "  ".join("-" * w for w in widths))
    for r in rows:
        out.append(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return out


def _per_layer(counts: Mapping[str, Mapping[str, int]]) -> list[str]:
    """Pattern counts per decoder layer; identical layers are collapsed into one line."""
    layers = {k: v for k, v in counts.items() if k != "none"}
    lines = []
    groups: list[tuple[list[str], Mapping[str, int]]] = []
    for k, v in layers.items():
        if groups and dict(groups[-1][1]) == dict(v):
            groups[-1][0].append(k)
        else:
            groups.append(([k], v))
    for keys, v in groups:
        label = f"layer {keys[0]}" if len(keys) == 1 else f"layers {keys[0]}-{keys[-1]} (each)"
        lines.append(f"  {label}: " + ", ".join(f"{_short(p)} {n}" for p, n in v.items()))
    if "none" in counts:
        lines.append("  outside layers: " + ", ".join(f"{_short(p)} {n}" for p, n in counts["none"].items()))
    return lines


def _coverage_line(r: Mapping[str, Any]) -> str:
    if r.get("coverage_basis") == "executed":
        return (f"coverage: {100 * r['coverage']:.1f}% of the decoder layers' ops ran in kernels "
                f"({100 * r['coverage_matched']:.1f}% are in regions, {100 * r['coverage_all_ops']:.1f}% of all ops); "
                f"{len(r['regions'])} region(s), {r['boundaries_per_step']} boundaries per step "
                f"({r['kernel_launches_per_step']} kernel launch(es) + {r['eager_segments']} eager segment(s))")
    return (f"coverage: {100 * r['coverage']:.1f}% of the decoder layers' ops are in regions "
            f"({100 * r['coverage_all_ops']:.1f}% of all ops); {len(r['regions'])} region(s), "
            f"{r['boundaries_per_step']} boundaries (launches) per step")


def _refused_lines(refused: list[Mapping[str, Any]]) -> list[str]:
    """Graphs fusegraph did not take: uncovered (they count against coverage), with their reasons."""
    if not refused:
        return []
    lines = [f"graphs left to eager PyTorch ({len(refused)}; their ops count as uncovered):"]
    for g in refused:
        lines.append(f"  graph {g['graph']} ({g.get('ops', 0)} dynamo ops, {g.get('decoder_ops', 0)} in decoder layers): "
                     f"{g['reason']}")
    return lines


def format_report(r: Mapping[str, Any], max_unmatched: int = 30, max_decisions: int = 12) -> str:
    """The report dict ``r`` as terminal text: one section after the other, each from its own part of ``r``
    (at most ``max_unmatched`` unmatched groups and ``max_decisions`` notable decisions are listed)."""
    lines = _summary_lines(r)
    lines += _region_lines(r)
    lines.append("patterns matched per layer:")
    lines += _per_layer(r.get("pattern_counts_per_layer", {})) or ["  (none)"]
    lines += _unmatched_lines(r["unmatched"], max_unmatched)
    lines += _refused_lines(r.get("refused_graphs", []))
    lines += _break_lines(r["breaks"])
    lines += _decision_lines(r, max_decisions)
    for name, err in {**r.get("pattern_errors", {}), **r.get("plugin_errors", {})}.items():
        lines.append(f"pattern problem: {name}: {err}")
    for line in r.get("debug", []):
        lines.append(f"debug: {line}")
    return "\n".join(lines)


def _summary_lines(r: Mapping[str, Any]) -> list[str]:
    """The headline: the step's size, coverage, the kernels launched per step, LLM-written kernels, and the
    coverage per decoder layer (one line when every layer is fully covered)."""
    lines = [
        f"fused-region report: {r['layers']} decoder layers, {r['graphs']} graph(s), {r['op_count']} ATen ops"
        + (f" ({len(r['refused_graphs'])} more graph(s) refused: {r['refused_op_count']} dynamo ops uncovered)"
           if r.get("refused_graphs") else ""),
        _coverage_line(r),
    ]
    if r.get("kernels"):
        lines.append(f"kernel launches per step: {r['kernel_launches_per_step']} "
                     + "; ".join(f"{k['name']} ({k['lines']} lines, {k['weight_chunks']} weight chunks, "
                                 f"SBUF {k['sbuf_peak_bytes'] / 1024:.0f}/{k['sbuf_budget_bytes'] / 1024:.0f} KiB"
                                 f"{', cached' if k['cache_hit'] else ''}{'' if k['active'] else ', inactive'})"
                                 for k in r["kernels"]))
    for isl in r.get("llm_kernels", []):
        res = isl.get("llm") or {}
        lines.append(f"LLM kernel for {', '.join(sorted(isl['ops']))}: "
                     + ("accepted" if res.get("accepted") else f"not used ({res.get('reason')})")
                     + f" after {len(res.get('attempts', []))} attempt(s)" + (" (cache)" if res.get("from_cache") else "")
                     + (f", executed_by: {isl['executed_by']}" if isl.get("executed_by") else "")
                     + (f" inside {isl['kernel']}" if isl.get("kernel") else ""))
    per = r.get("coverage_by_layer", {})
    if per:
        low = {k: v for k, v in per.items() if v < 1.0}
        if not low:
            lines.append(f"  every layer 100% ({len(per)} layers)")
        else:
            lines.append("  per layer: " + "  ".join(f"L{k} {100 * v:.1f}%" for k, v in per.items()))
    return lines


def _region_lines(r: Mapping[str, Any]) -> list[str]:
    """The regions table (bytes in by role, bytes out, who executed each), then each region's patterns, its
    activation boundaries (first six each way) and the layout glue it absorbed."""
    if not r["regions"]:
        return []
    lines = ["regions:"]
    rows = []
    for g in r["regions"]:
        by_role = g.get("bytes_in_by_role", {})
        rows.append([
            str(g["id"]), g["kind"], _layers(g["layers"]), ",".join(map(str, g["graphs"])), str(g["op_count"]),
            str(len(g["matches"])), _size(by_role.get("weight", 0)), _size(by_role.get("state", 0)),
            _size(by_role.get("activation", 0) + by_role.get("step", 0) + by_role.get("buffer", 0)),
            _size(g["bytes_out"]), g.get("executed_by", "eager"),
        ])
    lines += _table(rows, ["id", "kind", "layers", "graphs", "ops", "matches", "weights in", "state in",
                           "act in", "out", "executed by"])
    for g in r["regions"]:
        lines.append(f"  region {g['id']} patterns: " + ", ".join(f"{_short(p)} x{n}" for p, n in g["patterns"].items()))
        acts = [b for b in g["inputs"] if b["role"] in ("activation", "step")]
        for b in acts[:6]:
            lines.append(f"    in  {b['node']} {b['shape']} {b['dtype']} ({_size(b['bytes'])}, {b['role']})")
        for b in g["outputs"][:6]:
            lines.append(f"    out {b['node']} {b['shape']} {b['dtype']} ({_size(b['bytes'])})"
                         + (" crosses a graph break" if b.get("crosses_break") else ""))
        if g["glue"]:
            lines.append("    absorbed layout glue: " + ", ".join(f"{op.split('.')[1] if op.startswith('aten.') else op} x{n}"
                                                              for op, n in g["glue"].items()))
    return lines


def _unmatched_lines(un: list[Mapping[str, Any]], max_unmatched: int) -> list[str]:
    """The unmatched op groups as a table (the first ``max_unmatched``; the JSON report has them all)."""
    if not un:
        return ["unmatched ops: none"]
    total = sum(u["count"] for u in un)
    lines = [f"unmatched ops ({total} ops in {len(un)} groups; they run on the fallback path):"]
    rows = [[str(u["count"]), u["op"], u["module"] or "-", u["reason"]] for u in un[:max_unmatched]]
    lines += _table(rows, ["count", "op", "module", "reason"])
    if len(un) > max_unmatched:
        lines.append(f"  ... {len(un) - max_unmatched} more groups (see the JSON report)")
    return lines


def _break_lines(breaks: list[Mapping[str, Any]]) -> list[str]:
    """Each graph break: what crosses it, whether Python glue computes on it, what it costs (spanned by a region,
    or an extra boundary and an HBM round trip) and dynamo's reason."""
    if not breaks:
        return ["graph breaks: none"]
    lines = [f"graph breaks ({len(breaks)}):"]
    for b in breaks:
        cost = f"+{b['extra_boundaries']} boundary, {_size(b['hbm_round_trip_bytes'])} HBM round trip"
        if b["spanned_by_regions"]:
            cost = (f"region(s) {','.join(map(str, b['spanned_by_regions']))} span it and are cut at it when run "
                    f"(each graph's part its own kernel): {cost}")
        lines.append(f"  after graph {b['after_graph']}: {b['crossing_tensors']} tensor(s), {_size(b['crossing_bytes'])} "
                     f"cross ({'glue-free' if b['glue_free'] else 'Python glue computes on them'}); {cost}")
        lines.append(f"    reason: {b['reason'][:160]}" + (f"  [{b['user_frame']}]" if b.get("user_frame") else ""))
    return lines


def _decision_lines(r: Mapping[str, Any], max_decisions: int) -> list[str]:
    """Decision counts per action, then the first ``max_decisions`` decisions worth reading: the routine merges,
    absorptions and match refusals are left to the JSON report."""
    dc = r.get("decision_counts", {})
    if not dc:
        return []
    lines = ["decisions: " + ", ".join(f"{k} {v}" for k, v in dc.items())]
    shown = [d for d in r["decisions"] if d["action"] not in ("merge", "absorb", "refuse_match")][:max_decisions]
    for d in shown:
        lines.append(f"  {d['action']}: {d['subject']}: {d['reason']}")
    return lines
