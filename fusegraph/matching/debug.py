"""Why did a pattern not match here? (``FUSEGRAPH_MATCH_DEBUG=<pattern name or node id>``)

VF2 only says "no". To explain, this module walks one pattern variant from an anchor (a pattern node placed on a
program node) along the pattern's edges, argument position by argument position, with a little backtracking for
commutative operands, and reports the first node or edge that does not fit, at the deepest point any attempt
reached. A full structural fit is then put through the same validation as real matches (inputs, dims, params,
convexity, escaping values, ``check``), so the explanation names whatever refused it. Reports use the same walk to
say why an op stayed unmatched ("closest pattern ...").
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

from .canonicalize import HAZARD, CanonicalView
from .matcher import Candidate, Refusal, node_mismatch, run_check, validate
from .reach import Reach
from .trace import CompiledVariant

log = logging.getLogger("fusegraph.matching.debug")


@dataclass
class Attempt:
    variant: CompiledVariant
    anchor: tuple[str, str]  # (pattern node, program node)
    mapped: dict[str, str] = field(default_factory=dict)
    failure: str | None = None
    at: str | None = None  # program node where it failed
    complete: bool = False
    closeness: int = 0  # how far the failing node got: 0 op differs, 1 dtype, 2 argument layout, 3 constants

    @property
    def depth(self) -> int:
        return len(self.mapped)

    def describe(self, cv: CanonicalView) -> str:
        v = self.variant
        head = f"{v.pattern.name} [{v.name}] anchored {self.anchor[0]} at {self.anchor[1]}: "
        if self.complete and self.failure is None:
            return head + f"all {v.size} pattern ops match"
        where = ""
        if self.at is not None and self.at in cv.data:
            where = f" at {self.at} ({cv.data.nodes[self.at].get('orig_op') or cv.data.nodes[self.at]['kind']})"
        return head + f"matched {self.depth} of {v.size} pattern ops; fails{where}: {self.failure}"


def _arg_node(cv: CanonicalView, g: str, pos: frozenset) -> list[str]:
    return [p for p, e in cv.data.pred[g].items() if e["pos"] == pos]


def _succ_nodes(cv: CanonicalView, g: str, pos: frozenset) -> list[str]:
    return [s for s, e in cv.data.succ[g].items() if e["pos"] == pos]


def explain_at(cv: CanonicalView, v: CompiledVariant, pnode: str, gnode: str, budget: int = 4000) -> Attempt:
    """Walk ``v`` from ``pnode`` placed on ``gnode``; the deepest failure wins."""
    P = v.graph
    best = Attempt(v, (pnode, gnode))
    steps = [0]
    sigs = {n: v.slot_signatures.get(P.nodes[n]["p"].slot, {}) for n in P if P.nodes[n]["p"].slot}

    def record(mapped: dict[str, str], failure: str, at: str | None, closeness: int = 0) -> None:
        if (len(mapped), closeness) > (best.depth, best.closeness) or best.failure is None and not best.complete:
            best.mapped, best.failure, best.at, best.closeness = dict(mapped), failure, at, closeness

    def check_node(pn: str, g: str, mapped: dict[str, str]) -> str | None:
        if g in mapped.values():
            return f"{g} is already used for another pattern node"
        pat = P.nodes[pn]["p"]
        why = node_mismatch(cv.data.nodes[g], pat, sigs.get(pn))
        if why:
            return f"{why} (pattern node {pat.describe()})"
        return None

    def frontier(mapped: dict[str, str]) -> tuple | None:
        for pn in sorted(mapped, key=lambda n: list(P).index(n)):
            for q in P.pred[pn]:
                if q not in mapped:
                    return ("pred", q, pn, P.edges[q, pn]["pos"])
            for q in P.succ[pn]:
                if q not in mapped:
                    return ("succ", q, pn, P.edges[pn, q]["pos"])
        rest = [n for n in P if n not in mapped]
        return ("free", rest[0], None, None) if rest else None

    def walk(mapped: dict[str, str]) -> bool:
        steps[0] += 1
        if steps[0] > budget:
            return False
        nxt = frontier(mapped)
        if nxt is None:
            best.mapped, best.failure, best.at, best.complete = dict(mapped), None, None, True
            return True
        how, q, pn, pos = nxt
        if how == "free":
            record(mapped, f"pattern node {P.nodes[q]['p'].describe()} is not connected to the matched part", None)
            return False
        g = mapped[pn]
        cands = _arg_node(cv, g, pos) if how == "pred" else _succ_nodes(cv, g, pos)
        if not cands:
            pat = P.nodes[q]["p"]
            if how == "pred":
                record(mapped, f"argument {'/'.join(sorted(pos))} of {g} should come from {pat.describe()}, "
                               f"found {_describe_args(cv, g, pos)}", g)
            else:
                record(mapped, f"{g} should feed {pat.describe()} (argument {'/'.join(sorted(pos))}); it has no such user", g)
            return False
        for c in sorted(cands, key=lambda n: cv.data.nodes[n]["order"]):
            why = check_node(q, c, mapped)
            if why:
                record(mapped, why, c, _closeness(cv.data.nodes[c], P.nodes[q]["p"]))
                continue
            mapped[q] = c
            if walk(mapped):
                return True
            del mapped[q]
        return False

    why = check_node(pnode, gnode, {})
    if why:
        best.failure, best.at = why, gnode
        best.closeness = _closeness(cv.data.nodes[gnode], P.nodes[pnode]["p"])
        return best
    walk({pnode: gnode})
    return best


def _closeness(a: dict, p) -> int:
    if a.get("kind") != "op":
        return -1
    if p.op is not None and a.get("op") != p.op:
        return 0
    if a.get("dtype") != p.dtype:
        return 1
    if a.get("positions") != p.positions:
        return 2
    return 3


def _describe_args(cv: CanonicalView, g: str, pos: frozenset) -> str:
    srcs = [(p, e["pos"]) for p, e in cv.data.pred[g].items() if e["pos"] != HAZARD]
    hit = [p for p, ps in srcs if ps & pos]
    if not hit:
        return "no tensor there (a constant or a different argument layout)"
    return ", ".join(f"{p} ({cv.data.nodes[p].get('orig_op') or cv.data.nodes[p]['kind']})" for p in hit)


def full_explanation(cv: CanonicalView, reach: Reach, v: CompiledVariant, pnode: str, gnode: str,
                     fallback_ops: frozenset[str]) -> tuple[Attempt, str]:
    """The walk plus, for a structural fit, the validation verdict."""
    a = explain_at(cv, v, pnode, gnode)
    if not a.complete:
        return a, a.describe(cv)
    res = validate(cv, reach, v, a.mapped, fallback_ops)
    head = f"{v.pattern.name} [{v.name}] anchored {pnode} at {gnode}: all {v.size} pattern ops match"
    if isinstance(res, Refusal):
        a.failure = res.reason
        return a, f"{head}, but the match is refused: {res.reason}"
    why = run_check(res, cv, {}, quiet=True)
    if why is not None:
        a.failure = why
        return a, f"{head}, but the match is refused: {why}"
    return a, f"{head}; inputs, dims, params and check pass"


def anchors_for(v: CompiledVariant, cv: CanonicalView, g: str) -> list[str]:
    """Pattern nodes that could sit on program node ``g`` (same op and dtype, or a slot accepting it)."""
    d = cv.data.nodes[g]
    out = []
    for n in v.graph:
        p = v.graph.nodes[n]["p"]
        if p.op is None:
            sig = (d.get("op"), tuple(sorted(d.get("consts", {}).items())))
            if sig in v.slot_signatures.get(p.slot, {}):
                out.append(n)
        elif p.op == d.get("op"):
            out.append(n)
    return out


def closest_miss(cv: CanonicalView, reach: Reach, variants: Iterable[CompiledVariant], g: str,
                 fallback_ops: frozenset[str]) -> tuple[CompiledVariant | None, str]:
    """The deepest attempt of any variant anchored at ``g``, with its explanation."""
    best: tuple[tuple, Attempt, str] | None = None
    for v in variants:
        for pn in anchors_for(v, cv, g):
            a = explain_at(cv, v, pn, g, budget=600)
            text = a.describe(cv)
            if a.complete:
                a, text = full_explanation(cv, reach, v, pn, g, fallback_ops)
            # prefer deeper walks, then failures that got further into the failing node (same op and dtype)
            score = (a.depth / max(1, v.size), a.depth, a.closeness)
            if best is None or score > best[0]:
                best = (score, a, text)
    if best is None:
        return None, ""
    return best[1].variant, best[2]


def explain_target(cv: CanonicalView, reach: Reach, variants: list[CompiledVariant], target: str,
                   accepted: Iterable[Candidate], refusals: list[Refusal], fallback_ops: frozenset[str],
                   limit: int = 20) -> list[str]:
    """Lines explaining ``target`` (a pattern name, or a program node id) — what FUSEGRAPH_MATCH_DEBUG prints."""
    lines: list[str] = []
    accepted = list(accepted)
    names = {v.pattern.name for v in variants}
    if target in names:
        mine = [v for v in variants if v.pattern.name == target]
        covered = {n for c in accepted if c.pattern.name == target for n in c.nodes}
        lines.append(f"{target}: {sum(1 for c in accepted if c.pattern.name == target)} accepted match(es), "
                     f"{len(mine)} traced variant(s)")
        for r in refusals:
            if r.variant.pattern.name == target and len(lines) < limit:
                lines.append(f"  refused [{r.variant.name}] at {min(r.nodes, key=lambda n: cv.data.nodes[n]['order'])}: {r.reason}")
        for v in mine:
            anchor = v.outputs[next(iter(v.outputs))]
            p = v.graph.nodes[anchor]["p"]
            cands = [g for g in cv.op_nodes if g not in covered and cv.data.nodes[g]["op"] == p.op]
            for g in cands:
                if len(lines) >= limit:
                    break
                _, text = full_explanation(cv, reach, v, anchor, g, fallback_ops)
                lines.append("  " + text)
        return lines
    node = cv.rep.get(target, target)
    if node not in cv.data:
        return [f"{target}: no such pattern or program node"]
    d = cv.data.nodes[node]
    if node != target:
        lines.append(f"{target} is folded into {node} by canonicalization")
    for c in accepted:
        if node in c.nodes:
            lines.append(f"{node} ({d.get('orig_op')}) is matched by {c.pattern.name} [{c.variant.name}]")
    for r in refusals:
        if node in r.nodes:
            lines.append(f"{node}: {r.variant.pattern.name} [{r.variant.name}] refused: {r.reason}")
    if d["kind"] != "op":
        return lines + [f"{node} is a graph {d['kind']}, not an op"]
    for v in variants:
        for pn in anchors_for(v, cv, node):
            if len(lines) >= limit:
                return lines
            _, text = full_explanation(cv, reach, v, pn, node, fallback_ops)
            lines.append(text)
    if len(lines) == 0:
        lines.append(f"{node} ({d.get('orig_op')}): no registered pattern contains this op")
    return lines
