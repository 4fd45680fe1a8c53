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




#: value-identity ops that copy data (views are metadata and launch nothing outside a kernel)
_COPIES = frozenset({"aten.clone.default", "aten.contiguous.default", "aten.lift_fresh_copy.default"})


def form_regions(cv: CanonicalView, reach: Reach, matches: list[Match], settings: Settings,
                 decisions: list[Decision]) -> RegionResult:
    """Merge ``matches`` and the glue ops between them into regions, appending every merge and refusal to
    ``decisions`` (see the module docstring for the rules)."""
    return _RegionFormation(cv, reach, settings, decisions).run(matches)


class _RegionFormation:
    """One run of region formation, split into its steps. The state the steps share: the units (``groups``, by id),
    the unit of each canonical op (``unit_of``), the union-find forest over units (``parent``), the ops that block
    merging and why (``blockers``), why ops ended outside every region (``outside_reason``) and the decision log."""

    def __init__(self, cv: CanonicalView, reach: Reach, settings: Settings, decisions: list[Decision]) -> None:
        self.cv = cv
        self.reach = reach
        self.settings = settings
        self.decisions = decisions
        self.groups: dict[int, _Group] = {}
        self.unit_of: dict[str, int] = {}
        self.blockers: dict[str, str] = {}
        self.parent: dict[int, int] = {}
        self.outside_reason: dict[str, str] = {}
        self.order = {n: cv.data.nodes[n]["order"] for n in cv.data.nodes}

    def run(self, matches: list[Match]) -> RegionResult:
        """The steps in order: units, merging, graph-break refusals, regions, the full-compilation check."""
        self.seed_matches(matches)
        self.seed_ops()
        self.parent = {gid: gid for gid in self.groups}
        self.merge_along_edges()
        self.merge_islands()
        self.log_unlinked_breaks()
        kept = self.matched_groups()
        regions = self.make_regions(kept, self.folded_inside(kept))
        if self.settings.require_full_compilation:
            regions = self.require_full(regions)
        region_of = {n: r.id for r in regions for n in r.nodes}
        return RegionResult(regions, region_of, self.outside_reason)

    def seed_matches(self, matches: list[Match]) -> None:
        """One unit per accepted match (id = the match's id), over the canonical nodes it maps to."""
        reach = self.reach
        for m in matches:
            canon = set(m.mapping.values())
            g = _Group(m.id, set(canon), reach.bits(canon), reach.ancestors(canon), reach.descendants(canon), [m],
                       m.label())
            self.groups[g.id] = g
            for n in canon:
                self.unit_of[n] = g.id

    def seed_ops(self) -> None:
        """Classify every op no match covers: forced to fallback (a blocker, logged), glue (a unit of its own, so it
        can be absorbed into a region) or unmatched computation (a blocker). Glue unit ids follow the match ids."""
        cv, reach, D = self.cv, self.reach, self.cv.data
        fallback = frozenset(self.settings.fallback_ops)
        next_id = (max(self.groups) + 1) if self.groups else 0
        for n in cv.op_nodes:
            if n in self.unit_of:
                continue
            op = D.nodes[n].get("orig_op")
            if any(_op_in(cv.program.graph.nodes[o].get("op"), fallback) for o in cv.original_nodes(n)):
                self.blockers[n] = "forced to fallback by the fallback_ops option"
                self.decisions.append(Decision("fallback", n, f"{op} is listed in fallback_ops", nodes=(n,)))
                continue
            if is_glue(cv, n):
                g = _Group(next_id, {n}, reach.bits([n]), reach.ancestors([n]), reach.descendants([n]), [], f"{op}@{n}")
                self.groups[next_id] = g
                self.unit_of[n] = next_id
                next_id += 1
            else:
                self.blockers[n] = "unmatched"

    def find(self, x: int) -> int:
        """The root of unit ``x`` in the union-find forest (with path halving)."""
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def merge_along_edges(self) -> None:
        """Merge units along the edges between them, in topological order. A merge blocked only by nodes that may
        still join (glue or other matches) is retried after a pass that merged something, so the log keeps only
        refusals that are final: those left when a pass merges nothing."""
        order, unit_of = self.order, self.unit_of
        pending = sorted(((u, v) for u, v, e in self.cv.data.edges(data=True) if u in unit_of and v in unit_of),
                         key=lambda e: (order[e[1]], order[e[0]]))
        while pending:
            retry, merged_any = self.merge_pass(pending)
            if not merged_any:
                self.log_refused_merges(retry)
                break
            pending = [(u, v) for u, v, _ in retry]

    def merge_islands(self) -> None:
        """Merge each small matched unit that no edge links to any other unit (a state counter's ``+= 1`` that
        nothing in the step reads: xLSTM's ``seqlen_offset``) into the largest matched unit of its graph, when the
        union stays convex. Nothing orders the two, so one kernel can do both; left apart, the small unit would be
        dissolved (``min_region_size``) and run as an eager launch of its own."""
        D, unit_of = self.cv.data, self.unit_of
        roots = {self.find(g) for g in self.groups}
        matched = [self.groups[r] for r in roots if self.groups[r].matches]
        for g in sorted(matched, key=lambda g: len(g.members)):
            if self.find(g.id) != g.id or len(g.members) >= max(self.settings.min_region_size, 2):
                continue
            linked = {self.find(unit_of[x]) for n in g.members for x in (*D.predecessors(n), *D.successors(n))
                      if x in unit_of}
            if linked - {g.id}:
                continue
            graph = D.nodes[next(iter(g.members))]["graph"]
            hosts = [h for h in (self.groups[r] for r in {self.find(m.id) for m in matched}) if h is not g
                     and self.find(h.id) == h.id and D.nodes[next(iter(h.members))]["graph"] == graph]
            for h in sorted(hosts, key=lambda h: -len(h.members)):
                bits = g.bits | h.bits
                if (g.anc | h.anc) & (g.desc | h.desc) & ~bits:
                    continue
                self.decisions.append(Decision("merge", h.label, "independent of it (no edge between them): one "
                                               "kernel computes both", other=g.label))
                _union(h, g, bits, h.label, self.parent)
                break

    def merge_pass(self, pending: list[tuple[str, str]]) -> tuple[list[tuple[str, str, str]], bool]:
        """One pass over ``pending`` edges: merge the two units of each edge when their union stays convex.
        Returns the refused edges with a witness (a node outside that would run both after and before the union)
        and whether anything merged."""
        retry: list[tuple[str, str, str]] = []
        merged_any = False
        for u, v in pending:
            a, b = self.find(self.unit_of[u]), self.find(self.unit_of[v])
            if a == b:
                continue
            ga, gb = self.groups[a], self.groups[b]
            bits = ga.bits | gb.bits
            bad = (ga.anc | gb.anc) & (ga.desc | gb.desc) & ~bits
            if bad:
                retry.append((u, v, self.reach.witness(bad)))
                continue
            _merge(self.cv, ga, gb, u, v, bits, self.decisions, self.parent, self.groups)
            merged_any = True
        return retry, merged_any

    def log_refused_merges(self, retry: list[tuple[str, str, str]]) -> None:
        """Log the final convexity refusals between two units that both hold matches (glue that stays apart is not
        worth a line), once per pair of units and witness."""
        logged: set[tuple] = set()
        for u, v, w in retry:
            ga, gb = self.groups[self.find(self.unit_of[u])], self.groups[self.find(self.unit_of[v])]
            if ga is not gb and ga.matches and gb.matches and (ga.id, gb.id, w) not in logged:
                logged.add((ga.id, gb.id, w))
                why = self.blockers.get(w)
                what = f"{w} ({_describe(self.cv, w)}{', ' + why if why else ''})"
                self.decisions.append(Decision("refuse_merge", ga.label, f"merging would make {what} run both after "
                                               "and before the merged region (not convex)", other=gb.label,
                                               nodes=(u, v)))

    def log_unlinked_breaks(self) -> None:
        """Log each graph break that no region can span because Python changed the crossing tensor (the canonical
        view follows glue-free links only, so no merge was ever tried across it)."""
        for link in self.cv.program.links:
            if not link.glue_free:
                self.decisions.append(Decision(
                    "refuse_break", f"graph {link.src_graph} -> graph {link.dst_graph}",
                    f"{link.src_node} is changed by Python code between the graphs (not glue-free); "
                    "no region can span this break", nodes=(link.src_node, link.dst_node)))

    def matched_groups(self) -> list[_Group]:
        """The merged units that hold at least one match, in program order of their first node: the region
        candidates (glue alone is not worth a kernel)."""
        order = self.order
        roots = sorted({self.find(g) for g in self.groups}, key=lambda r: min(order[n] for n in self.groups[r].members))
        return [self.groups[r] for r in roots if self.groups[r].matches]

    def folded_inside(self, kept: list[_Group]) -> dict[int, list[str]]:
        """The folded (value-identity) op nodes each kept group takes in: those whose every consumer is inside it
        and whose source is inside it too, or is a copy of a value no group computes (``input_ids.clone()`` before
        an in-place edit, read only by the kernel). Canonicalization hid them from merging, but they run, so they
        belong to a region: left outside, a copy would be an eager launch whose result only the kernel reads."""
        group_of: dict[str, int] = {}
        for g in kept:
            for n in g.members:
                group_of[n] = g.id
        folded_in: dict[int, list[str]] = {g.id: [] for g in kept}
        G = self.cv.program.graph
        for f, src in self.cv.folded.items():
            if G.nodes[f]["kind"] != "op":
                continue
            cons = self.cv.folded_consumers.get(f, frozenset())
            gid = group_of.get(src)
            if gid is None and src not in group_of and G.nodes[f]["op"] in _COPIES and cons:
                gid = group_of.get(next(iter(cons)))
            if gid is not None and all(group_of.get(c) == gid for c in cons):
                folded_in[gid].append(f)
        return folded_in

    def make_regions(self, kept: list[_Group], folded_in: dict[int, list[str]]) -> list[Region]:
        """A region per kept group over its original nodes, numbered in order; a group under ``min_region_size``
        ops is dissolved (logged, its ops given the reason) unless full compilation is required, which judges the
        step as a whole instead."""
        settings, G = self.settings, self.cv.program.graph
        regions: list[Region] = []
        for g in kept:
            nodes = {o for n in g.members for o in self.cv.original_nodes(n)} | set(folded_in[g.id])
            op_count = sum(1 for n in nodes if G.nodes[n]["kind"] == "op")
            if (settings.min_region_size > 1 and op_count < settings.min_region_size
                    and not settings.require_full_compilation):
                self.decisions.append(Decision(
                    "dissolve", g.label, f"{op_count} ops < min_region_size={settings.min_region_size};"
                    " left to the fallback path", nodes=tuple(sorted(g.members))))
                for n in nodes:
                    self.outside_reason[n] = (f"its region ({g.label}) has {op_count} ops < "
                                              f"min_region_size={settings.min_region_size}")
                continue
            regions.append(_make_region(self.cv, g, nodes, len(regions)))
        return regions

    def require_full(self, regions: list[Region]) -> list[Region]:
        """``require_full_compilation``: keep ``regions`` only when they are one region covering every op;
        otherwise log the refusal, mark every region's ops outside and return no regions."""
        G = self.cv.program.graph
        all_ops = [n for n, d in G.nodes(data=True) if d["kind"] == "op"]
        inside = set().union(*(r.nodes for r in regions)) if regions else set()
        missing = [n for n in all_ops if n not in inside]
        if not missing and len(regions) == 1:
            return regions
        why = (f"{len(missing)} ops outside any region (first: {missing[0]} {G.nodes[missing[0]]['op']})" if missing
               else f"the step forms {len(regions)} regions, not one")
        self.decisions.append(Decision("require_full", "step", f"require_full_compilation refused: {why}; "
                                       "the whole step runs on the fallback path"))
        for r in regions:
            for n in r.nodes:
                self.outside_reason[n] = "require_full_compilation: the step is not fully fusible"
        return []


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
    _union(keep, gone, bits, ga.label if ga.matches or not gb.matches else gb.label, parent)


def _union(keep: _Group, gone: _Group, bits: int, label: str, parent: dict[int, int]) -> None:
    """``gone``'s members, reach and matches into ``keep`` (whose bits become ``bits``), ``gone`` under it."""
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
