"""Merge matches into regions: attention and MLP/MoE blocks, decoder layers, the whole decoder stack.

Units are the accepted matches and single "glue" ops (layout ops, no-ops, constant sources). Every other op is a
*blocker*: an unmatched computation, or an op in ``fallback_ops``. Units merge along data edges, in topological
order, as long as the union stays convex (see :mod:`.reach`); across a dynamo graph break only where the crossing
tensor reached the next graph untouched by Python (the link is glue-free). Groups without a match are not regions
(glue alone is not worth a kernel); regions under ``min_region_size`` ops are dissolved; with
``require_full_compilation`` anything short of a single region covering every op is refused. Each merge and
refusal is logged as a :class:`~.results.Decision`.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..program import InputKind
from ..program.ir import value_nbytes as _nbytes
from ..settings import Settings
from .canonicalize import CanonicalView, is_glue, is_layout_preserving
from .matcher import _op_in
from .reach import Reach
from .results import Block, Boundary, Decision, Match, Region


log = logging.getLogger(__name__)


@dataclass
class _Group:
    id: int
    members: set[str]
    bits: int
    anc: int
    desc: int
    matches: list[Match] = field(default_factory=list)
    label: str = ""


@dataclass
class RegionResult:
    regions: list[Region]
    region_of: dict[str, int]  # original node -> region id
    outside_reason: dict[str, str]  # original node -> why it is outside every region (region-level reasons)




def form_regions(cv: CanonicalView, reach: Reach, matches: list[Match], settings: Settings,
                 decisions: list[Decision]) -> RegionResult:
    D = cv.data
    fallback = frozenset(settings.fallback_ops)
    unit_of: dict[str, int] = {}
    groups: dict[int, _Group] = {}
    blockers: dict[str, str] = {}
    canon_of_match: dict[int, set[str]] = {}
    for m in matches:
        canon = set(m.mapping.values())
        canon_of_match[m.id] = canon
        g = _Group(m.id, set(canon), reach.bits(canon), reach.ancestors(canon), reach.descendants(canon), [m], m.label())
        groups[g.id] = g
        for n in canon:
            unit_of[n] = g.id
    next_id = (max(groups) + 1) if groups else 0
    for n in cv.op_nodes:
        if n in unit_of:
            continue
        op = D.nodes[n].get("orig_op")
        if any(_op_in(cv.program.graph.nodes[o].get("op"), fallback) for o in cv.original_nodes(n)):
            blockers[n] = "forced to fallback by the fallback_ops option"
            decisions.append(Decision("fallback", n, f"{op} is listed in fallback_ops", nodes=(n,)))
            continue
        if is_glue(cv, n):
            g = _Group(next_id, {n}, reach.bits([n]), reach.ancestors([n]), reach.descendants([n]), [], f"{op}@{n}")
            groups[next_id] = g
            unit_of[n] = next_id
            next_id += 1
        else:
            blockers[n] = "unmatched"
    parent = {gid: gid for gid in groups}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    order = {n: D.nodes[n]["order"] for n in D.nodes}
    edges = sorted(((u, v) for u, v, e in D.edges(data=True)
                    if u in unit_of and v in unit_of), key=lambda e: (order[e[1]], order[e[0]]))
    # merge along edges in topological order; a merge blocked only by nodes that may still join (glue or other
    # matches) is retried after the pass, so the log keeps only refusals that are final
    pending = edges
    while pending:
        retry: list[tuple[str, str, str]] = []
        merged_any = False
        for u, v in pending:
            a, b = find(unit_of[u]), find(unit_of[v])
            if a == b:
                continue
            ga, gb = groups[a], groups[b]
            bits = ga.bits | gb.bits
            bad = (ga.anc | gb.anc) & (ga.desc | gb.desc) & ~bits
            if bad:
                w = reach.witness(bad)
                retry.append((u, v, w))
                continue
            _merge(cv, ga, gb, u, v, bits, decisions, parent, groups)
            merged_any = True
        if not merged_any:
            logged: set[tuple] = set()
            for u, v, w in retry:
                ga, gb = groups[find(unit_of[u])], groups[find(unit_of[v])]
                if ga is not gb and ga.matches and gb.matches and (ga.id, gb.id, w) not in logged:
                    logged.add((ga.id, gb.id, w))
                    why = blockers.get(w)
                    what = f"{w} ({_describe(cv, w)}{', ' + why if why else ''})"
                    decisions.append(Decision("refuse_merge", ga.label, f"merging would make {what} run both after "
                                              "and before the merged region (not convex)", other=gb.label, nodes=(u, v)))
            break
        pending = [(u, v) for u, v, _ in retry]
    for link in cv.program.links:
        if not link.glue_free:
            decisions.append(Decision("refuse_break", f"graph {link.src_graph} -> graph {link.dst_graph}",
                                      f"{link.src_node} is changed by Python code between the graphs (not glue-free); "
                                      "no region can span this break", nodes=(link.src_node, link.dst_node)))

    roots = sorted({find(g) for g in groups}, key=lambda r: min(order[n] for n in groups[r].members))
    outside_reason: dict[str, str] = {}
    kept: list[_Group] = []
    for r in roots:
        g = groups[r]
        if not g.matches:
            continue
        kept.append(g)
    # assign folded (value-identity) nodes: inside a group when their source and every consumer are
    group_of: dict[str, int] = {}
    for g in kept:
        for n in g.members:
            group_of[n] = g.id
    folded_in: dict[int, list[str]] = {g.id: [] for g in kept}
    G = cv.program.graph
    for f, src in cv.folded.items():
        if G.nodes[f]["kind"] != "op":
            continue
        cons = cv.folded_consumers.get(f, frozenset())
        gid = group_of.get(src)
        if gid is not None and all(group_of.get(c) == gid for c in cons):
            folded_in[gid].append(f)
    regions: list[Region] = []
    for g in kept:
        nodes = {o for n in g.members for o in cv.original_nodes(n)} | set(folded_in[g.id])
        op_count = sum(1 for n in nodes if G.nodes[n]["kind"] == "op")
        if settings.min_region_size > 1 and op_count < settings.min_region_size and not settings.require_full_compilation:
            decisions.append(Decision("dissolve", g.label, f"{op_count} ops < min_region_size={settings.min_region_size};"
                                      " left to the fallback path", nodes=tuple(sorted(g.members))))
            for n in nodes:
                outside_reason[n] = f"its region ({g.label}) has {op_count} ops < min_region_size={settings.min_region_size}"
            continue
        regions.append(_make_region(cv, g, nodes, len(regions)))
    if settings.require_full_compilation:
        all_ops = [n for n, d in G.nodes(data=True) if d["kind"] == "op"]
        inside = set().union(*(r.nodes for r in regions)) if regions else set()
        missing = [n for n in all_ops if n not in inside]
        if missing or len(regions) != 1:
            why = (f"{len(missing)} ops outside any region (first: {missing[0]} {G.nodes[missing[0]]['op']})" if missing
                   else f"the step forms {len(regions)} regions, not one")
            decisions.append(Decision("require_full", "step", f"require_full_compilation refused: {why}; "
                                      "the whole step runs on the fallback path"))
            for r in regions:
                for n in r.nodes:
                    outside_reason[n] = "require_full_compilation: the step is not fully fusible"
            regions = []
    region_of = {n: r.id for r in regions for n in r.nodes}
    return RegionResult(regions, region_of, outside_reason)


#: decision-log actions region formation writes (replaced when regions are formed again)
REGION_ACTIONS = frozenset({"merge", "absorb", "refuse_merge", "refuse_break", "span_break", "dissolve",
                            "require_full", "fallback"})


def with_extra_matches(analysis: Any, extra: list[Match], fuses: Any, note: str = "") -> tuple[Any, list[Match]]:
    """``analysis`` with its regions formed again over its matches plus ``extra`` (matches found after matching,
    e.g. accepted LLM-written islands). An extra match whose region holds no match ``fuses(match)`` accepts
    (nothing to fuse it with) is left out. Returns the new analysis (the old one when no extra match is used;
    coverage, unmatched ops and the decision log follow the new regions) and the extra matches used."""
    from dataclasses import replace

    from .analyze import _coverage

    extra = list(extra)
    base = [d for d in analysis.decisions if d.action not in REGION_ACTIONS]
    while extra:
        decisions = list(base)
        matches = sorted(list(analysis.matches) + extra, key=lambda m: (m.order, m.pattern.name))
        rr = form_regions(analysis.view, analysis.reach, matches, analysis.settings, decisions)
        alone = [m for m in extra if not any(any(o is m for o in r.matches) and any(fuses(o) for o in r.matches)
                                             for r in rr.regions)]
        if not alone:
            break
        extra = [m for m in extra if all(m is not a for a in alone)]
    if not extra:
        return analysis, []
    for m in extra:
        decisions.append(Decision(m.pattern.template, m.label(), note, nodes=tuple(sorted(m.nodes))))
    unmatched = [u for u in analysis.unmatched if not all(n in rr.region_of for n in u.nodes)]
    cov, by_layer, cov_all = _coverage(analysis.program, rr.region_of)
    return replace(analysis, matches=matches, regions=rr.regions, region_of=rr.region_of, decisions=decisions,
                   unmatched=unmatched, coverage=cov, coverage_by_layer=by_layer, coverage_all=cov_all), extra


def _merge(cv: CanonicalView, ga: _Group, gb: _Group, u: str, v: str, bits: int, decisions: list[Decision],
           parent: dict[int, int], groups: dict[int, _Group]) -> None:
    D = cv.data
    keep, gone = (ga, gb) if len(ga.members) >= len(gb.members) else (gb, ga)
    action = "merge" if ga.matches and gb.matches else "absorb"
    reason = ("ordering edge" if D.edges[u, v]["pos"] == frozenset({"hazard"}) else "data edge") + f" {u} -> {v}"
    if D.nodes[u]["graph"] != D.nodes[v]["graph"]:
        reason += f" across the glue-free graph break after graph {D.nodes[u]['graph']}"
        decisions.append(Decision("span_break", ga.label, f"region spans the break after graph {D.nodes[u]['graph']}"
                                  f" ({u} reaches {v} untouched by Python)", other=gb.label, nodes=(u, v)))
    decisions.append(Decision(action, ga.label, reason, other=gb.label))
    label = ga.label if ga.matches or not gb.matches else gb.label
    keep.members |= gone.members
    keep.bits = bits
    keep.anc |= gone.anc
    keep.desc |= gone.desc
    keep.matches += gone.matches
    keep.label = label
    parent[gone.id] = keep.id


def _describe(cv: CanonicalView, n: str) -> str:
    d = cv.data.nodes.get(n) if n in cv.data else None
    if d is None:
        return "Python code between graphs" if n.startswith("python-glue") else n
    return d.get("orig_op") or d["kind"]


_ROLE = {InputKind.WEIGHT: "weight", InputKind.BUFFER: "buffer", InputKind.STATE: "state", InputKind.STEP: "step",
         InputKind.SCALAR: "step", InputKind.LINKED: "activation"}


def _make_region(cv: CanonicalView, g: _Group, nodes: set[str], rid: int) -> Region:
    D = cv.data
    G = cv.program.graph
    members = g.members
    inputs: dict[str, Boundary] = {}
    outputs: dict[str, Boundary] = {}
    for n in sorted(members, key=lambda x: D.nodes[x]["order"]):
        for p in D.pred[n]:
            if p in members or D.edges[p, n]["pos"] == frozenset({"hazard"}):
                continue
            if p not in inputs:
                d = D.nodes[p]
                role = _ROLE.get(d.get("input_kind"), "activation") if d["kind"] == "input" else "activation"
                src = d.get("module") if d["kind"] == "input" and d.get("module") else (d.get("source") or d.get("module"))
                inputs[p] = Boundary(p, d.get("shape"), d.get("dtype"), _nbytes(d.get("shape"), d.get("dtype")), role, src)
        outside = [s for s in cv.data_succ(n) if s not in members]
        if outside:
            d = D.nodes[n]
            crosses = any(D.nodes[s]["kind"] == "output" and any(l.src_graph == D.nodes[s]["graph"] and
                                                                    cv.rep.get(l.src_node) == n for l in cv.program.links)
                          for s in outside)
            outputs[n] = Boundary(n, d.get("shape"), d.get("dtype"), _nbytes(d.get("shape"), d.get("dtype")),
                                  "activation", d.get("module"), crosses)
    state_writes = sorted({D.nodes[n]["writes_state"] for n in members if D.nodes[n].get("writes_state")})
    matches = sorted(g.matches, key=lambda m: m.order)
    layers = sorted({m.layer for m in matches if m.layer is not None})
    graphs = sorted({G.nodes[n]["graph"] for n in nodes})
    match_nodes = set().union(*(m.nodes for m in matches)) if matches else set()
    glue_nodes = tuple(sorted((n for n in nodes if n not in match_nodes and G.nodes[n]["kind"] == "op"),
                              key=lambda n: G.nodes[n]["order"]))
    glue = Counter(G.nodes[n]["op"] for n in glue_nodes)
    reordering = tuple(n for n in glue_nodes if not is_layout_preserving(
        G.nodes[n]["op"], G.nodes[n], next((G.nodes[p].get("shape") for p in G.pred[n]), None)))
    blocks = _blocks(cv, matches)
    kind = _region_kind(blocks, layers)
    return Region(
        id=rid, kind=kind, matches=matches, nodes=frozenset(nodes), inputs=list(inputs.values()),
        outputs=list(outputs.values()), state_writes=state_writes, layers=layers, graphs=graphs, blocks=blocks,
        glue=dict(glue), glue_nodes=glue_nodes, glue_not_layout_preserving=reordering, op_count=sum(1 for n in nodes if G.nodes[n]["kind"] == "op"),
    )


_ATTN = ("attn", "attention")
_MLP = ("mlp", "moe", "experts", "feed_forward", "ffn")


def _direct_block(m: Match, first_layer: int | None, last_layer: int | None) -> str | None:
    parts = (m.module or "").lower().split(".")
    if m.layer is None:
        if first_layer is None:
            return "fused"  # not a decoder: no layer structure to name blocks after
        block = _declared_block(m)
        if block == "embedding":
            return "embedding"
        if m.order < first_layer or block == "prologue":
            return "prologue"
        return "head" if m.order > last_layer else "misc"
    if parts and "norm" in parts[-1]:
        return None  # a norm belongs to the block it feeds (post_attention_layernorm feeds the MLP)
    if any(any(k in p for k in _ATTN) for p in parts):
        return "attention"
    if any(any(k in p for k in _MLP) for p in parts):
        return "mlp"
    return None


def _declared_block(m: Match) -> str:
    """The block the match's pattern declares (``Pattern.block``), for matches the module path cannot place."""
    return getattr(m.pattern, "block", "") or ""


