"""Find pattern occurrences with networkx's VF2 (``DiGraphMatcher``) and decide which ones become matches.

Per traced variant, the search runs on the canonical data graph restricted to nodes whose (op, dtype) the variant
contains, with the pattern's op nodes only: inputs are wildcards bound afterwards from the matched ops' arguments.
That keeps VF2 away from "an input may be any node" and makes a 48-layer step take milliseconds per variant.

Semantic node matching compares op, tensor-argument positions, dtype and literal constants; edges compare the
argument positions. A structural match then has to pass, in order: input bindings (consistent, of the declared
kind and dtype), dims bound from the inputs' shapes, shape-expression constants, captured params, convexity,
interior values not escaping, ``fallback_ops``, the pattern's ``check``. Overlaps are resolved by priority, then
size, then position.
"""
from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import networkx as nx
from networkx.algorithms.isomorphism import DiGraphMatcher

from ..program import InputKind
from ..warnings import one_line, warn
from .canonicalize import HAZARD, CanonicalView, is_layout_preserving
from .pattern import Pattern
from .reach import Reach
from .results import Decision, Match
from .trace import CompiledVariant, PatternNode, _same

log = logging.getLogger(__name__)

_KINDS = {"weight": InputKind.WEIGHT, "buffer": InputKind.BUFFER, "state": InputKind.STATE, "step": InputKind.STEP}


class NodeView:
    """Read-only facts about one program value, as ``check``/``derive`` see them."""

    def __init__(self, cv: CanonicalView, node: str):
        self._d = cv.data.nodes[node]
        self.node = node

    @property
    def shape(self) -> tuple | None:
        return self._d.get("shape")

    @property
    def dtype(self) -> str | None:
        return self._d.get("dtype")

    @property
    def op(self) -> str | None:
        return self._d.get("orig_op")

    @property
    def kind(self) -> str:
        k = self._d.get("input_kind")
        return k.value if k is not None else ("op" if self._d["kind"] == "op" else self._d["kind"])

    @property
    def module(self) -> str | None:
        return self._d.get("module")

    def __repr__(self) -> str:
        return f"<{self.node} {self.op or self.kind} {self.shape} {self.dtype}>"


class MatchContext:
    """What a pattern's ``check(m)`` and ``derive(m)`` receive."""

    def __init__(self, cv: CanonicalView, variant: CompiledVariant, mapping: dict[str, str],
                 bindings: dict[str, str], params: dict[str, Any], dims: dict[str, int]):
        self._cv = cv
        self.variant = variant.name
        self.pattern = variant.pattern
        self.mapping = mapping
        self.inputs = {k: NodeView(cv, v) for k, v in bindings.items()}
        self.outputs = {k: NodeView(cv, mapping[v]) for k, v in variant.outputs.items()}
        self.params = params
        self.dims = dims

    def shape(self, name: str) -> tuple | None:
        v = self.inputs.get(name) or self.outputs.get(name)
        return v.shape if v else None

    def dtype(self, name: str) -> str | None:
        v = self.inputs.get(name) or self.outputs.get(name)
        return v.dtype if v else None

    def nodes(self, op: str | None = None) -> list[NodeView]:
        """Matched program ops (optionally of one ATen op, e.g. ``"aten.index_copy_.default"``), in order."""
        views = [NodeView(self._cv, g) for g in self.mapping.values()]
        views.sort(key=lambda v: self._cv.data.nodes[v.node]["order"])
        return [v for v in views if op is None or v.op == op]

    def arg(self, op: str, path: str | int) -> Any:
        """A constant argument of the first matched ``op`` node (``path`` is an arg index or a kwarg name)."""
        key = f"a{path}" if isinstance(path, int) else (path if path.startswith(("a", "k:", "c")) else f"k:{path}")
        for v in self.nodes(op):
            consts = self._cv.data.nodes[v.node]["consts"]
            if key in consts:
                return consts[key]
        raise KeyError(f"no matched {op} with constant argument {path!r}")


@dataclass
class Candidate:
    variant: CompiledVariant
    mapping: dict[str, str]  # pattern node -> canonical program node
    bindings: dict[str, str]  # input name -> canonical program node
    params: dict[str, Any]
    dims: dict[str, int]
    exports: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def pattern(self) -> Pattern:
        return self.variant.pattern

    @property
    def nodes(self) -> frozenset[str]:
        return frozenset(self.mapping.values())


