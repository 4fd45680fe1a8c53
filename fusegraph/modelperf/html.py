"""The self-contained HTML report of a compile: one file, inline CSS/SVG/JS, nothing loaded from anywhere.

Sections: headline numbers; the program graph coloured by region with unmatched ops highlighted; the fused
regions and the unmatched ops; the decision log; per-layer modeled time by engine (chart); modeled time of each
strategy against the physical limit (chart) and, where published figures exist, the calibration table; the
kernel regions with their modeled time; the top kernel source lines by modeled time with their attribution
(kernel line -> pattern -> ATen ops -> model module); the cost-model parameters with their sources.

Every input is optional except a title, so the report also renders for a capture without codegen (no kernel
sections) or a kernel without a capture (no graph).
"""
from __future__ import annotations

import html
import json
import re
from collections import defaultdict
from typing import Any, Mapping, Sequence

from ..perf.costmodel import ENGINE_LABELS
from ..perf.graphsvg import color_for, render_graph
from ..perf.measured import band_note
from ..perf.params import SOURCED
from ..report.model import build_report

ENGINE_ORDER = ("tensor", "vector", "scalar", "gpsimd", "sync", "dma")
ENGINE_COLORS = {"tensor": "#4e79a7", "vector": "#59a14f", "scalar": "#f28e2b", "gpsimd": "#b07aa1",
                 "sync": "#e15759", "dma": "#76b7b2"}

CSS = """
*{box-sizing:border-box}
body{font:13px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;background:#fafafa;color:#222}
main{max-width:1240px;margin:0 auto;padding:16px 20px 40px}
h1{font-size:21px;margin:4px 0 2px} h2{font-size:16px;margin:26px 0 8px;border-bottom:1px solid #ddd;padding-bottom:3px}
h3{font-size:14px;margin:14px 0 6px}
.sub{color:#666;margin:0 0 10px}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:10px 0}
.card{background:#fff;border:1px solid #e2e2e2;border-radius:6px;padding:8px 12px;min-width:150px}
.card b{display:block;font-size:17px} .card span{color:#666;font-size:12px}
table{border-collapse:collapse;background:#fff;width:100%;font-size:12px}
th,td{border:1px solid #e4e4e4;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f1f3f5;position:sticky;top:0} td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
.scroll{max-height:460px;overflow:auto;border:1px solid #e2e2e2}
.graph-box{overflow:auto;max-height:760px;border:1px solid #e2e2e2;background:#fff}
#program-graph .edges line{stroke:#9aa0a6;stroke-width:.6;opacity:.55}
#program-graph circle{stroke:#333;stroke-width:.4} #program-graph circle.unmatched{stroke:#7a0000;stroke-width:1.6}
#program-graph .col-title{font-size:11px;fill:#444;font-weight:600}
.legend{margin:6px 0} .key{display:inline-block;margin:0 12px 4px 0;font-size:12px}
.key i{display:inline-block;width:11px;height:11px;border-radius:50%;margin-right:4px;vertical-align:-1px;border:1px solid #555}
.note{color:#666;font-size:12px} code,pre{font:12px ui-monospace,SFMono-Regular,Menlo,monospace}
td code{white-space:pre-wrap;word-break:break-all}
#top-lines td:nth-child(3){min-width:330px}
.bad{color:#b00020;font-weight:600} .good{color:#1b7f3b;font-weight:600}
.chart{background:#fff;border:1px solid #e2e2e2;overflow-x:auto}
.chart text{font-size:10px;fill:#333}
details summary{cursor:pointer;color:#333;margin:4px 0}
"""

JS = """
(function(){
  var nodes=document.querySelectorAll('#program-graph circle');
  function paint(mode){
    nodes.forEach(function(c){c.setAttribute('fill',c.getAttribute(mode==='pattern'?'data-pattern':'data-region'));});
    document.getElementById('legend-region').hidden=(mode==='pattern');
    document.getElementById('legend-pattern').hidden=(mode!=='pattern');
  }
  document.querySelectorAll('input[name=gcolor]').forEach(function(r){r.addEventListener('change',function(){paint(r.value);});});
  document.body.setAttribute('data-rendered', String(nodes.length));
  document.body.setAttribute('data-tables', String(document.querySelectorAll('table').length));
})();
"""


def _e(s: Any) -> str:
    return html.escape("" if s is None else str(s), quote=True)


def _us(s: float | None) -> str:
    return "" if s is None else f"{s * 1e6:,.1f}"


