"""Inline SVG of the program graph, coloured by region, unmatched ops highlighted (no graphviz, no network).

Layout: one column per decoder layer shown (plus the ops before and after the layers), and inside a column a
layered layout — rank = longest path from the column's sources, order within a rank by the barycenter of the
predecessors — which keeps a 1280-px-wide page readable for any number of layers (only ``max_layers`` layers
are drawn; decoder layers repeat, and the tables cover all of them).
"""
from __future__ import annotations

import html
from collections import defaultdict
from typing import Any, Iterable

DX, DY, R = 13, 15, 4.5
COL_GAP = 34
TOP = 34
PALETTE = ["#4e79a7", "#59a14f", "#f28e2b", "#b07aa1", "#76b7b2", "#edc948", "#9c755f", "#ff9da7", "#86bcb6",
           "#8cd17d", "#a0cbe8", "#ffbe7d", "#d4a6c8", "#bab0ac", "#499894", "#e15759"]
UNMATCHED = "#d62728"
GLUE = "#c7c7c7"


def _esc(s: Any) -> str:
    return html.escape(str(s), quote=True)


def color_for(i: int) -> str:
    return PALETTE[i % (len(PALETTE) - 1)]  # the last palette colour is reserved-looking red: skip it


def _columns(G: Any, ops: list[str], max_layers: int) -> tuple[list[tuple[str, list[str]]], int]:
    layers = sorted({G.nodes[n].get("layer") for n in ops if G.nodes[n].get("layer") is not None})
    shown = layers[:max_layers]
    first_layer_order = min((G.nodes[n]["order"] for n in ops if G.nodes[n].get("layer") is not None), default=0)
    pre, post = [], []
    by_layer: dict[int, list[str]] = defaultdict(list)
    for n in ops:
        lay = G.nodes[n].get("layer")
        if lay is None:
            (pre if G.nodes[n]["order"] < first_layer_order else post).append(n)
        elif lay in shown:
            by_layer[lay].append(n)
    cols: list[tuple[str, list[str]]] = []
    if pre:
        cols.append(("before the layers", pre))
    cols += [(f"layer {lay}", by_layer[lay]) for lay in shown]
    if post:
        cols.append(("after the layers", post))
    return cols, len(layers) - len(shown)


def _rank(G: Any, nodes: list[str]) -> dict[str, int]:
    inside = set(nodes)
    rank: dict[str, int] = {}
    for n in sorted(nodes, key=lambda n: G.nodes[n]["order"]):
        preds = [p for p in G.predecessors(n) if p in inside and p in rank]
        rank[n] = 1 + max((rank[p] for p in preds), default=-1)
    return rank


def render_graph(program: Any, region_of: dict[str, int], pattern_of: dict[str, str] | None = None,
                 region_names: dict[int, str] | None = None, max_layers: int = 2, unmatched: Iterable[str] = ()) -> str:
    """The SVG (a string) of ``program``'s op nodes. ``region_of``: node -> region id; nodes of no region are
    unmatched unless they are pure views (drawn grey). ``pattern_of``: node -> pattern name (tooltips and the
    "colour by pattern" view)."""
    G = program.graph
    pattern_of = pattern_of or {}
    region_names = region_names or {}
    ops = [n for n in program.topo_order() if G.nodes[n].get("kind") == "op"]
    cols, hidden = _columns(G, ops, max_layers)
    unmatched = set(unmatched)
    patterns = sorted({p for p in pattern_of.values() if p})
    pat_color = {p: color_for(i) for i, p in enumerate(patterns)}
    regions = sorted({r for r in region_of.values()})
    reg_color = {r: color_for(i) for i, r in enumerate(regions)}
    pos, heads, total_w, height = _layout(G, cols)
    out = [f'<svg id="program-graph" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {total_w:.0f} {height + 10:.0f}" '
           f'width="{total_w:.0f}" height="{height + 10:.0f}" role="img" aria-label="program graph">']
    for x, title in heads:
        out.append(f'<text class="col-title" x="{x:.0f}" y="16">{_esc(title)}</text>')
    out.append('<g class="edges">')
    out += _edge_lines(G, pos)
    out.append("</g><g class=\"nodes\">")
    for n, (x, y) in pos.items():
        d = G.nodes[n]
        rid = region_of.get(n)
        pat = pattern_of.get(n, "")
        op = str(d.get("op", ""))
        cls, fill, pfill = _node_style(op, rid, n in unmatched, reg_color.get(rid), pat_color.get(pat, GLUE))
        where = f"region {rid} ({region_names.get(rid, '')})" if rid is not None else "no region"
        tip = f"{n}  {op}\n{d.get('module') or ''}\n{where}" + (f"\npattern {pat}" if pat else "")
        out.append(f'<circle class="{cls}" cx="{x:.1f}" cy="{y:.1f}" r="{R}" fill="{fill}" data-region="{fill}" '
                   f'data-pattern="{pfill}"><title>{_esc(tip)}</title></circle>')
    out.append("</g></svg>")
    note = f"{hidden} more decoder layers not drawn (same structure; see the tables)" if hidden else ""
    legend = [(f"region {r}: {region_names.get(r, '')}", reg_color[r]) for r in regions]
    legend += [("unmatched op (fallback path)", UNMATCHED), ("view / glue outside regions", GLUE)]
    pat_legend = [(p, c) for p, c in pat_color.items()]
    return _wrap("".join(out), legend, pat_legend, note)


