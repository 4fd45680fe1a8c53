"""A canonical analysis view of a program, so harmless implementation noise does not defeat matching.

The view is a *copy*: executors keep running the program as captured. Patterns are canonicalized by the very same
function, so whatever is folded is folded on both sides. What it does:

* value-identity ops disappear: ``alias``, ``clone``, ``detach``, casts to the dtype a tensor already has, and
  layout ops whose output has the input's shape (identity ``view``/``expand``/``slice``); so do graph inputs fed
  by a glue-free link from an earlier graph (the same tensor crossing a dynamo graph break), and a functional
  ``copy(dst, src)`` of a same-shaped, same-dtype ``src`` (it *is* ``src``: functionalization's trace of an
  in-place write into an intermediate, e.g. HF's ``dist.all_reduce(out)`` after a row-parallel linear);
* reshape-like ops (``view``, ``_unsafe_view``, ``unsqueeze``, ``squeeze``...) become one op, ``view``, and
  private chains of them collapse into one node;
* constants are normalized: ``dim`` arguments become negative (``mean(dim=2)`` on a 3-d tensor equals
  ``mean(dim=-1)``), device/layout/memory-format arguments are dropped, and the scalar operand of a commutative
  op is position-free.

Every folded or collapsed node stays accounted for: ``rep`` maps each original node to the canonical node carrying
its value, ``covers`` lists the original nodes a canonical node stands for, and ``folded`` records value-identity
nodes with their source.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterator

import networkx as nx
import torch

from ..program import Program, Ref

log = logging.getLogger(__name__)

VIEW = "view"  # canonical name of every reshape-like op

RESHAPE_OPS = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.unsqueeze.default",
    "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default", "aten.flatten.using_ints",
    "aten._reshape_alias.default", "aten.view_as.default",
})
NOOP_OPS = frozenset({
    "aten.alias.default", "aten.clone.default", "aten.contiguous.default", "aten.detach.default",
    "aten.lift_fresh_copy.default", "aten.lift_fresh.default", "aten.dropout.default",
})
# ops that are the identity when the output has the input's shape
IDENTITY_IF_SAME_SHAPE = RESHAPE_OPS | {
    "aten.expand.default", "aten.slice.Tensor", "aten.narrow.default", "aten.repeat.default",
    "aten.expand_as.default",
}
# layout ops ("glue"): no arithmetic, only which element sits where; regions may absorb them
LAYOUT_OPS = frozenset({
    VIEW, "aten.transpose.int", "aten.permute.default", "aten.t.default", "aten.expand.default",
    "aten.slice.Tensor", "aten.select.int", "aten.split.Tensor", "aten.split_with_sizes.default",
    "aten.unbind.int", "aten.narrow.default", "getitem", "aten.as_strided.default", "aten.chunk.default",
    "aten.repeat.default", "aten.expand_as.default",
}) | NOOP_OPS | RESHAPE_OPS
COMMUTATIVE = frozenset({
    "aten.add.Tensor", "aten.mul.Tensor", "aten.maximum.default", "aten.minimum.default",
    "aten.bitwise_and.Tensor", "aten.bitwise_or.Tensor", "aten.logical_and.default", "aten.logical_or.default",
    "aten.eq.Tensor", "aten.ne.Tensor",
})
# scaled_dot_product_attention's ATen forms (a keyword-only ``scale``, None for 1/sqrt(q.size(-1)))
SDPA_OPS = frozenset({
    "aten.scaled_dot_product_attention.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_attention_math.default", "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
})
IGNORED_KWARGS = frozenset({"device", "layout", "pin_memory", "memory_format", "non_blocking", "requires_grad"})
# per-op arg positions that do not change the forward value (embedding's padding_idx / scale_grad / sparse)
IGNORED_ARGS = {"aten.embedding.default": frozenset({"a2", "a3", "a4"})}
# where ops take a dim (path, rank taken from: "in" = first tensor input, "out" = output)
DIM_ARGS: dict[str, tuple[tuple[str, str], ...]] = {
    "aten.mean.dim": (("a1", "in"),), "aten.sum.dim_IntList": (("a1", "in"),),
    "aten.amax.default": (("a1", "in"),), "aten.amin.default": (("a1", "in"),),
    "aten.any.dim": (("a1", "in"),), "aten.max.dim": (("a1", "in"),), "aten.argmax.default": (("a1", "in"),),
    "aten._softmax.default": (("a1", "in"),), "aten._log_softmax.default": (("a1", "in"),),
    "aten.topk.default": (("a2", "in"),), "aten.cat.default": (("a1", "out"),),
    "aten.split.Tensor": (("a2", "in"),), "aten.split_with_sizes.default": (("a2", "in"),),
    "aten.transpose.int": (("a1", "in"), ("a2", "in")), "aten.slice.Tensor": (("a1", "in"),),
    "aten.select.int": (("a1", "in"),), "aten.index_copy_.default": (("a1", "in"),),
    "aten.index_copy.default": (("a1", "in"),), "aten.cumsum.default": (("a1", "in"),),
    "aten.index_select.default": (("a1", "in"),), "aten.gather.default": (("a1", "in"),),
    "aten.permute.default": (("a1", "in"),), "aten.sort.default": (("a1", "in"),),
    "aten.narrow.default": (("a1", "in"),), "aten.unbind.int": (("a1", "in"),),
    "aten.var.correction": (("a1", "in"),), "aten.flip.default": (("a1", "in"),),
}
_MISSING = object()


def const_items(args: Any, kwargs: dict, op: str) -> Iterator[tuple[str, Any, bool]]:
    """(path, value, is_tensor_ref) for every leaf of an op's args/kwargs; paths are ``a1``, ``a0.2``, ``k:scale``."""

    def walk(v: Any, path: str) -> Iterator[tuple[str, Any, bool]]:
        if isinstance(v, Ref):
            yield path, v, True
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                yield from walk(x, f"{path}.{i}")
        else:
            yield path, v, False

    for i, a in enumerate(args):
        yield from walk(a, f"a{i}")
    for k, v in kwargs.items():
        if k in IGNORED_KWARGS:
            continue
        yield from walk(v, f"k:{k}")