def _ms(s: float | None) -> str:
    return "" if s is None else f"{s * 1e3:,.3f}"


def _bytes(n: float | None) -> str:
    if n is None:
        return ""
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{n:,.0f} B"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, num: Sequence[int] = (), tid: str = "",
          scroll: bool = False, raw: Sequence[int] = ()) -> str:
    """An HTML table; ``num``: right-aligned columns; ``raw``: columns already HTML."""
    head = "".join(f'<th class="num">{_e(h)}</th>' if i in num else f"<th>{_e(h)}</th>" for i, h in enumerate(headers))
    body = []
    for r in rows:
        cells = []
        for i, v in enumerate(r):
            txt = v if i in raw else _e(v)
            cells.append(f'<td class="num">{txt}</td>' if i in num else f"<td>{txt}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    t = f'<table{f" id={chr(34)}{tid}{chr(34)}" if tid else ""}><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'
    return f'<div class="scroll">{t}</div>' if scroll else t


# ---- charts ------------------------------------------------------------------------------------------------------
def layer_chart(layers: Mapping[str, Mapping[str, Any]]) -> str:
    """Grouped bars per decoder layer: busy time per engine, and the layer's wall time as a line."""
    keys = [k for k in layers if k.lstrip("-").isdigit()]
    keys.sort(key=int)
    if not keys:
        return '<p class="note">no decoder layers in this kernel</p>'
    engines = [e for e in ENGINE_ORDER if any(layers[k]["busy_s"].get(e) for k in keys)]
    walls = [layers[k]["wall_s"] for k in keys]
    vmax = max([max(walls)] + [layers[k]["busy_s"].get(e, 0.0) for k in keys for e in engines]) or 1.0
    bw = 3 if len(keys) > 16 else 7
    gw = bw * len(engines) + (6 if len(keys) > 16 else 14)
    W = max(600, 60 + gw * len(keys) + 20)
    H = 250
    plot_h = 190
    out = [f'<svg id="layer-chart" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}">']
    for t in range(5):
        v = vmax * t / 4
        y = 10 + plot_h - plot_h * t / 4
        out.append(f'<line x1="50" x2="{W - 10}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="46" y="{y + 3:.1f}" text-anchor="end">{v * 1e6:.0f}</text>')
    out.append(f'<text x="6" y="12">us</text>')
    pts = []
    for i, k in enumerate(keys):
        gx = 56 + i * gw
        for j, e in enumerate(engines):
            v = layers[k]["busy_s"].get(e, 0.0)
            h = plot_h * v / vmax
            out.append(f'<rect x="{gx + j * bw}" y="{10 + plot_h - h:.1f}" width="{bw - 0.5}" height="{h:.1f}" '
                       f'fill="{ENGINE_COLORS[e]}"><title>layer {k} {ENGINE_LABELS.get(e, e)}: {v * 1e6:.2f} us</title></rect>')
        pts.append(f"{gx + gw / 2 - 3:.1f},{10 + plot_h - plot_h * walls[i] / vmax:.1f}")
        if len(keys) <= 24 or i % 4 == 0:
            out.append(f'<text x="{gx + gw / 2 - 3:.1f}" y="{plot_h + 24}" text-anchor="middle">{k}</text>')
    out.append(f'<polyline points="{" ".join(pts)}" fill="none" stroke="#222" stroke-width="1.4"/>')
    out.append(f'<text x="{W / 2:.0f}" y="{H - 8}" text-anchor="middle">decoder layer</text></svg>')
    legend = "".join(f'<span class="key"><i style="background:{ENGINE_COLORS[e]};border-radius:2px"></i>'
                     f'{_e(ENGINE_LABELS.get(e, e))} busy</span>' for e in engines)
    legend += '<span class="key"><i style="background:#222;height:2px;border:0;vertical-align:3px"></i>layer wall time</span>'
    return f'<div class="legend">{legend}</div><div class="chart">{"".join(out)}</div>'


def strategy_chart(rows: Sequence[tuple[str, float]], limit: float | None) -> str:
    """Horizontal bars: modeled ms/token per strategy and the physical limit."""
    items = list(rows) + ([("limit: bytes / one core's DMA", limit)] if limit else [])
    if not items:
        return ""
    vmax = max(v for _, v in items) or 1.0
    W, bh = 900, 22
    H = 10 + bh * len(items) + 10
    out = [f'<svg id="strategy-chart" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}">']
    for i, (label, v) in enumerate(items):
        y = 10 + i * bh
        w = (W - 330) * v / vmax
        col = "#9c9c9c" if label.startswith("limit") else color_for(i)
        out.append(f'<text x="210" y="{y + 14}" text-anchor="end">{_e(label)}</text>'
                   f'<rect x="216" y="{y + 3}" width="{w:.1f}" height="{bh - 7}" fill="{col}"/>'
                   f'<text x="{220 + w:.1f}" y="{y + 14}">{v * 1e3:.3f} ms</text>')
    out.append("</svg>")
    return f'<div class="chart">{"".join(out)}</div>'


# ---- sections ----------------------------------------------------------------------------------------------------
def _graph_section(program: Any, analysis: Any, max_layers: int) -> str:
    if program is None:
        return '<p class="note">No captured program (the kernel was built from the model config).</p>'
    region_of = dict(getattr(analysis, "region_of", {}) or {}) if analysis is not None else {}
    pattern_of: dict[str, str] = {}
    names: dict[int, str] = {}
    unmatched: set[str] = set()
    if analysis is not None:
        for m in getattr(analysis, "matches", []) or []:
            for n in m.nodes:
                pattern_of[n] = m.pattern.name
        for r in getattr(analysis, "regions", []) or []:
            names[r.id] = r.kind
        for u in getattr(analysis, "unmatched", []) or []:
            unmatched |= set(u.nodes)
    return render_graph(program, region_of, pattern_of, names, max_layers=max_layers, unmatched=unmatched)


def _regions_section(report: Mapping[str, Any] | None) -> str:
    if not report:
        return '<p class="note">No matcher report.</p>'
    rows = []
    for r in report.get("regions", []):
        pats = ", ".join(f"{k} x{v}" for k, v in (r.get("patterns") or {}).items())
        lay = r.get("layers") or []
        lay_s = f"{lay[0]}..{lay[-1]}" if len(lay) > 2 else ", ".join(map(str, lay))
        rows.append([r.get("id"), r.get("kind"), lay_s, len(r.get("matches", [])), r.get("op_count"), pats,
                     _bytes(r.get("bytes_in")), _bytes(r.get("bytes_out"))])
    out = [table(["id", "kind", "layers", "matches", "ops", "patterns", "bytes in", "bytes out"], rows,
                 num=(3, 4, 6, 7), tid="region-table")]
    cov = report.get("coverage")
    if cov is not None:
        out.append(f'<p>coverage of decoder-layer ops: <b>{cov * 100:.1f}%</b>; kernel boundaries per step: '
                   f'<b>{report.get("boundaries_per_step", "?")}</b></p>')
    um = report.get("unmatched", [])
    out.append("<h3>Unmatched ops (run on the fallback path)</h3>")
    if um:
        out.append(table(["op", "count", "module", "reason", "layers"],
                         [[u.get("op"), u.get("count"), u.get("module"), u.get("reason"),
                           _layers_text(u.get("layers"))] for u in um], num=(1,), tid="unmatched-table",
                         scroll=True))
    else:
        out.append('<p class="good">none: every op of the step is in a region</p>')
    return "".join(out)


def _layers_text(layers: Sequence[int] | None) -> str:
    if not layers:
        return ""
    layers = list(layers)
    return f"{layers[0]}..{layers[-1]} ({len(layers)})" if len(layers) > 3 else ", ".join(map(str, layers))


def _decisions_section(report: Mapping[str, Any] | None, limit: int = 400) -> str:
    decisions = (report or {}).get("decisions", [])
    if not decisions:
        return '<p class="note">No decisions recorded.</p>'
    counts = defaultdict(int)
    for d in decisions:
        counts[d.get("action")] += 1
    head = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    rows = [[d.get("action"), d.get("subject"), d.get("other") or "", d.get("reason")] for d in decisions[:limit]]
    more = f'<p class="note">{len(decisions) - limit} more decisions in the JSON report</p>' if len(decisions) > limit else ""
    return f"<p>{_e(head)}</p>" + table(["action", "subject", "other", "reason"], rows, tid="decision-log",
                                         scroll=True) + more


def _template_key(region: str) -> str:
    return re.sub(r"^L\d+\.", "L*.", region)


def _kernel_regions_section(mk: Mapping[str, Any], attribution: Mapping[str, Any]) -> str:
    """Kernel regions (codegen instructions) aggregated over layers: modeled time per layer and bound."""
    agg: dict[str, dict[str, Any]] = {}
    for key, r in mk.get("regions", {}).items():
        t = _template_key(key)
        a = agg.setdefault(t, {"n": 0, "wall": 0.0, "busy": defaultdict(float), "dma": 0, "bytes": 0, "bounds": defaultdict(int),
                               "attr": attribution.get(key, {})})
        a["n"] += 1
        a["wall"] += r["wall_s"]
        for e, v in r["busy_s"].items():
            a["busy"][e] += v
        a["dma"] += r["dma_count"]
        a["bytes"] += r["dma_bytes"]
        a["bounds"][r["bound"]] += 1
    rows = []
    for t, a in sorted(agg.items(), key=lambda kv: -kv[1]["wall"]):
        n = a["n"]
        busy = ", ".join(f"{e} {v / n * 1e6:.1f}" for e, v in sorted(a["busy"].items(), key=lambda kv: -kv[1]) if v)
        bound = max(a["bounds"], key=a["bounds"].get)
        attr = a["attr"]
        rows.append([t, n, ", ".join(attr.get("patterns", [])), _us(a["wall"] / n), _us(a["wall"]), bound, busy,
                     a["dma"] // n, _bytes(a["bytes"] / n), ", ".join(list(attr.get("aten", {}))[:4])])
    return table(["kernel region", "instances", "pattern", "wall us / instance", "wall us total", "bound",
                  "busy us / instance", "DMAs", "bytes / instance", "ATen ops"], rows, num=(1, 3, 4, 7, 8),
                 tid="kernel-regions", scroll=True)


def _source_line(source_lines: Sequence[str], line: int | None) -> str:
    if not line or line > len(source_lines):
        return ""
    text = source_lines[line - 1].strip()
    return text if len(text) < 180 else text[:177] + "..."


def _top_lines_section(mk: Mapping[str, Any], attribution: Mapping[str, Any], source: str | None) -> str:
    src = source.splitlines() if source else []
    rows = []
    for i, r in enumerate(mk.get("top_lines", []), 1):
        a = attribution.get(r["region"], {})
        aten = ", ".join(f"{k} x{v}" for k, v in list(a.get("aten", {}).items())[:3])
        rows.append([i, r["line"], f"<code>{_e(_source_line(src, r['line']))}</code>", r["name"], r["engine"],
                     r["count"], _us(r["cost_s"]), _us(r["exposed_s"]), f"{r['bytes_per_partition']:,.0f}" if r["bytes"] else "",
                     ", ".join(a.get("patterns", [])), aten, ", ".join(a.get("modules", []))])
    return table(["#", "line", "kernel source", "instruction name", "engine", "count", "modeled us",
                  "critical-path us", "B/partition", "pattern", "ATen ops", "model module"], rows,
                 num=(0, 1, 5, 6, 7, 8), raw=(2,), tid="top-lines", scroll=True)


def _top_templates_section(mk: Mapping[str, Any], attribution: Mapping[str, Any]) -> str:
    agg_attr: dict[str, dict[str, Any]] = {}
    for key, a in attribution.items():
        agg_attr.setdefault(_template_key(key), a)
    rows = []
    for i, r in enumerate(mk.get("top_templates", []), 1):
        a = agg_attr.get(r["region"], {})
        rows.append([i, r["name"], r["opcode"], r["engine"], r["lines"], r["count"], _us(r["cost_s"]),
                     _us(r["exposed_s"]), _bytes(r["bytes"]) if r["bytes"] else "", ", ".join(a.get("patterns", [])),
                     ", ".join(list(a.get("aten", {}))[:3])])
    return table(["#", "instruction name (all layers)", "opcode", "engine", "lines", "count", "modeled us",
                  "critical-path us", "bytes", "pattern", "ATen ops"], rows, num=(0, 4, 5, 6, 7, 8),
                 tid="top-templates", scroll=True)


def _strategies_section(perf: Mapping[str, Any]) -> str:
    s = perf.get("strategies", {})
    lim = perf.get("limit", {})
    rows = []
    for k, v in s.items():
        rows.append([v["label"], v["launches_per_step"], _ms(v["seconds_per_token"]), _us(v["seconds_per_layer"]),
                     v["bound"], f"{perf['speedup'].get('megakernel_vs_' + k, 1.0):.2f}x" if k != "megakernel" else ""])
    rows.append(["physical limit (one core's DMA)", "", _ms(lim.get("one_core_seconds_per_token")),
                 _us(lim.get("one_core_seconds_per_layer")), "", ""])
    rows.append(["physical limit (chip HBM)", "", _ms(lim.get("seconds_per_token")), _us(lim.get("seconds_per_layer")),
                 "", ""])
    chart = strategy_chart([(v["label"], v["seconds_per_token"]) for v in s.values()],
                           lim.get("one_core_seconds_per_token"))
    return table(["strategy (one core, whole model)", "launches / step", "ms / token", "us / layer", "bound",
                  "megakernel speedup"], rows, num=(1, 2, 3), tid="strategy-table") + chart


def _calibration_section(lfl: Mapping[str, Any] | None) -> str:
    if not lfl:
        return '<p class="note">No published figures for this model and target.</p>'
    rows = []
    for r in lfl.get("calibration", []):
        err = r.get("error")
        rows.append([r["quantity"], r["strategy"], f"{r['modeled']:,.2f} {r['unit']}",
                     f"{r['published']:,.2f} {r['unit']}" if r.get("published") is not None else "",
                     f"{err * 100:+.0f}%" if err is not None else "", r["note"], r["source"]])
    g = lfl.get("goal", {})
    goal = ""
    if g:
        ok = g.get("met_with_cc") or g.get("met")
        cls = "good" if ok else "bad"
        goal = (f'<p>Goal (megakernel per layer &le; {g["target_us_per_layer"]:.2f} us, like for like): modeled '
                f'<b>{g["modeled_us_per_layer"]:.1f} us</b> (+ measured AllReduce: {g["modeled_us_per_layer_with_cc"]:.1f} us) '
                f'&rarr; <span class="{cls}">{"met" if ok else "missed"}</span>. Distance to the physical limit: '
                f'{g["distance_to_limit_ms_per_token"]:.3f} ms/token ({g["fraction_of_limit"] * 100:.0f}% of the '
                f'HBM-bound speed), {g["distance_to_limit_us_per_layer"]:.1f} us/layer.</p>')
    for w in lfl.get("what_if") or []:
        goal += (f'<p class="note">What-if (not a calibration): {_e(w["what_if"])} (factor {w["factor"]:.2f}) '
                 f'&rarr; {w["seconds_per_layer"] * 1e6:.1f} us per layer ({w["bound"]}-bound, goal '
                 f'{"still met" if w["met"] else "missed"}).</p>')
    sens = lfl.get("sensitivity") or []
    if sens:
        goal += "<h3>Sensitivity to the parameter ranges the sources state</h3>" + table(
            ["parameter", "value", "megakernel us / layer", "range stated in"],
            [[r["parameter"], f'{r["value"]:.3g}', f'{r["seconds_per_layer"] * 1e6:.1f}', r["range_source"]]
             for r in sens], num=(1, 2), tid="sensitivity-table")
    intro = (f'<p>Like for like: the published runs use TP={lfl["tp"]} with LNC={lfl["lnc"]} ({lfl["cores"]} physical '
             f'cores). fusegraph does not shard yet, so the modeled figures are for <b>one core\'s shard</b> '
             f'(config overrides {_e(json.dumps(lfl.get("shard_overrides", {})))}), per layer and per core.</p>')
    return intro + goal + table(["quantity", "strategy", "modeled", "published", "error", "how to read it", "source"],
                                rows, tid="calibration-table")


def _params_section(params: Sequence[Mapping[str, Any]], parameter_set: str = SOURCED) -> str:
    rows = [[p["name"], p["value"], p["unit"], p["confidence"], p["source"]] for p in params]
    return f"<p class='band'>{_e(band_note(parameter_set))}</p>" + (
        "<details><summary>cost-model parameters and their sources</summary>") + table(
        ["parameter", "value", "unit", "conf.", "source"], rows, tid="params-table") + "</details>"


def render(*, title: str, perf: Mapping[str, Any] | None = None, program: Any = None, analysis: Any = None,
           report: Mapping[str, Any] | None = None, source: str | None = None, max_layers: int = 2) -> str:
    """The report as one HTML string. ``perf``: :meth:`fusegraph.modelperf.analysis.ModelPerf.to_dict`;
    ``report``: the matcher's report dict; ``source``: the kernel source (for the top-lines table)."""
    parts = [f"<h1>{_e(title)}</h1>"]
    if perf:
        k = perf.get("kernel", {})
        s = perf.get("strategies", {})
        lim = perf.get("limit", {})
        sub = (f'target {perf["target"]}, {perf.get("layers")} layers, KV cache {perf.get("cache_len")} positions, '
               'kernel built by the capture -> match -> codegen pipeline')
        parts.append(f'<p class="sub">{_e(sub)}</p>')
        cards = [(_ms(s.get("megakernel", {}).get("seconds_per_token")) + " ms", "megakernel, modeled per token (one core)")]
        if "per_op" in s:
            cards.append((_ms(s["per_op"]["seconds_per_token"]) + " ms", "per-op XLA-style"))
        cards += [(_ms(lim.get("one_core_seconds_per_token")) + " ms", "limit: bytes / one core's DMA"),
                  (f'{k.get("dma_count", 0):,}', "DMAs per step"),
                  (f'{k.get("mean_bytes_per_partition", 0):,.0f} B', "mean bytes per partition per DMA"),
                  (f'{k.get("sbuf_peak_bytes_per_partition", 0) / 1024:,.1f} KiB', "SBUF peak per partition")]
        lfl = perf.get("like_for_like")
        if lfl and lfl.get("goal"):
            g = lfl["goal"]
            cards.append((f'{g["modeled_us_per_layer"]:.1f} us', f'per layer per core (goal {g["target_us_per_layer"]:.1f})'))
        parts.append('<div class="cards">' + "".join(f"<div class=card><b>{_e(v)}</b><span>{_e(t)}</span></div>"
                                                   for v, t in cards) + "</div>")
        for note in perf.get("notes", []):
            parts.append(f'<p class="bad">{_e(note)}</p>')
    parts.append("<h2>Program graph</h2>")
    parts.append(_graph_section(program, analysis, max_layers))
    parts.append("<h2>Fused regions</h2>")
    parts.append(_regions_section(report))
    parts.append("<h2>Decision log</h2>")
    parts.append(_decisions_section(report))
    if perf:
        mk = perf.get("megakernel", {})
        attribution = perf.get("attribution", {})
        parts.append("<h2>Modeled time per decoder layer, by engine (megakernel)</h2>")
        parts.append(layer_chart(mk.get("layers", {})))
        generic = perf.get("generic_by_cost") or []
        if generic:
            parts.append("<h2>Generic pieces by modeled cost (the next patterns to write)</h2>")
            parts.append('<p class="note">ops that run in the megakernel through generic lowering (no pattern), '
                         'ranked by the modeled time they expose</p>')
            parts.append(table(["kernel region", "ATen op", "modeled ms", "share of the step"],
                                [[g["region"], g["op"], f'{g["ms"]:.3f}', f'{g["share"] * 100:.1f}%']
                               for g in generic], num=(2, 3), tid="generic-table"))
        parts.append("<h2>Strategies on the same cost model</h2>")
        parts.append(_strategies_section(perf))
        parts.append("<h2>Calibration against published figures</h2>")
        parts.append(_calibration_section(perf.get("like_for_like")))
        parts.append("<h2>Kernel regions (codegen instructions), modeled</h2>")
        parts.append(_kernel_regions_section(mk, attribution))
        parts.append("<h2>Top kernel source lines by modeled time</h2>")
        parts.append('<p class="note">modeled us: time on the line\'s busiest resource (its engine, or DMA '
                     'bandwidth); critical-path us: how much the line extended the step. Attribution: kernel line '
                     '&rarr; instruction name &rarr; pattern &rarr; ATen ops &rarr; model module.</p>')
        parts.append(_top_lines_section(mk, attribution, source))
        parts.append("<h3>The same, grouped over layers and chunks</h3>")
        parts.append(_top_templates_section(mk, attribution))
        parts.append("<h2>Parameters</h2>")
        parts.append(_params_section(perf.get("params", []), perf.get("parameter_set", SOURCED)))
    body = "".join(parts)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{_e(title)}</title><style>{CSS}</style></head><body><main>{body}</main>"
            f"<script>{JS}</script></body></html>")


def write(path: str, **kw: Any) -> str:
    text = render(**kw)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def matcher_report(analysis: Any) -> dict[str, Any] | None:
    """The matcher's report dict for ``analysis`` (None when it cannot be built)."""
    if analysis is None:
        return None
    try:
        return build_report(analysis).data
    except Exception:  # noqa: BLE001 - the HTML still renders without the region tables
        return None


def render_perf(perf: Any, title: str | None = None, max_layers: int = 2) -> str:
    """The HTML report of a :class:`fusegraph.modelperf.analysis.ModelPerf`."""
    b = perf.build
    return render(title=title or f"fusegraph: {perf.model} decode step on {perf.target}", perf=perf.to_dict(),
                  program=perf.program, analysis=b.analysis, report=matcher_report(b.analysis),
                  source=b.generated.source, max_layers=max_layers)


def write_perf(path: str, perf: Any, **kw: Any) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_perf(perf, **kw))
    return path
