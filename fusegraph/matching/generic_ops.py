"""Which ATen ops generic lowering can compute, and how connected unmatched ops group into pieces.

Region formation needs this classification (a piece of supported ops joins a region like a match, so a decoder
variant without a pattern does not split the megakernel) and codegen needs the same tables to translate the
ops (:mod:`fusegraph.codegen.generic`). It lives in matching because matching must not import codegen; codegen
imports it from here.

Two sets: ``PIECE_OPS``, what unmatched ops may form a ``fusegraph.generic`` piece of, and ``BODY_OPS``, what the
body of a *matched* pattern without a lowering of its own may contain. The body set adds composite ops whose
decomposition is exact only in the context a pattern vouches for (``aten.native_layer_norm`` without an affine
transform, and the ``getitem`` of its results) and small matmuls with a model weight (``mm``/``addmm`` of an
activation by ``t(weight)``, lowered as projections); an unmatched LayerNorm stays a blocker, so the report keeps
naming the pattern that was meant to match it.

Values are classified by shape relative to the step's tokens ``T`` and the piece's feature count ``F``:
``full`` ``[T, ..., F]``, ``token`` ``[T, ..., 1]`` (a feature reduction), ``feature`` ``[F]`` (a weight vector).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import networkx as nx

from .activations import TABLE, for_aten
from .tensor_ops import CATEGORY, tensor_reason

#: ATen unary ops the Scalar engine evaluates as an activation function (from the one activation table)
UNARY = {a.aten for a in TABLE}
#: ATen binary ops on the Vector engine's ALU (nl.<name>); division becomes multiply-by-reciprocal
BINARY = {
    "aten.add.Tensor": "add", "aten.sub.Tensor": "subtract", "aten.mul.Tensor": "multiply",
    "aten.div.Tensor": "divide", "aten.maximum.default": "maximum", "aten.minimum.default": "minimum",
}
OTHER = {"aten.neg.default", "aten.reciprocal.default", "aten.pow.Tensor_Scalar", "aten._to_copy.default",
         "aten.clamp.default", "aten.clamp_min.default", "aten.clamp_max.default", "aten.mean.dim",
         "aten.sum.dim_IntList"}
#: layout-only ops inside a piece (decode: they never move data between tokens and features)
VIEWS = {"aten.view.default", "aten._unsafe_view.default", "aten.unsqueeze.default", "aten.squeeze.dim",
         "aten.alias.default", "aten.clone.default", "aten.expand.default", "aten.reshape.default"}
LAYER_NORM = "aten.native_layer_norm.default"
#: matmuls a pattern body may hold: an activation times ``t(weight)`` (+ a bias), i.e. a projection
MATMULS = {"aten.mm.default", "aten.addmm.default"}
TRANSPOSE = "aten.t.default"

PIECE_OPS = UNARY | set(BINARY) | OTHER | VIEWS
BODY_OPS = PIECE_OPS | {LAYER_NORM, "getitem", TRANSPOSE} | MATMULS
SUPPORTED = PIECE_OPS  # (the historical name)
FLOATS = ("float32", "bfloat16", "float16")


@dataclass
class GenericPiece:
    """A connected set of ops generic lowering can take, with its boundary."""

    nodes: tuple[str, ...]  # in topological order
    inputs: tuple[str, ...]  # program nodes read from outside the piece
    outputs: tuple[str, ...]  # nodes of the piece read outside it
    layer: int | None = None
    module: str | None = None
    ops: dict[str, int] = field(default_factory=dict)
    #: every op depends only on step inputs, buffers and constants (positions, masks): computed on the host before
    #: the kernel, like the host-side rotary-table and mask patterns, because a pattern may read it as a per-step
    #: input converted on the host (a boolean mask made additive, a paged mask's extents)
    host: bool = False


def _numel(shape: Any) -> int:
    return math.prod(int(s) for s in shape) if shape else 1


def value_class(shape: Any, tokens: int, features: int) -> str | None:
    """full / token / feature (see the module doc), or None for a shape generic lowering cannot place."""
    if not shape:
        return None
    n = _numel(shape)
    if n == tokens * features and int(shape[0]) == tokens:
        return "full"
    if n == tokens and int(shape[0]) == tokens:
        return "token"
    if n == features:
        return "feature"
    return None


def unsupported_reason(G: nx.DiGraph, node: str, body: bool = False) -> str | None:
    """Why generic lowering cannot compute this op (None: it can; shapes are checked when a piece is lowered):
    on the SBUF elementwise path, or else on the tensor path (:mod:`.tensor_ops`, any shape). ``body``: the op is
    part of a matched pattern's body (see ``BODY_OPS``; bodies take the elementwise path only)."""
    why = elementwise_reason(G, node, body)
    if why is None or body:
        return why
    return None if tensor_reason(G, node) is None else why