def _layout(G: Any, cols: list[tuple[str, list[str]]]) -> tuple[dict[str, tuple[float, float]], list[tuple[float, str]],
                                                                float, float]:
    """Node positions, column titles (x, title), total width and height: the columns side by side, each a
    layered layout (rows by rank, each row ordered by its predecessors' barycenter)."""
    ranked = []
    slots = 0
    for title, nodes in cols:
        rank = _rank(G, nodes)
        rows: dict[int, list[str]] = defaultdict(list)
        for n in sorted(nodes, key=lambda n: G.nodes[n]["order"]):
            rows[rank[n]].append(n)
        ranked.append((title, rows))
        slots += max((len(r) for r in rows.values()), default=1)
    # spread the columns over ~1200 px when they are narrow (never closer than DX)
    dx = max(DX, min(3 * DX, (1200 - COL_GAP * len(cols)) / max(1, slots)))
    pos: dict[str, tuple[float, float]] = {}
    heads = []
    x0 = 10.0
    height = TOP
    for title, rows in ranked:
        width = _place_column(G, rows, x0, dx, pos)
        heads.append((x0, title))
        height = max(height, TOP + (max(rows) + 1 if rows else 1) * DY)
        x0 += max(width * dx, 8.0 * len(title)) + COL_GAP
    return pos, heads, max(x0, 200.0), height


def _place_column(G: Any, rows: dict[int, list[str]], x0: float, dx: float, pos: dict[str, tuple[float, float]]) -> int:
    """Place one column's rows into ``pos`` (each row sorted by the barycenter of its nodes' already placed
    predecessors, which keeps edges short); the column's width in nodes."""
    width = 1
    local: dict[str, float] = {}

    def bary(n: str) -> float:
        ps = [local[p] for p in G.predecessors(n) if p in local]
        return sum(ps) / len(ps) if ps else 0.0

    for r in sorted(rows):
        row = rows[r]
        row.sort(key=bary)
        for i, n in enumerate(row):
            local[n] = i
            pos[n] = (x0 + i * dx + R, TOP + r * DY + R)
        width = max(width, len(row))
    return width


def _edge_lines(G: Any, pos: dict[str, tuple[float, float]]) -> list[str]:
    """One SVG line per edge between drawn nodes."""
    out = []
    for n in pos:
        x2, y2 = pos[n]
        for p in G.predecessors(n):
            if p in pos:
                x1, y1 = pos[p]
                out.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}"/>')
    return out


def _node_style(op: str, rid: int | None, listed_unmatched: bool, region_fill: str | None,
                pattern_fill: str) -> tuple[str, str, str]:
    """(CSS class, region-view fill, pattern-view fill) of a node: an op outside every region is unmatched (red)
    unless it is a pure view (grey glue) and not listed as unmatched."""
    is_view = op.split(".")[1] in _VIEWISH if op.startswith("aten.") and len(op.split(".")) > 2 else op == "getitem"
    if rid is None and (listed_unmatched or not is_view):
        return "node unmatched", UNMATCHED, UNMATCHED
    if rid is None:
        return "node glue", GLUE, GLUE
    return "node", region_fill, pattern_fill


_VIEWISH = frozenset({"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "t", "transpose",
                      "permute", "slice", "select", "alias", "detach", "split", "unbind", "as_strided"})


def _wrap(svg: str, legend: list[tuple[str, str]], pat_legend: list[tuple[str, str]], note: str) -> str:
    items = "".join(f'<span class="key"><i style="background:{c}"></i>{_esc(t)}</span>' for t, c in legend)
    pitems = "".join(f'<span class="key"><i style="background:{c}"></i>{_esc(t)}</span>' for t, c in pat_legend)
    return (
        '<div class="graph-controls">colour by: '
        '<label><input type="radio" name="gcolor" value="region" checked> region</label> '
        '<label><input type="radio" name="gcolor" value="pattern"> pattern</label></div>'
        f'<div class="legend" id="legend-region">{items}</div>'
        f'<div class="legend" id="legend-pattern" hidden>{pitems}</div>'
        f'<div class="graph-box">{svg}</div>'
        + (f'<p class="note">{_esc(note)}</p>' if note else "")
    )