def _blocks(cv: CanonicalView, matches: list[Match]) -> list[Block]:
    """Group a region's matches into per-layer blocks; norms join their consumer's block, residuals their branch's."""
    layer_orders = [m.order for m in matches if m.layer is not None]
    first = min(layer_orders) if layer_orders else None
    last = max(layer_orders) if layer_orders else None
    kind: dict[int, str | None] = {m.id: _direct_block(m, first, last) for m in matches}
    by_id = {m.id: m for m in matches}
    owner: dict[str, int] = {g: m.id for m in matches for g in m.mapping.values()}
    consumers: dict[int, list[int]] = {m.id: [] for m in matches}
    producers: dict[int, list[int]] = {m.id: [] for m in matches}
    D = cv.data
    for m in matches:
        # the matches fed by this one's outputs, looking through unmatched layout glue in between
        todo = list(m.outputs.values())
        seen = set(todo)
        while todo:
            n = todo.pop()
            for s in cv.data_succ(n):
                if s in seen:
                    continue
                seen.add(s)
                o = owner.get(s)
                if o is not None:
                    if o != m.id and o not in consumers[m.id]:
                        consumers[m.id].append(o)
                        producers[o].append(m.id)
                elif D.nodes[s]["kind"] == "op":
                    todo.append(s)
    for _ in range(3):
        for m in matches:
            if kind[m.id] is not None:
                continue
            succ = sorted((by_id[c] for c in consumers[m.id] if kind[c] and by_id[c].layer == m.layer), key=lambda x: x.order)
            pred = sorted((by_id[p] for p in producers[m.id] if kind[p] and by_id[p].layer == m.layer), key=lambda x: -x.order)
            if succ:
                kind[m.id] = kind[succ[0].id]
            elif pred:
                kind[m.id] = kind[pred[0].id]
    moe_layers = {m.layer for m in matches if _declared_block(m) == "moe"}
    blocks: dict[tuple, Block] = {}
    for m in matches:
        k = kind[m.id] or "misc"
        if k == "mlp" and m.layer in moe_layers:
            k = "moe"
        key = (m.layer if m.layer is not None else -1, k)
        blocks.setdefault(key, Block(k, m.layer, [])).matches.append(m.id)
    return sorted(blocks.values(), key=lambda b: min(by_id[i].order for i in b.matches))


def _region_kind(blocks: list[Block], layers: list[int]) -> str:
    if len(layers) >= 2:
        return "decoder_stack"
    kinds = {b.kind for b in blocks if b.layer is not None}
    if len(layers) == 1:
        if "attention" in kinds and (kinds & {"mlp", "moe"}):
            return "decoder_layer"
        if len(kinds) == 1:
            return next(iter(kinds))
        return "decoder_layer" if kinds else "fused"
    other = [b.kind for b in blocks]
    return other[0] if len(set(other)) == 1 else "fused"