@dataclass
class Refusal:
    variant: CompiledVariant
    nodes: frozenset[str]
    reason: str


def node_matches(a: Mapping[str, Any], p: PatternNode, slot_sigs: Mapping[tuple, str] | None) -> bool:
    """VF2's semantic node test (kept lean: it runs for every candidate pair)."""
    if a["kind"] != "op" or a["positions"] != p.positions or a["dtype"] != p.dtype:
        return False
    consts = a["consts"]
    if p.op is None:
        return slot_sigs is not None and (a["op"], tuple(sorted(consts.items()))) in slot_sigs
    if a["op"] != p.op or consts.keys() != p.cpaths:
        return False
    for path, v in p.lits:
        if not _lit_equal(consts[path], v):
            return False
    return True


def _lit_equal(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and not isinstance(b, bool):
            return a == b
        return False
    return a == b


def node_mismatch(a: Mapping[str, Any], p: PatternNode, slot_sigs: Mapping[tuple, str] | None) -> str | None:
    """Why a program node does not match a pattern node (None if it does): for debugging and reports."""
    if a["kind"] != "op":
        return f"expected an op ({p.orig_op}), found a graph {a['kind']}"
    if p.op is None:
        if (a["op"], tuple(sorted(a["consts"].items()))) not in (slot_sigs or {}):
            return f"{a['orig_op']} is not one of the ops slot {p.slot!r} accepts ({', '.join(sorted(set((slot_sigs or {}).values())))})"
    elif a["op"] != p.op:
        return f"expected {p.orig_op if p.op != 'view' else 'a reshape'}, found {a['orig_op']}"
    if a["dtype"] != p.dtype:
        return f"dtype {a['dtype']} where the pattern has {p.dtype}"
    if a["positions"] != p.positions:
        return f"tensor arguments at {list(a['positions'])}, the pattern has them at {list(p.positions)}"
    if p.op is None:
        return None
    consts = a["consts"]
    if consts.keys() != p.cpaths:
        return f"constant arguments {sorted(consts)} differ from the pattern's {sorted(p.cpaths)}"
    for path, v in p.lits:
        if not _lit_equal(consts[path], v):
            return f"constant {path} is {consts[path]!r}, the pattern needs {v!r}"
    return None


def bind_inputs(cv: CanonicalView, v: CompiledVariant, mapping: dict[str, str]) -> tuple[dict[str, str] | None, str | None]:
    """Bind each pattern input to the program value at its argument positions of the matched ops."""
    P = v.graph
    bindings: dict[str, str] = {}
    mapped = set(mapping.values())
    claims: dict[str, dict[frozenset, list[str]]] = {}
    for name, edges in v.inputs.items():
        for consumer, pos in edges:
            claims.setdefault(consumer, {}).setdefault(pos, []).append(name)
    for consumer, by_pos in claims.items():
        g = mapping[consumer]
        args = list(cv.data.nodes[g].get("arg_srcs", ()))  # (position label, source) in argument order
        interior = Counter()
        for src, _ in P.pred[consumer].items():
            label_set = P.edges[src, consumer]["pos"]
            if label_set == HAZARD:
                continue
            for lb in label_set:
                interior[(lb, mapping[src])] += 1
        for pos, names in by_pos.items():
            remaining = []
            for lb, src in args:
                if lb in pos:
                    if interior[(lb, src)] > 0:
                        interior[(lb, src)] -= 1
                        continue
                    remaining.append(src)
            # an input used at several arguments of one op (``x * x``, ``sub(x, x)``) appears once per argument:
            # the op's positions equal the pattern's (node_matches), so the count is the pattern's own
            per_name = len(remaining) if len(names) == 1 else 1
            if not remaining or len(remaining) != len(names) * per_name:
                return None, f"cannot bind input(s) {', '.join(names)} of {consumer}"
            for k, name in enumerate(names):
                srcs = remaining[k * per_name:(k + 1) * per_name]
                if len(set(srcs)) != 1:
                    return None, f"input {name!r} is read from different values ({', '.join(sorted(set(srcs)))})"
                src = srcs[0]
                if bindings.setdefault(name, src) != src:
                    return None, f"input {name!r} bound to both {bindings[name]} and {src}"
    for name, src in bindings.items():
        if src in mapped:
            return None, f"input {name!r} would be the matched node {src} itself"
    return bindings, None


def _bind_dims(cv: CanonicalView, v: CompiledVariant, bindings: dict[str, str]) -> tuple[dict[str, int], str | None]:
    dims: dict[str, int] = {}
    for name, node in bindings.items():
        spec = v.input_specs[name]
        shape = cv.data.nodes[node].get("shape")
        toks = spec.dims()
        if not isinstance(shape, tuple) or len(toks) != len(shape):
            continue  # a reshape folded into the match: shapes are checked through the matched ops instead
        for tok, size in zip(toks, shape):
            if re.fullmatch(r"-?\d+", tok):
                if int(tok) != size:
                    return dims, f"input {name!r} has size {size} where the pattern requires {tok}"
                continue
            if "*" in tok:
                continue
            if tok in v.fixed_dims:
                if v.fixed_dims[tok] != size:
                    return dims, f"input {name!r} dim {tok} is {size}, this variant needs {v.fixed_dims[tok]}"
                continue
            if dims.setdefault(tok, size) != size:
                return dims, f"dim {tok} is {dims[tok]} elsewhere but {size} in input {name!r}"
    for name, node in bindings.items():  # products like KV*G, once their factors are known
        shape = cv.data.nodes[node].get("shape")
        toks = v.input_specs[name].dims()
        if isinstance(shape, tuple) and len(toks) == len(shape):
            for tok, size in zip(toks, shape):
                if "*" in tok:
                    value = 1
                    known = True
                    for part in tok.split("*"):
                        part = part.strip()
                        if part.isdigit():
                            value *= int(part)
                        elif part in dims or part in v.fixed_dims:
                            value *= dims.get(part, v.fixed_dims.get(part, 1))
                        else:
                            known = False
                    if known and value != size:
                        return dims, f"input {name!r} has size {size} where the pattern requires {tok}={value}"
    return dims, None


def validate(cv: CanonicalView, reach: Reach, v: CompiledVariant, mapping: dict[str, str],
             fallback_ops: frozenset[str]) -> Candidate | Refusal:
    """Everything after structure (see module docstring). ``mapping``: pattern node -> program node."""
    nodes = frozenset(mapping.values())
    bindings, why = bind_inputs(cv, v, mapping)
    if bindings is None:
        return Refusal(v, nodes, why or "input binding failed")
    D = cv.data.nodes
    for name, node in bindings.items():
        spec = v.input_specs[name]
        d = D[node]
        want = v.input_dtypes.get(name)
        if spec.dtype != "any" and want is not None and d.get("dtype") != want:
            return Refusal(v, nodes, f"input {name!r} ({node}) is {d.get('dtype')}, the pattern needs {want}")
        if spec.kind is not None:
            kind = d.get("input_kind")
            if kind != _KINDS.get(spec.kind):
                what = d.get("orig_op") or (kind.value if kind is not None else d["kind"])
                return Refusal(v, nodes, f"input {name!r} must be a {spec.kind} but is computed by {node} ({what})")
    dims, why = _bind_dims(cv, v, bindings)
    if why:
        return Refusal(v, nodes, why)
    params: dict[str, Any] = dict(v.static)
    if v.takes_dtype:
        params["dtype"] = v.dtype
    for pn_name, g in mapping.items():
        pn: PatternNode = v.graph.nodes[pn_name]["p"]
        consts = D[g]["consts"]
        for path, coef, syms in pn.exprs:
            if all(s in dims for s in syms):
                want = coef
                for s in syms:
                    want *= dims[s]
                if consts.get(path) != want:
                    return Refusal(v, nodes, f"{g} ({D[g]['orig_op']}) argument {path} is {consts.get(path)!r}; the pattern "
                                              f"needs {'*'.join([str(coef)] + list(syms)) if coef != 1 else '*'.join(syms)} = {want}")
        for path, pname in pn.params:
            val = consts.get(path)
            if pname in params and not _same(params[pname], val):
                return Refusal(v, nodes, f"param {pname} is {params[pname]!r} in one place and {val!r} in another ({g})")
            params[pname] = val
        if pn.slot is not None:
            sig = (D[g]["op"], tuple(sorted(D[g]["consts"].items())))
            params[pn.slot] = v.slot_signatures[pn.slot][sig]
    # convexity: no path may leave the match and re-enter it through an outside node
    members = reach.bits(nodes)
    bad = reach.ancestors(nodes) & reach.descendants(nodes) & ~members
    if bad:
        w = reach.witness(bad)
        return Refusal(v, nodes, f"not convex: {w} lies on a path from the match back into it")
    # interior values must not be used outside (unless only a graph output carries them over a glue-free break)
    outputs = {mapping[o] for o in v.outputs.values()}
    exports: dict[str, tuple[str, ...]] = {}
    for g in nodes - outputs:
        outside = [s for s in cv.data_succ(g) if s not in nodes]
        if not outside:
            continue
        if all(D[s]["kind"] == "output" and _glue_free_output(cv, g, s) for s in outside):
            exports[g] = tuple(outside)
            continue
        return Refusal(v, nodes, f"interior value {g} ({D[g]['orig_op']}) is also used by {outside[0]} "
                                 f"({D[outside[0]].get('orig_op') or D[outside[0]]['kind']}) outside the match")
    for g in nodes:
        for orig in cv.original_nodes(g):
            if _op_in(cv.program.graph.nodes[orig].get("op"), fallback_ops):
                return Refusal(v, nodes, f"{orig} ({cv.program.graph.nodes[orig].get('op')}) is forced to fallback")
    return Candidate(v, dict(mapping), bindings, params, dims, exports)


def _op_in(op: str | None, ops: frozenset[str]) -> bool:
    if not op or not ops:
        return False
    if op in ops:
        return True
    return op.rsplit(".", 1)[0] in ops  # "aten.topk" names every overload


def _glue_free_output(cv: CanonicalView, value: str, out_node: str) -> bool:
    """Is ``value`` returned by graph ``out_node`` only to be handed, untouched, to a later graph?"""
    prog = cv.program
    gi = cv.data.nodes[out_node]["graph"]
    links = [l for l in prog.links if l.src_graph == gi and cv.rep.get(l.src_node) == value]
    return bool(links) and all(l.glue_free for l in links)


def run_check(c: Candidate, cv: CanonicalView, disabled: dict[str, str], quiet: bool = False) -> str | None:
    """The pattern's own ``check`` and ``derive``; a raising hook disables the pattern with one warning."""
    p = c.pattern
    if p.check is None and p.derive is None:
        return None
    ctx = MatchContext(cv, c.variant, c.mapping, c.bindings, c.params, c.dims)
    try:
        if p.check is not None:
            ok = p.check(ctx)
            if ok is False:
                return "check() returned False"
            if isinstance(ok, str):
                return f"check: {ok}"
        if p.derive is not None:
            derived = dict(p.derive(ctx) or {})
            undeclared = sorted(set(derived) - set(p.derived)) if p.derived else []
            if undeclared:  # the names a lowering was checked against at import must be the ones it gets
                raise ValueError(f"derive returned params {undeclared} the pattern does not declare in derived=")
            c.params.update(derived)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - a plugin's bug (even a SystemExit) must not break the compile
        msg = one_line(e)
        disabled[p.name] = f"check/derive raised {msg}"
        if not quiet:
            warn(f"pattern {p.name!r} ({p.source}) raised in check/derive ({msg}); the pattern is disabled for this compile")
        return f"check raised {msg}"
    return None


def _search_order(v: CompiledVariant, freq: Mapping[tuple, int]) -> list[str]:
    """Pattern nodes, rarest (op, dtype) first, then breadth-first: VF2 tries candidates in this order."""
    P = v.graph

    def rarity(n: str) -> tuple:
        pn = P.nodes[n]["p"]
        return (freq.get((pn.op, pn.dtype), 10**9) if pn.op is not None else 10**9, n)

    order: list[str] = []
    seen: set[str] = set()
    U = P.to_undirected(as_view=True)
    for root in sorted(P.nodes, key=rarity):
        if root in seen:
            continue
        for n in [root] + [b for _, b in nx.bfs_edges(U, root)]:
            if n not in seen:
                seen.add(n)
                order.append(n)
    return order


class _PatternMatcher(DiGraphMatcher):
    """VF2 that tries only semantically matching pairs.

    networkx tests the (costly) syntactic feasibility of every candidate pair before the semantic one, and with an
    empty mapping every G1 node is a candidate for the first pattern node. Filtering candidates by the (cheap,
    cached) node test first, and seeding the root from the program's op index, keeps the search proportional to
    the number of real occurrences instead of the program size.
    """

    def __init__(self, G1: nx.DiGraph, G2: nx.DiGraph, node_ok, roots: list[str]):
        super().__init__(G1, G2, edge_match=lambda a, b: a["pos"] == b["pos"])
        self._node_ok = node_ok
        self._roots = roots
        self._root = next(iter(G2))

    def candidate_pairs_iter(self):
        if not self.core_1:
            for n in self._roots:
                yield n, self._root
            return
        ok = self._node_ok
        for n1, n2 in super().candidate_pairs_iter():
            if ok(n1, n2):
                yield n1, n2


def structural_matches(cv: CanonicalView, v: CompiledVariant, freq: Mapping[tuple, int],
                       limit: int = 100000) -> Iterator[dict[str, str]]:
    """VF2 monomorphisms of the variant's op graph into the program (pattern node -> program node)."""
    for key, need in v.ops.items():
        if freq.get(key, 0) < need:
            return
    P = v.graph
    D = cv.data
    sigs = {n: v.slot_signatures.get(P.nodes[n]["p"].slot, {}) for n in P if P.nodes[n]["p"].slot is not None}
    pnodes = {n: P.nodes[n]["p"] for n in P}
    cache: dict[tuple[str, str], bool] = {}
    dnodes = D.nodes

    def node_ok(g: str, p: str) -> bool:
        key = (g, p)
        r = cache.get(key)
        if r is None:
            r = cache[key] = node_matches(dnodes[g], pnodes[p], sigs.get(p))
        return r

    order = _search_order(v, freq)
    root = order[0]
    rp = pnodes[root]
    pool = cv.by_op.get(rp.op, []) if rp.op is not None else cv.op_nodes
    roots = [g for g in pool if node_ok(g, root)]
    if not roots:
        return
    G2 = nx.DiGraph()
    for n in order:
        G2.add_node(n, **P.nodes[n])
    G2.add_edges_from(P.edges(data=True))
    gm = _PatternMatcher(D, G2, node_ok, roots)
    count = 0
    for m in gm.subgraph_monomorphisms_iter():
        count += 1
        if count > limit:
            log.warning("pattern %s variant %s: more than %d structural matches; stopping", v.pattern.name, v.name, limit)
            return
        yield {p: g for g, p in m.items()}


def find_candidates(cv: CanonicalView, reach: Reach, variants: Iterable[CompiledVariant], fallback_ops: frozenset[str],
                    disabled: dict[str, str]) -> tuple[list[Candidate], list[Refusal]]:
    freq = Counter((d["op"], d["dtype"]) for n, d in cv.data.nodes(data=True) if d["kind"] == "op")
    candidates: list[Candidate] = []
    refusals: list[Refusal] = []
    seen: set = set()
    for v in variants:
        if v.pattern.name in disabled:
            continue
        for mapping in structural_matches(cv, v, freq):
            key = (v.pattern.name, frozenset(mapping.values()))
            if key in seen:
                continue
            res = validate(cv, reach, v, mapping, fallback_ops)
            if isinstance(res, Refusal):
                refusals.append(res)
                continue
            if v.pattern.name in disabled:
                break
            why = run_check(res, cv, disabled)
            if why is not None:
                refusals.append(Refusal(v, res.nodes, why))
                continue
            seen.add(key)
            candidates.append(res)
    return candidates, refusals


def resolve_overlaps(cv: CanonicalView, candidates: list[Candidate],
                     decisions: list[Decision]) -> list[Candidate]:
    """Greedy: higher priority first, then larger, then earlier; a candidate sharing an op node loses."""
    order = {n: cv.data.nodes[n]["order"] for n in cv.op_nodes}

    def key(c: Candidate) -> tuple:
        first = min(order[n] for n in c.nodes)
        return (-c.pattern.priority, -len(c.nodes), first, c.pattern.name, c.variant.name)

    claimed: dict[str, Candidate] = {}
    accepted: list[Candidate] = []
    for c in sorted(candidates, key=key):
        clash = next((claimed[n] for n in sorted(c.nodes, key=order.get) if n in claimed), None)
        if clash is not None:
            if clash.nodes != c.nodes or clash.pattern is not c.pattern:
                decisions.append(Decision(
                    "refuse_match", _cand_label(cv, c),
                    f"overlaps {_cand_label(cv, clash)}, which wins on "
                    + ("priority" if clash.pattern.priority != c.pattern.priority else "size" if len(clash.nodes) != len(c.nodes) else "position"),
                    other=_cand_label(cv, clash), nodes=tuple(sorted(c.nodes))))
            continue
        for n in c.nodes:
            claimed[n] = c
        accepted.append(c)
    return accepted


def _cand_label(cv: CanonicalView, c: Candidate) -> str:
    return f"{c.pattern.name}@{_module_of(cv, c.nodes) or 'step'}"


def _module_of(cv: CanonicalView, nodes: Iterable[str]) -> str | None:
    G = cv.program.graph
    mods = Counter()
    first: dict[str, int] = {}
    for n in nodes:
        for o in cv.original_nodes(n):
            m = G.nodes[o].get("module")
            if m:
                mods[m] += 1
                first.setdefault(m, G.nodes[o]["order"])
    if not mods:
        return None
    return max(mods, key=lambda m: (mods[m], -first[m]))


def _layer_of(cv: CanonicalView, nodes: Iterable[str]) -> int | None:
    G = cv.program.graph
    layers = Counter(G.nodes[o].get("layer") for n in nodes for o in cv.original_nodes(n))
    layers.pop(None, None)
    return max(layers, key=lambda l: (layers[l], -l)) if layers else None


def to_match(cv: CanonicalView, c: Candidate) -> Match:
    """A Candidate in original-program terms (node ids, folded nodes, input view chains)."""
    G = cv.program.graph
    mapped = c.nodes
    nodes: set[str] = set()
    for g in mapped:
        nodes.update(cv.original_nodes(g))
    input_views: dict[str, list[str]] = {name: [] for name in c.bindings}
    by_source: dict[str, list[str]] = {}
    for name, src in c.bindings.items():
        by_source.setdefault(src, []).append(name)
    for f in [f for src in (set(mapped) | set(by_source)) for f in cv.folded_by_source.get(src, ())]:
        src = cv.folded[f]
        if G.nodes[f]["kind"] != "op":
            continue
        cons = cv.folded_consumers.get(f, frozenset())
        if not cons or not cons <= mapped:
            continue
        if src in mapped:
            nodes.add(f)
        elif src in by_source:
            for name in by_source[src]:
                input_views[name].append(f)
    views = {k: tuple(sorted(v, key=lambda n: G.nodes[n]["order"])) for k, v in input_views.items()}
    preserving = {}
    for k, chain in views.items():
        ok = True
        for f in chain:
            d = G.nodes[f]
            src_shape = None
            for p in G.pred[f]:
                src_shape = G.nodes[p].get("shape")
                break
            ok = ok and is_layout_preserving(d["op"], d, src_shape)
        preserving[k] = ok
    graphs = tuple(sorted({G.nodes[n]["graph"] for n in nodes}))
    first = min(G.nodes[n]["order"] for n in nodes)
    return Match(
        pattern=c.pattern,
        variant=c.variant.name,
        nodes=frozenset(nodes),
        inputs=dict(c.bindings),
        outputs={k: c.mapping[v] for k, v in c.variant.outputs.items()},
        params=dict(c.params),
        layer=_layer_of(cv, mapped),
        module=_module_of(cv, mapped),
        input_views=views,
        input_layout_preserving=preserving,
        mapping=dict(c.mapping),
        exports=dict(c.exports),
        graphs=graphs,
        order=first,
    )