def elementwise_reason(G: nx.DiGraph, node: str, body: bool = False) -> str | None:
    """Why the SBUF elementwise path cannot compute this op (see :func:`unsupported_reason`)."""
    d = G.nodes[node]
    op = d.get("op")
    if d.get("kind") != "op":
        return f"{node} is not an op"
    if d.get("writes_state"):
        return f"{op} writes state in place"
    if op not in (BODY_OPS if body else PIECE_OPS):
        return f"{op} is not an op generic lowering computes"
    if op == "aten.pow.Tensor_Scalar" and pow_exponent(d) not in (2, 3, 0.5, -0.5, -1, 1):
        return f"{op} with exponent {pow_exponent(d)}"
    if op in ("aten.mean.dim", "aten.sum.dim_IntList"):
        dims = d["args"][1] if len(d["args"]) > 1 else None
        if not isinstance(dims, (list, tuple)) or list(dims) not in ([-1], [len(d["shape"]) - 1 if d["shape"] else -1]):
            return f"{op} over dims {dims} (only the last, feature dim reduces)"
    if op in UNARY and for_aten(op, d.get("kwargs")) is None:
        return f"{op} with {d.get('kwargs')}"
    if op == LAYER_NORM:
        return _layer_norm_reason(G, d)
    if op == TRANSPOSE:
        return None if _is_weight(G, d["args"][0], 2) else "a transpose of something other than a model weight"
    if op in MATMULS:
        return _matmul_reason(G, node)
    if op == "getitem":
        src = d["args"][0]
        if not hasattr(src, "node") or G.nodes[src.node].get("op") != LAYER_NORM:
            return "getitem of something other than a LayerNorm's results"
        return None
    return None if isinstance(d.get("dtype"), str) and d["dtype"] in FLOATS else f"{op} in {d.get('dtype')}"


def _layer_norm_reason(G: nx.DiGraph, d: dict) -> str | None:
    args = list(d["args"]) + [None] * 5
    x, shape, weight, bias = args[0], args[1], args[2], args[3]
    if weight is not None or bias is not None:
        return "native_layer_norm with a weight or bias (the built-in fusegraph.layernorm lowers those)"
    xshape = G.nodes[x.node].get("shape") if hasattr(x, "node") else None
    if not xshape or list(shape or []) != [xshape[-1]]:
        return f"native_layer_norm over {shape} of a {xshape} value (only the last dim normalizes)"
    dtypes = d.get("dtype")
    if not isinstance(dtypes, tuple) or any(t not in FLOATS for t in dtypes):
        return f"native_layer_norm in {dtypes}"
    return None


def _is_weight(G: nx.DiGraph, ref: Any, ndim: int) -> bool:
    if not hasattr(ref, "node"):
        return False
    d = G.nodes[ref.node]
    kind = str(getattr(d.get("input_kind"), "value", d.get("input_kind")))
    return d.get("kind") == "input" and kind in ("weight", "buffer") and len(d.get("shape") or ()) == ndim


def matmul_operands(G: nx.DiGraph, node: str) -> tuple[Any, Any, Any]:
    """``(x, transposed weight, bias or None)`` of an ``mm``/``addmm`` node (argument references)."""
    d = G.nodes[node]
    args = list(d["args"])
    if d["op"] == "aten.addmm.default":
        return args[1], args[2], args[0]
    return args[0], args[1], None


def weight_of(G: nx.DiGraph, transposed: Any) -> str | None:
    """The weight input ``[N, K]`` behind a matmul's ``t(weight)`` operand, or None."""
    if not hasattr(transposed, "node"):
        return None
    t = G.nodes[transposed.node]
    if t.get("op") != TRANSPOSE or not _is_weight(G, t["args"][0], 2):
        return None
    return t["args"][0].node


def _matmul_reason(G: nx.DiGraph, node: str) -> str | None:
    d = G.nodes[node]
    x, wt, bias = matmul_operands(G, node)
    if not hasattr(x, "node") or weight_of(G, wt) is None:
        return f"{d['op']} of two activations (only an activation times a model weight is a projection)"
    if bias is not None and not _is_weight(G, bias, 1):
        return f"{d['op']} with a bias that is not a model weight vector"
    if any(d.get("kwargs", {}).get(k, 1) != 1 for k in ("beta", "alpha")):
        return f"{d['op']} with alpha/beta"
    return None if d.get("dtype") in FLOATS else f"{d['op']} in {d.get('dtype')}"


def supports(G: nx.DiGraph, node: str, body: bool = False) -> bool:
    """Can generic lowering compute this op (ignoring shapes, checked when a piece is lowered)?"""
    return unsupported_reason(G, node, body) is None


def pow_exponent(d: dict) -> Any:
    return d["args"][1] if len(d["args"]) > 1 else None


