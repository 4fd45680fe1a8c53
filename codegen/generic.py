"""Generic lowering: unmatched elementwise chains and feature-axis reductions become NKI without a pattern.

A decoder variant fusegraph has no pattern for (a custom activation, a norm written another way) would
otherwise split the megakernel. This module decides which ATen ops it can lower, groups connected unmatched
ops into pieces, and lowers a piece to one :class:`~.ir.Elementwise` instruction evaluated on the same SBUF
layout as the activations around it (``[P, FT, T]``), so the piece joins the surrounding region.

Layout choice (the "which dimension on partitions" question): features go on partitions, tokens on the free
axis — the layout every other template uses, so no data moves; a reduction over the feature axis is a
ones-matmul (sum over partitions and chunks, broadcast back to every partition), which leaves a per-token
scalar as a ``[P, T]`` tile that broadcasts over features for free. Values are classified by shape:

* ``full``: one value per token and feature (``[T, ..., F]``),
* ``token``: one value per token (``[T, ..., 1]``): the result of a feature reduction,
* ``feature``: one value per feature, shared by tokens (a weight vector ``[F]``),
* ``const``: a Python scalar.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch

from .errors import CodegenError

#: ATen unary ops the Scalar engine evaluates as an activation function (nl.<name>)
UNARY_ACT = {
    "aten.exp.default": "exp", "aten.log.default": "log", "aten.tanh.default": "tanh",
    "aten.sigmoid.default": "sigmoid", "aten.silu.default": "silu", "aten.relu.default": "relu",
    "aten.sqrt.default": "sqrt", "aten.rsqrt.default": "rsqrt", "aten.abs.default": "abs", "aten.erf.default": "erf",
}
#: ATen binary ops on the Vector engine's ALU (nl.<name>); division becomes multiply-by-reciprocal
BINARY = {
    "aten.add.Tensor": "add", "aten.sub.Tensor": "subtract", "aten.mul.Tensor": "multiply",
    "aten.div.Tensor": "divide", "aten.maximum.default": "maximum", "aten.minimum.default": "minimum",
}
OTHER = {"aten.neg.default", "aten.reciprocal.default", "aten.gelu.default", "aten.pow.Tensor_Scalar",
         "aten._to_copy.default", "aten.clamp.default", "aten.clamp_min.default", "aten.clamp_max.default",
         "aten.mean.dim", "aten.sum.dim_IntList"}
#: layout-only ops inside a piece (decode: they never move data between tokens and features)
VIEWS = {"aten.view.default", "aten._unsafe_view.default", "aten.unsqueeze.default", "aten.squeeze.dim",
         "aten.alias.default", "aten.clone.default", "aten.expand.default", "aten.reshape.default"}

SUPPORTED = set(UNARY_ACT) | set(BINARY) | OTHER | VIEWS


@dataclass
class GenericPiece:
    """A connected set of unmatched ops generic lowering can take, with its boundary."""

    nodes: tuple[str, ...]  # in topological order
    inputs: tuple[str, ...]  # program nodes read from outside the piece
    outputs: tuple[str, ...]  # nodes of the piece read outside it
    layer: int | None = None
    module: str | None = None
    ops: dict[str, int] = field(default_factory=dict)


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


def supports(G: nx.DiGraph, node: str) -> bool:
    """Can generic lowering compute this op (ignoring shapes, checked when a piece is lowered)?"""
    d = G.nodes[node]
    if d.get("kind") != "op" or d.get("writes_state") or d["op"] not in SUPPORTED:
        return False
    if d["op"] == "aten.pow.Tensor_Scalar" and _pow_exponent(d) not in (2, 3, 0.5, -0.5, -1, 1):
        return False
    if d["op"] in ("aten.mean.dim", "aten.sum.dim_IntList"):
        dims = d["args"][1] if len(d["args"]) > 1 else None
        if not isinstance(dims, (list, tuple)) or list(dims) not in ([-1], [len(d["shape"]) - 1 if d["shape"] else -1]):
            return False
    if d["op"] == "aten.gelu.default" and d["kwargs"].get("approximate", "none") not in ("none", "tanh"):
        return False
    return isinstance(d.get("dtype"), str) and d["dtype"] in ("float32", "bfloat16", "float16")


def _pow_exponent(d: dict) -> Any:
    return d["args"][1] if len(d["args"]) > 1 else None


def find_pieces(G: nx.DiGraph, candidates: set[str]) -> list[GenericPiece]:
    """Group supported candidate ops into weakly connected pieces (a piece never contains a pure view alone)."""
    ok = {n for n in candidates if supports(G, n)}
    H = G.subgraph(ok)
    pieces = []
    for comp in nx.weakly_connected_components(H):
        if all(G.nodes[n]["op"] in VIEWS for n in comp):
            continue
        nodes = tuple(sorted(comp, key=lambda n: G.nodes[n]["order"]))
        ins = []
        for n in nodes:
            for p in G.predecessors(n):
                if p not in comp and p not in ins and not G.edges[p, n].get("hazard"):
                    ins.append(p)
        outs = tuple(n for n in nodes if any(s not in comp for s in G.successors(n)))
        layers = {G.nodes[n].get("layer") for n in nodes} - {None}
        ops: dict[str, int] = {}
        for n in nodes:
            ops[G.nodes[n]["op"]] = ops.get(G.nodes[n]["op"], 0) + 1
        pieces.append(GenericPiece(nodes=nodes, inputs=tuple(ins), outputs=outs,
                                   layer=min(layers) if layers else None,
                                   module=G.nodes[nodes[0]].get("module"), ops=ops))
    return pieces


# ---- the instruction's op list -----------------------------------------------------------------------------
@dataclass
class GOp:
    """One step of an Elementwise instruction: ``dst = op(srcs...)``; names are piece-local."""

    dst: str
    op: str  # act:<fn> | alu:<op> | recip | neg | cast | sum | copy | scalar:<alu>
    srcs: tuple[Any, ...]  # local names or float constants
    cls: str  # value class of dst: full | token
    dtype: torch.dtype
    scale: float = 1.0  # for sum: multiply the result (mean = sum * 1/F)


def build_ops(G: nx.DiGraph, piece: GenericPiece, tokens: int, features: int,
              input_classes: dict[str, str]) -> list[GOp]:
    """Translate the piece's ATen ops into GOps; raise CodegenError for shapes the lowering cannot place."""
    cls: dict[str, str] = dict(input_classes)
    ops: list[GOp] = []
    for n in piece.nodes:
        d = G.nodes[n]
        op = d["op"]
        dt = getattr(torch, d["dtype"])
        c = value_class(d["shape"], tokens, features)
        if c is None:
            raise CodegenError(f"generic lowering: {n} ({op}) has shape {d['shape']}, neither per token nor per feature")
        args = [a.node if hasattr(a, "node") else a for a in d["args"]]
        tensor_args = [a for a in args if isinstance(a, str)]
        for a in tensor_args:
            if a not in cls:
                raise CodegenError(f"generic lowering: input {a} of {n} is not available")
        if op in VIEWS:
            cls[n] = cls[tensor_args[0]]
            ops.append(GOp(n, "copy", (tensor_args[0],), cls[n], dt))
            continue
        if op in ("aten.mean.dim", "aten.sum.dim_IntList"):
            if cls[tensor_args[0]] != "full":
                raise CodegenError(f"generic lowering: {op} of a {cls[tensor_args[0]]} value")
            scale = 1.0 / features if op == "aten.mean.dim" else 1.0
            cls[n] = "token"
            ops.append(GOp(n, "sum", (tensor_args[0],), "token", dt, scale=scale))
            continue
        srcs: list[Any] = []
        for a in args[: (1 if op in UNARY_ACT or op in ("aten.neg.default", "aten.reciprocal.default",
                                                        "aten._to_copy.default", "aten.gelu.default") else 2)]:
            srcs.append(a if isinstance(a, str) else float(a))
        if op in UNARY_ACT:
            ops.append(GOp(n, f"act:{UNARY_ACT[op]}", tuple(srcs), cls[srcs[0]], dt))
        elif op == "aten.gelu.default":
            fn = "gelu_apprx_tanh" if d["kwargs"].get("approximate") == "tanh" else "gelu"
            ops.append(GOp(n, f"act:{fn}", tuple(srcs), cls[srcs[0]], dt))
        elif op == "aten.neg.default":
            ops.append(GOp(n, "scalar:multiply", (srcs[0], -1.0), cls[srcs[0]], dt))
        elif op == "aten.reciprocal.default":
            ops.append(GOp(n, "recip", (srcs[0],), cls[srcs[0]], dt))
        elif op == "aten._to_copy.default":
            ops.append(GOp(n, "cast", (srcs[0],), cls[srcs[0]], dt))
        elif op == "aten.pow.Tensor_Scalar":
            e = float(_pow_exponent(d))
            x = srcs[0]
            if e == 2:
                ops.append(GOp(n, "alu:multiply", (x, x), cls[x], dt))
            elif e == 3:
                ops.append(GOp(f"{n}__sq", "alu:multiply", (x, x), cls[x], torch.float32))
                ops.append(GOp(n, "alu:multiply", (f"{n}__sq", x), cls[x], dt))
                cls[f"{n}__sq"] = cls[x]
            elif e == 0.5:
                ops.append(GOp(n, "act:sqrt", (x,), cls[x], dt))
            elif e == -0.5:
                ops.append(GOp(n, "act:rsqrt", (x,), cls[x], dt))
            elif e == -1:
                ops.append(GOp(n, "recip", (x,), cls[x], dt))
            else:
                ops.append(GOp(n, "copy", (x,), cls[x], dt))
        elif op in ("aten.clamp.default", "aten.clamp_min.default", "aten.clamp_max.default"):
            lo = d["args"][1] if len(d["args"]) > 1 else d["kwargs"].get("min")
            hi = d["args"][2] if len(d["args"]) > 2 else d["kwargs"].get("max")
            if op == "aten.clamp_max.default":
                lo, hi = None, d["args"][1]
            cur = srcs[0]
            if lo is not None:
                ops.append(GOp(f"{n}__lo" if hi is not None else n, "scalar:maximum", (cur, float(lo)), cls[cur], dt))
                cur = f"{n}__lo" if hi is not None else n
                cls[cur] = cls[srcs[0]]
            if hi is not None:
                ops.append(GOp(n, "scalar:minimum", (cur, float(hi)), cls[srcs[0]], dt))
        elif op in BINARY:
            a, b = srcs
            alu = BINARY[op]
            if op in ("aten.add.Tensor", "aten.sub.Tensor") and len(args) > 2 and args[2] not in (1, 1.0):
                raise CodegenError("generic lowering: add/sub with alpha != 1")
            if isinstance(a, float) and isinstance(b, float):
                raise CodegenError(f"generic lowering: {op} of two constants")
            if alu == "divide":
                if isinstance(b, float):
                    alu, b = "multiply", 1.0 / b
                else:
                    ops.append(GOp(f"{n}__rb", "recip", (b,), cls[b], torch.float32))
                    cls[f"{n}__rb"] = cls[b]
                    b, alu = f"{n}__rb", "multiply"
            if isinstance(a, float):
                if alu == "subtract":  # c - x = (x * -1) + c
                    ops.append(GOp(f"{n}__neg", "scalar:multiply", (b, -1.0), cls[b], torch.float32))
                    cls[f"{n}__neg"] = cls[b]
                    a, b, alu = f"{n}__neg", a, "add"
                else:
                    a, b = b, a
            if isinstance(b, float):
                ops.append(GOp(n, f"scalar:{alu}", (a, b), cls[a], dt))
            else:
                ca, cb = cls[a], cls[b]
                out_cls = "full" if "full" in (ca, cb) or ("feature" in (ca, cb)) else "token"
                if ca != "full" and out_cls == "full":  # put the full operand first (commutative ops only)
                    if alu == "subtract":
                        raise CodegenError("generic lowering: broadcast subtract with the full operand second")
                    a, b = b, a
                ops.append(GOp(n, f"alu:{alu}", (a, b), out_cls, dt))
        else:  # pragma: no cover - SUPPORTED and this switch agree
            raise CodegenError(f"generic lowering: no rule for {op}")
        cls[n] = ops[-1].cls
    return ops


__all__ = ["GenericPiece", "GOp", "SUPPORTED", "build_ops", "find_pieces", "supports", "value_class"]
