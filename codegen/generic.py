"""Generic lowering: elementwise chains and feature-axis reductions become NKI without a pattern of their own.

A decoder variant fusegraph has no pattern for (a custom activation, a norm written another way) would
otherwise split the megakernel; a plugin pattern whose template has no lowering would not reach it at all. Which
ATen ops qualify, and how unmatched ops group into pieces, is matching's classification
(:mod:`fusegraph.matching.generic_ops`, re-exported here); this module translates a piece's ops into the op list
of one :class:`~.ops.generic.Elementwise` instruction evaluated on the same SBUF layout as the activations around
it (``[P, FT, T]``), so the piece joins the surrounding region.

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

from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch

from fusegraph.matching.activations import for_aten
from fusegraph.matching.generic_ops import (BINARY, LAYER_NORM, MATMULS, SUPPORTED, UNARY, VIEWS, GenericPiece,
                                            elementwise_reason, find_pieces, matmul_operands, piece_of,
                                            pow_exponent, supports, unsupported_reason, value_class, weight_of)

from .errors import CodegenError


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
        args = [a.node if hasattr(a, "node") else a for a in d["args"]]
        tensor_args = [a for a in args if isinstance(a, str)]
        for a in tensor_args:
            if a not in cls:
                raise CodegenError(f"generic lowering: input {a} of {n} is not available")
        if op == LAYER_NORM:  # several results: placed by the getitem nodes that read them
            ops += _layer_norm(n, d, tensor_args[0], cls, features)
            cls[n] = "tuple"
            continue
        dt = getattr(torch, d["dtype"])
        c = value_class(d["shape"], tokens, features)
        if c is None:
            raise CodegenError(f"generic lowering: {n} ({op}) has shape {d['shape']}, neither per token nor per feature")
        if op == "getitem" or op in VIEWS or op in _REDUCTIONS:
            ops.append(_structural(n, d, args, tensor_args, c, cls, features))
            cls[n] = ops[-1].cls
            continue
        ops += _arithmetic(n, d, op, args, cls, dt)
        cls[n] = ops[-1].cls
    return ops


_REDUCTIONS = ("aten.mean.dim", "aten.sum.dim_IntList")
_ONE_OPERAND = ("aten.neg.default", "aten.reciprocal.default", "aten._to_copy.default")


def _structural(n: str, d: dict, args: list, tensor_args: list[str], c: str, cls: dict[str, str],
                features: int) -> GOp:
    """A result of a multi-result op (``getitem``), a view, or a feature reduction (mean/sum over the features)."""
    op, dt = d["op"], getattr(torch, d["dtype"])
    if op == "getitem":
        src, i = tensor_args[0], int(args[1])
        if c != ("full" if i == 0 else "token"):
            raise CodegenError(f"generic lowering: result {i} of {src} has shape {d['shape']}")
        return GOp(n, "copy", (f"{src}#{i}",), c, dt)
    if op in VIEWS:
        return GOp(n, "copy", (tensor_args[0],), cls[tensor_args[0]], dt)
    if cls[tensor_args[0]] != "full":
        raise CodegenError(f"generic lowering: {op} of a {cls[tensor_args[0]]} value")
    scale = 1.0 / features if op == "aten.mean.dim" else 1.0
    return GOp(n, "sum", (tensor_args[0],), "token", dt, scale=scale)


def _arithmetic(n: str, d: dict, op: str, args: list, cls: dict[str, str], dt: torch.dtype) -> list[GOp]:
    """An elementwise op: unary activations, negation, reciprocal, cast, integer powers, clamps, binary ALU ops."""
    srcs: list[Any] = [a if isinstance(a, str) else float(a)
                       for a in args[: (1 if op in UNARY or op in _ONE_OPERAND else 2)]]
    if op in UNARY:
        fn = for_aten(op, d.get("kwargs"))
        if fn is None:
            raise CodegenError(f"generic lowering: {op} with {d.get('kwargs')}")
        return [GOp(n, f"act:{fn.nki}", tuple(srcs), cls[srcs[0]], dt)]
    if op == "aten.neg.default":
        return [GOp(n, "scalar:multiply", (srcs[0], -1.0), cls[srcs[0]], dt)]
    if op == "aten.reciprocal.default":
        return [GOp(n, "recip", (srcs[0],), cls[srcs[0]], dt)]
    if op == "aten._to_copy.default":
        return [GOp(n, "cast", (srcs[0],), cls[srcs[0]], dt)]
    if op == "aten.pow.Tensor_Scalar":
        return _pow(n, d, srcs[0], cls, dt)
    if op in ("aten.clamp.default", "aten.clamp_min.default", "aten.clamp_max.default"):
        return _clamp(n, d, op, srcs[0], cls, dt)
    if op in BINARY:
        return _binary(n, op, args, srcs, cls, dt)
    raise CodegenError(f"generic lowering: no rule for {op}")  # pragma: no cover - classification and switch agree


def _pow(n: str, d: dict, x: str, cls: dict[str, str], dt: torch.dtype) -> list[GOp]:
    """``x ** e`` for the exponents decoders use: 2 and 3 as products, +-0.5 as (r)sqrt, -1 as a reciprocal."""
    e = float(pow_exponent(d))
    if e == 2:
        return [GOp(n, "alu:multiply", (x, x), cls[x], dt)]
    if e == 3:
        cls[f"{n}__sq"] = cls[x]
        return [GOp(f"{n}__sq", "alu:multiply", (x, x), cls[x], torch.float32),
                GOp(n, "alu:multiply", (f"{n}__sq", x), cls[x], dt)]
    if e == 0.5:
        return [GOp(n, "act:sqrt", (x,), cls[x], dt)]
    if e == -0.5:
        return [GOp(n, "act:rsqrt", (x,), cls[x], dt)]
    if e == -1:
        return [GOp(n, "recip", (x,), cls[x], dt)]
    return [GOp(n, "copy", (x,), cls[x], dt)]


def _clamp(n: str, d: dict, op: str, x: str, cls: dict[str, str], dt: torch.dtype) -> list[GOp]:
    """A clamp as a maximum by the lower bound and a minimum by the upper one (either may be absent)."""
    lo = d["args"][1] if len(d["args"]) > 1 else d["kwargs"].get("min")
    hi = d["args"][2] if len(d["args"]) > 2 else d["kwargs"].get("max")
    if op == "aten.clamp_max.default":
        lo, hi = None, d["args"][1]
    ops: list[GOp] = []
    cur = x
    if lo is not None:
        ops.append(GOp(f"{n}__lo" if hi is not None else n, "scalar:maximum", (cur, float(lo)), cls[cur], dt))
        cur = f"{n}__lo" if hi is not None else n
        cls[cur] = cls[x]
    if hi is not None:
        ops.append(GOp(n, "scalar:minimum", (cur, float(hi)), cls[x], dt))
    return ops


def _binary(n: str, op: str, args: list, srcs: list[Any], cls: dict[str, str], dt: torch.dtype) -> list[GOp]:
    """A binary ALU op: a division as a product by the reciprocal, a constant first operand moved second
    (``c - x`` as ``-x + c``), broadcasts with the full operand first."""
    a, b = srcs
    alu = BINARY[op]
    ops: list[GOp] = []
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
        return ops + [GOp(n, f"scalar:{alu}", (a, b), cls[a], dt)]
    ca, cb = cls[a], cls[b]
    out_cls = "full" if "full" in (ca, cb) or ("feature" in (ca, cb)) else "token"
    if ca != "full" and out_cls == "full":  # put the full operand first (commutative ops only)
        if alu == "subtract":
            raise CodegenError("generic lowering: broadcast subtract with the full operand second")
        a, b = b, a
    return ops + [GOp(n, f"alu:{alu}", (a, b), out_cls, dt)]


def _layer_norm(n: str, d: dict, x: str, cls: dict[str, str], features: int) -> list[GOp]:
    """``native_layer_norm(x, [F], None, None, eps)`` as torch computes it: in fp32 (``x`` cast up), mean, centered
    variance, ``rsqrt(var + eps)``, one rounding at the end. Results ``n#0`` (normalized), ``n#1`` (mean) and
    ``n#2`` (rstd), read by the ``getitem`` nodes that follow."""
    if cls.get(x) != "full":
        raise CodegenError(f"generic lowering: LayerNorm of a {cls.get(x)} value")
    eps = float(d["args"][4]) if len(d["args"]) > 4 else 1e-5
    f32 = torch.float32
    out_dt, mean_dt, rstd_dt = (getattr(torch, t) for t in d["dtype"])
    xf, mean, xc, sq, var, ve, rstd = (f"{n}__{s}" for s in ("xf", "mean", "xc", "sq", "var", "ve", "rstd"))
    ops = [GOp(xf, "cast", (x,), "full", f32),
           GOp(mean, "sum", (xf,), "token", f32, scale=1.0 / features),
           GOp(xc, "alu:subtract", (xf, mean), "full", f32),
           GOp(sq, "alu:multiply", (xc, xc), "full", f32),
           GOp(var, "sum", (sq,), "token", f32, scale=1.0 / features),
           GOp(ve, "scalar:add", (var, eps), "token", f32),
           GOp(rstd, "act:rsqrt", (ve,), "token", f32),
           GOp(f"{n}#0", "alu:multiply", (xc, rstd), "full", out_dt),
           GOp(f"{n}#1", "copy", (mean,), "token", mean_dt),
           GOp(f"{n}#2", "copy", (rstd,), "token", rstd_dt)]
    for op in ops:
        cls[op.dst] = op.cls
    return ops


__all__ = ["BINARY", "elementwise_reason", "GenericPiece", "GOp", "MATMULS", "SUPPORTED", "UNARY", "VIEWS", "build_ops", "find_pieces",
           "matmul_operands", "piece_of", "supports", "unsupported_reason", "value_class", "weight_of"]