def piece_of(G: nx.DiGraph, nodes: Iterable[str]) -> GenericPiece:
    """The piece made of ``nodes`` (op nodes), with the values it reads from and hands to the rest of the graph."""
    comp = set(nodes)
    ordered = tuple(sorted(comp, key=lambda n: G.nodes[n]["order"]))
    ins: list[str] = []
    for n in ordered:
        for p in G.predecessors(n):
            if p not in comp and p not in ins and not G.edges[p, n].get("hazard"):
                ins.append(p)
    outs = tuple(n for n in ordered if any(s not in comp for s in G.successors(n)))
    layers = {G.nodes[n].get("layer") for n in ordered} - {None}
    ops: dict[str, int] = {}
    for n in ordered:
        ops[G.nodes[n]["op"]] = ops.get(G.nodes[n]["op"], 0) + 1
    return GenericPiece(nodes=ordered, inputs=tuple(ins), outputs=outs, layer=min(layers) if layers else None,
                        module=G.nodes[ordered[0]].get("module") if ordered else None, ops=ops)


def find_pieces(G: nx.DiGraph, candidates: set[str]) -> list[GenericPiece]:
    """Group supported candidate ops into weakly connected pieces (a piece never contains a pure view alone)."""
    meta = metadata_nodes(G)
    # step metadata runs on the host (eagerly): any op; the rest only what generic lowering computes
    ok = {n for n in candidates if (n in meta and G.nodes[n].get("kind") == "op") or supports(G, n)}
    pieces = []
    for host in (True, False):  # step metadata and the rest never share a piece (see GenericPiece.host)
        H = G.subgraph({n for n in ok if (n in meta) == host})
        for comp in nx.weakly_connected_components(H):
            for part in convex_parts(G, comp):
                for sub in nx.weakly_connected_components(G.subgraph(part)):
                    if all(G.nodes[n]["op"] in VIEWS or CATEGORY.get(G.nodes[n]["op"]) == "view" for n in sub):
                        continue  # layout glue between matches: region formation absorbs it
                    piece = piece_of(G, sub)
                    piece.host = host
                    pieces.append(piece)
    return pieces


def _floating(d: dict) -> bool:
    """A float step input can be an activation (a user's step function's ``x``); ids, positions and boolean masks
    are integers or booleans."""
    dtype = d.get("dtype")
    return isinstance(dtype, str) and dtype.startswith(("float", "bfloat", "complex"))


def _counter(d: dict) -> bool:
    """A state tensor that is a step counter (a cache's cumulative length: one integer), not model data."""
    shape, dtype = d.get("shape"), d.get("dtype")
    return isinstance(shape, tuple) and _numel(shape) <= 1 and isinstance(dtype, str) and dtype.startswith("int")


def metadata_nodes(G: nx.DiGraph) -> set[str]:
    """Nodes whose value depends only on integer or boolean step inputs (token ids, positions, masks), buffers,
    step counters and constants: what a step computes about positions and masks, never from the hidden state, a
    weight or a state tensor."""
    meta: set[str] = set()
    for n in sorted(G.nodes, key=lambda m: G.nodes[m].get("order", 0)):
        d = G.nodes[n]
        if d.get("kind") == "input":
            kind = str(getattr(d.get("input_kind"), "value", d.get("input_kind")))
            if kind == "buffer" or (kind in ("step", "scalar") and not _floating(d)) or (kind == "state" and _counter(d)):
                meta.add(n)
        elif d.get("kind") == "op" and not d.get("writes_state") and not d.get("collective"):
            preds = [p for p in G.predecessors(n) if not G.edges[p, n].get("hazard")]
            if all(p in meta for p in preds):
                meta.add(n)
    return meta


def convex_parts(G: nx.DiGraph, nodes: Iterable[str]) -> list[set[str]]:
    """``nodes`` split into convex sets: a connected group of unmatched ops can wrap around a match (an MLA
    attention's ops feed a norm match whose result they read again), and such a piece could never join a region
    with that match. Each node's *depth* is the number of times a path into it left the group; nodes of equal
    depth are convex (a path that leaves the group and comes back arrives one depth deeper, and depth never
    decreases along a path)."""
    inside = set(nodes)
    start = min(G.nodes[n]["order"] for n in inside)
    end = max(G.nodes[n]["order"] for n in inside)
    depth: dict[str, int] = {}
    for n in sorted((m for m in G.nodes if start <= G.nodes[m].get("order", -1) <= end),
                    key=lambda m: G.nodes[m]["order"]):
        d = 0
        for p in G.predecessors(n):
            if p in depth:
                d = max(d, depth[p] + (1 if p in inside and n not in inside else 0))
        if n in inside or d:
            depth[n] = d
    parts: dict[int, set[str]] = {}
    for n in inside:
        parts.setdefault(depth[n], set()).add(n)
    return [parts[k] for k in sorted(parts)]


__all__ = ["BINARY", "BODY_OPS", "elementwise_reason", "GenericPiece", "LAYER_NORM", "MATMULS", "OTHER", "PIECE_OPS", "SUPPORTED",
           "TRANSPOSE", "UNARY", "VIEWS", "convex_parts", "find_pieces", "metadata_nodes", "matmul_operands", "piece_of", "pow_exponent", "supports",
           "unsupported_reason", "value_class", "weight_of"]