def _rank(shape: Any) -> int | None:
    return len(shape) if isinstance(shape, tuple) and all(isinstance(s, int) for s in shape) else None


def _freeze(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    return v


def normalize_consts(op: str, consts: dict[str, Any], in_rank: int | None, out_rank: int | None) -> dict[str, Any]:
    """Negative dims, dropped forward-irrelevant args; list-valued dims stay lists (e.g. ``mean([-1])``)."""
    ignored = IGNORED_ARGS.get(op, ())
    out = {p: v for p, v in consts.items() if p.split(".")[0] not in ignored}
    for path, src in DIM_ARGS.get(op, ()):
        rank = in_rank if src == "in" else out_rank
        if rank is None:
            continue
        for p in [q for q in out if q == path or q.startswith(path + ".")]:
            v = out[p]
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0 and rank > 0:
                out[p] = v - rank
    if op == "aten.slice.Tensor":
        # slice(x, dim, 0, INT64_MAX, 1) defaults spelled out or not: the same slice
        if out.get("a4", _MISSING) == 1:
            out.pop("a4")
    return out


def _is_identity(op: str, d: dict, src: dict | None) -> bool:
    if src is None:
        return False
    if op in NOOP_OPS:
        return True
    if op == "aten._to_copy.default":
        return d.get("dtype") == src.get("dtype") and d.get("shape") == src.get("shape")
    if op in IDENTITY_IF_SAME_SHAPE:
        return d.get("shape") == src.get("shape") and d.get("dtype") == src.get("dtype") and _rank(d.get("shape")) is not None
    if op == "aten.transpose.int":
        shape = src.get("shape")
        args = d.get("args", ())
        if _rank(shape) is None or len(args) < 3:
            return False
        i, j = args[1], args[2]
        return i == j or (shape[i] == 1 and shape[j] == 1)
    return False


def _copied_value(op: str, d: dict, refs: list, G: nx.DiGraph) -> str | None:
    """The source a functional ``aten.copy(dst, src)`` equals: ``src`` itself when the result has ``src``'s shape
    and dtype (no broadcast, no cast). Functionalization writes an in-place update of an intermediate this way;
    HF's tensor-parallel row linears all-reduce their output in place (``dist.all_reduce(out)``: functional
    ``all_reduce`` + ``wait_tensor`` + ``copy(out, reduced)``), which must read like DTensor's out-of-place form."""
    if op != "aten.copy.default" or d.get("writes_state") or len(refs) != 2:
        return None
    paths = dict(refs)
    src = paths.get("a1")
    if src is None or "a0" not in paths:
        return None
    s = G.nodes[src]
    return src if s.get("shape") == d.get("shape") and s.get("dtype") == d.get("dtype") else None


def _sole_nonempty_operand(op: str, d: dict, refs: list, G: nx.DiGraph) -> str | None:
    """The operand a ``cat`` is equal to when every other operand is empty: partial-rotary RoPE code (Phi-3, GLM,
    StableLM...) concatenates the rotated part with an empty pass-through slice when the rotary dim is the whole
    head, which is otherwise the plain RoPE."""
    if op != "aten.cat.default" or len(refs) < 2:
        return None
    full = [src for _, src in refs if 0 not in (G.nodes[src].get("shape") or (1,))]
    if len(full) != 1 or len(refs) != len({src for _, src in refs}):
        return None
    s = G.nodes[full[0]]
    return full[0] if s.get("shape") == d.get("shape") and s.get("dtype") == d.get("dtype") else None


def is_layout_preserving(op: str, d: dict, src_shape: Any) -> bool:
    """Does this layout op keep the memory order of its input (a reshape of the same bytes)?"""
    if op in NOOP_OPS or op in RESHAPE_OPS or op == VIEW or op == "getitem":
        return True
    if op == "aten._to_copy.default":
        return True
    shape = src_shape
    if op in ("aten.transpose.int", "aten.permute.default", "aten.t.default") and _rank(shape) is not None:
        args = d.get("args", ())
        rank = len(shape)
        if op == "aten.t.default":
            perm = list(range(rank))[::-1]
        elif op == "aten.transpose.int":
            perm = list(range(rank))
            i, j = args[1] % rank, args[2] % rank
            perm[i], perm[j] = perm[j], perm[i]
        else:
            perm = [p % rank for p in args[1]]
        moved = [p for p in perm if shape[p] != 1]
        return moved == sorted(moved)
    if op in ("aten.expand.default", "aten.slice.Tensor", "aten.narrow.default"):
        return d.get("shape") == shape
    return False


@dataclass
class CanonicalView:
    """The canonical view of a program (see module docstring)."""

    program: Program
    data: nx.DiGraph  # canonical nodes; data edges carry ``pos`` (frozenset of arg positions), hazard edges {"hazard"}
    rep: dict[str, str] = field(default_factory=dict)
    covers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    folded: dict[str, str] = field(default_factory=dict)
    folded_consumers: dict[str, frozenset[str]] = field(default_factory=dict)
    folded_by_source: dict[str, list[str]] = field(default_factory=dict)
    op_nodes: list[str] = field(default_factory=list)  # canonical op nodes in topological order
    by_op: dict[str, list[str]] = field(default_factory=dict)

    def node(self, n: str) -> dict[str, Any]:
        return self.data.nodes[n]

    def original_nodes(self, canonical: str) -> tuple[str, ...]:
        return self.covers.get(canonical, (canonical,))

    def data_succ(self, n: str) -> Iterator[str]:
        for s, e in self.data.succ[n].items():
            if e["pos"] != HAZARD:
                yield s

    def data_pred(self, n: str) -> Iterator[tuple[str, frozenset]]:
        for p, e in self.data.pred[n].items():
            if e["pos"] != HAZARD:
                yield p, e["pos"]


HAZARD = frozenset({"hazard"})


def _input_source(G: nx.DiGraph, n: str) -> str | None:
    """The earlier-graph producer of a graph input fed by a glue-free link (same tensor, no Python glue)."""
    for p, e in G.pred[n].items():
        if e.get("link") and e.get("glue_free"):
            return p
    return None


def canonicalize(program: Program) -> CanonicalView:
    """Build the canonical view of ``program`` (the program itself is not modified)."""
    G = program.graph
    cv = CanonicalView(program=program, data=nx.DiGraph())
    for n in program.topo_order():
        d = G.nodes[n]
        if d["kind"] == "input":
            _add_input(cv, n, d)
        elif d["kind"] == "output":
            _add_output(cv, n, d)
        else:
            _add_op(cv, n, d)
    _add_hazard_edges(cv)
    _collapse_view_chains(cv)
    _folded_consumers(cv)
    _index_ops(cv)
    return cv


def _add_input(cv: CanonicalView, n: str, d: dict[str, Any]) -> None:
    """A graph input: folded into its producer when a glue-free link from an earlier graph feeds it (the same
    tensor crossing a graph break), else a canonical input node."""
    src = _input_source(cv.program.graph, n)
    if src is not None and src in cv.rep:
        cv.rep[n] = cv.rep[src]
        cv.folded[n] = cv.rep[src]
        return
    cv.rep[n] = n
    cv.data.add_node(n, kind="input", op=None, dtype=d.get("dtype"), shape=d.get("shape"), graph=d["graph"],
                     order=d["order"], input_kind=d.get("input_kind"), module=d.get("module"), layer=d.get("layer"),
                     source=d.get("source"), consts={}, positions=())


def _add_output(cv: CanonicalView, n: str, d: dict[str, Any]) -> None:
    """A graph output, fed (position ``out``) by the canonical nodes of its non-hazard predecessors."""
    cv.rep[n] = n
    cv.data.add_node(n, kind="output", op=None, dtype=None, shape=None, graph=d["graph"], order=d["order"],
                     module=None, layer=None, consts={}, positions=())
    for p, e in cv.program.graph.pred[n].items():
        if not e.get("hazard") and p in cv.rep:
            _add_edge(cv.data, cv.rep[p], n, "out")


def _add_op(cv: CanonicalView, n: str, d: dict[str, Any]) -> None:
    """An op: folded into the value it is identical to, or a canonical op node with normalized constants and
    edges from its operands' canonical nodes."""
    rep, D = cv.rep, cv.data
    op = d["op"]
    items = list(const_items(d.get("args", ()), d.get("kwargs", {}), op))
    refs = [(path, v.node) for path, v, is_ref in items if is_ref and v.node in rep]
    same = _value_source(op, d, refs, cv.program.graph)
    if same is not None:
        rep[n] = rep[same]
        cv.folded[n] = rep[same]
        return
    canon_op, consts, labels = _canonical_operands(op, d, items, refs, cv)
    rep[n] = n
    D.add_node(n, kind="op", op=canon_op, orig_op=op, dtype=d.get("dtype"), shape=d.get("shape"),
               graph=d["graph"], order=d["order"], module=d.get("module"), layer=d.get("layer"),
               consts=consts, positions=tuple(sorted(lb for lb, _ in labels)),
               writes_state=d.get("writes_state"), args=d.get("args", ()), arg_srcs=tuple(labels))
    cv.covers[n] = (n,)
    for label, src in labels:
        _add_edge(D, src, n, label)


def _value_source(op: str, d: dict[str, Any], refs: list[tuple[str, str]], G: nx.DiGraph) -> str | None:
    """The operand a value-identity op is the same value as, in the order the folds are tried: a functional
    copy of a same-shaped source, an identity op (never one that writes state), the one non-empty operand; None
    for an op that computes something."""
    copied = _copied_value(op, d, refs, G)
    if copied is not None:
        return copied
    if refs and not d.get("writes_state") and _is_identity(op, d, G.nodes[refs[0][1]]):
        return refs[0][1]
    return _sole_nonempty_operand(op, d, refs, G)


def _canonical_operands(op: str, d: dict[str, Any], items: list[tuple[str, Any, bool]], refs: list[tuple[str, str]],
                        cv: CanonicalView) -> tuple[str, dict[str, Any], list[tuple[str, str]]]:
    """An op's canonical name, constants and (position label, canonical source) operands: reshape-likes become
    ``view`` without constants, a commutative op's two operand positions become one label ``c``, and constants
    are normalized against the operand's and result's ranks."""
    canon_op = VIEW if op in RESHAPE_OPS else op
    consts = {p: _freeze(v) for p, v, is_ref in items if not is_ref}
    commutative = op in COMMUTATIVE
    labels: list[tuple[str, str]] = []
    for path, src in refs:
        label = "c" if commutative and path in ("a0", "a1") else path
        labels.append((label, cv.rep[src]))
    if commutative:
        consts = {("c" if p in ("a0", "a1") else p): v for p, v in consts.items()}
    if canon_op == VIEW:
        consts = {}  # a reshape is defined by its output shape (guarded by shapes, not constants)
    D = cv.data
    in_shape = D.nodes[labels[0][1]].get("shape") if labels and labels[0][1] in D else None
    if op in SDPA_OPS and consts.get("k:scale") is None:
        consts.pop("k:scale", None)
        if _rank(in_shape) and in_shape[-1] > 0:
            # SDPA's default scale spelled out (1 / sqrt(head size), PyTorch's sdp::calculate_scale, in double):
            # ``F.scaled_dot_product_attention(q, k, v)`` and the same call with ``scale=`` are one op
            consts["k:scale"] = 1.0 / math.sqrt(in_shape[-1])
    in_rank = _rank(in_shape)
    consts = normalize_consts(op, consts, in_rank, _rank(d.get("shape")))
    return canon_op, consts, labels


def _add_hazard_edges(cv: CanonicalView) -> None:
    """Hazard edges (a reader of a state value ordered before its in-place write) between canonical nodes where
    no data edge already orders them."""
    rep, D = cv.rep, cv.data
    for u, v, e in cv.program.graph.edges(data=True):
        if e.get("hazard") and u in rep and v in rep:
            a, b = rep[u], rep[v]
            if a != b and a in D and b in D and not D.has_edge(a, b):
                D.add_edge(a, b, pos=HAZARD)


def _index_ops(cv: CanonicalView) -> None:
    """The op nodes in program order and by canonical op: what the matcher iterates and pre-filters by."""
    D = cv.data
    cv.op_nodes = sorted((n for n, d in D.nodes(data=True) if d["kind"] == "op"), key=lambda n: D.nodes[n]["order"])
    by_op: dict[str, list[str]] = {}
    for n in cv.op_nodes:
        by_op.setdefault(D.nodes[n]["op"], []).append(n)
    cv.by_op = by_op


def _add_edge(D: nx.DiGraph, u: str, v: str, label: str) -> None:
    if D.has_edge(u, v):
        e = D.edges[u, v]
        e["pos"] = frozenset(e["pos"] | {label}) if e["pos"] != HAZARD else frozenset({label})
    else:
        D.add_edge(u, v, pos=frozenset({label}))


def _collapse_view_chains(cv: CanonicalView) -> None:
    """view(view(x)) -> one view, when the inner view's value has no other consumer."""
    D = cv.data
    merged: dict[str, str] = {}
    for n in sorted((n for n, d in D.nodes(data=True) if d["kind"] == "op" and d["op"] == VIEW),
                    key=lambda n: D.nodes[n]["order"]):
        preds = [(p, e) for p, e in D.pred[n].items() if e["pos"] != HAZARD]
        if len(preds) != 1 or D.in_degree(n) != 1:
            continue
        u, _ = preds[0]
        du = D.nodes[u]
        if du["kind"] != "op" or du["op"] != VIEW or D.out_degree(u) != 1:
            continue
        # u -> n is u's only use: u becomes part of n
        for p, eu in list(D.pred[u].items()):
            D.add_edge(p, n, pos=eu["pos"])
        D.nodes[n]["arg_srcs"] = du.get("arg_srcs", ())
        D.remove_node(u)
        cv.covers[n] = cv.covers.pop(u, (u,)) + cv.covers.get(n, (n,))
        merged[u] = n
    if not merged:
        return

    def final(x: str) -> str:
        while x in merged:
            x = merged[x]
        return x

    for orig, r in cv.rep.items():
        if r in merged:
            cv.rep[orig] = final(r)
    for f, src in cv.folded.items():
        if src in merged:
            cv.folded[f] = final(src)


def _folded_consumers(cv: CanonicalView) -> None:
    """For each folded node: the canonical nodes that consume its value (through other folded nodes too)."""
    G = cv.program.graph
    memo: dict[str, frozenset[str]] = {}

    def consumers(f: str) -> frozenset[str]:
        if f in memo:
            return memo[f]
        out: set[str] = set()
        for s, e in G.succ[f].items():
            if e.get("hazard") and not _reads(G, s, f):
                continue
            if s in cv.folded:
                out |= consumers(s)
            elif s in cv.rep:
                out.add(cv.rep[s])
        memo[f] = frozenset(out)
        return memo[f]

    for f in cv.folded:
        cv.folded_consumers[f] = consumers(f)
        cv.folded_by_source.setdefault(cv.folded[f], []).append(f)


def _reads(G: nx.DiGraph, consumer: str, producer: str) -> bool:
    d = G.nodes[consumer]
    if d["kind"] != "op":
        return True
    return any(is_ref and v.node == producer for _, v, is_ref in const_items(d.get("args", ()), d.get("kwargs", {}), ""))


def dtype_itemsize(dtype: str | None) -> int:
    if not isinstance(dtype, str):
        return 0
    t = getattr(torch, dtype, None)
    return t.itemsize if isinstance(t, torch.dtype) else 0


def is_const_source(cv: CanonicalView, n: str) -> bool:
    """An op that reads no tensor (arange, zeros, scalar_tensor...): cheap, any region may absorb it."""
    d = cv.data.nodes[n]
    return d["kind"] == "op" and not d["positions"] and not d.get("writes_state")


def is_glue(cv: CanonicalView, n: str) -> bool:
    d = cv.data.nodes[n]
    return d["kind"] == "op" and (d["op"] in LAYOUT_OPS or is_const_source(cv, n)) and not d.get("writes_state")

