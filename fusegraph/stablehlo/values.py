"""Deferred values of the StableHLO -> ATen translation, and the element-type mapping.

StableHLO spells out what ATen leaves implicit: every broadcast is an explicit ``broadcast_in_dim``, every scalar
constant is a tensor, a ``mean`` is a ``reduce`` and a ``divide``. Captured PyTorch code (and so fusegraph's
patterns) has none of that: ``x * 0.125``, ``var + eps``, ``mean(-1, keepdim=True)``. So the translation keeps
such values *deferred* and lets each consumer decide how to read them: an elementwise op reads a splat constant
as a Python number and a broadcast as PyTorch's implicit broadcasting; anything else materializes them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .ir import TensorType, UnsupportedOp

#: StableHLO element type -> torch dtype. 32-bit signed integers compute as int64 (what PyTorch indexes with
#: and what the patterns expect); see docs/jax.md for what that means for overflow.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64, "i1": torch.bool,
    "i8": torch.int8, "i16": torch.int16, "i32": torch.int64, "i64": torch.int64, "ui8": torch.uint8,
}


def torch_dtype(t: TensorType | str, what: str = "type") -> torch.dtype:
    name = t.dtype if isinstance(t, TensorType) else t
    if name not in TORCH_DTYPES:
        raise UnsupportedOp(what, f"element type {name}")
    return TORCH_DTYPES[name]


def python_scalar(value: Any, dtype: str) -> bool | int | float:
    if dtype == "i1":
        return bool(value)
    if dtype.startswith(("i", "ui")):
        return int(value)
    return float(value)


@dataclass
class Splat:
    """A constant with every element equal (``dense<1e-6>`` and its broadcasts)."""

    value: bool | int | float
    dtype: str
    shape: tuple[int, ...]


@dataclass
class Bcast:
    """``broadcast_in_dim(src, shape, dims)``, not materialized yet."""

    src: Any
    shape: tuple[int, ...]
    dims: tuple[int, ...]


@dataclass
class Reduced:
    """A single-operand ``reduce`` (sum/max/min/prod/all/any over ``dims``): materialized with or without
    ``keepdim`` depending on whether the consumer broadcasts it back (the usual ``keepdims=True``)."""

    kind: str
    src: torch.Tensor
    dims: tuple[int, ...]
    init: Any  # Python number, or None when it is the reduction's identity
    shape: tuple[int, ...]
    memo: dict = field(default_factory=dict)


@dataclass
class Transposed:
    """A weight ``W[K..., N...]`` the program receives as one ``[N, K]`` matrix (``W.reshape(K, N).T``, HF's
    layout), because it is read as the right operand of ``x @ W`` (also einsum-style ``bqm,muh->bquh``): such
    products become ``linear(x, t)``, what the patterns match."""

    t: torch.Tensor
    shape: tuple[int, ...] | None = None  # the argument's own shape when it is not 2-d (``[K, heads, D]``)


@dataclass
class Stacked:
    """A value of logical shape ``shape`` held as separate tensors, one per index over ``stack_dims`` (Keras's
    stacked KV cache ``[B, layers, 2, L, KV, D]`` as one ``[B, KV, L, D]`` tensor per layer and k/v, HF's
    per-layer cache). ``parts[key]`` (``key``: one coordinate per stack dim) holds the part in *storage* layout:
    the logical part (``shape`` without the stack dims) is ``part.permute(perm)``. With no stack dims it is one
    tensor viewed through ``perm``. Only the layout differs from the logical tensor, never a value
    (:mod:`.stacked` has the ops that keep it split)."""

    parts: dict
    shape: tuple[int, ...]
    stack_dims: tuple[int, ...]
    perm: tuple[int, ...]


def stacked_tensor(s: Stacked) -> torch.Tensor:
    """The logical tensor of a :class:`Stacked` value (its parts viewed through ``perm`` and concatenated)."""
    rank = len(s.shape)
    sd = list(s.stack_dims)

    def build(prefix: tuple) -> torch.Tensor:
        if len(prefix) == len(sd):
            t = permuted(s.parts[prefix], s.perm)
            for d in sd:
                t = t.unsqueeze(d)
            return t
        k = len(prefix)
        pieces = [build(prefix + (i,)) for i in range(s.shape[sd[k]])]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=sd[k] - rank)

    return build(())


@dataclass
class ExpertWeight:
    """One of keras-hub's expert weights (``gate``/``up`` ``[E, H, I]``, ``down`` ``[E, I, H]``) read from the
    program input that holds it in HF's layout (``gate_up_proj[E, 2I, H]``, ``down_proj[E, H, I]``)."""

    t: torch.Tensor
    kind: str  # "gate" | "up" | "down"

    def tensor(self) -> torch.Tensor:
        if self.kind == "down":
            return self.t.transpose(1, 2)
        inter = self.t.shape[1] // 2
        half = self.t[:, :inter] if self.kind == "gate" else self.t[:, inter:]
        return half.transpose(1, 2)


def permuted(t: torch.Tensor, perm: tuple[int, ...]) -> torch.Tensor:
    """``t.permute(perm)`` the way PyTorch code writes it: nothing for the identity, ``transpose`` for a swap."""
    moved = [i for i, p in enumerate(perm) if p != i]
    if not moved:
        return t
    if len(moved) == 2:
        return t.transpose(*moved)
    return t.permute(list(perm))


def reduce_tensor(r: Reduced, keepdim: bool) -> torch.Tensor:
    key = bool(keepdim)
    if key in r.memo:
        return r.memo[key]
    rank = r.src.dim()
    dims = [d - rank for d in r.dims]  # negative dims, as captured PyTorch code writes them
    if r.kind == "sum":
        out = torch.sum(r.src, dims, keepdim=keepdim)
    elif r.kind == "mean":
        out = torch.mean(r.src, dims, keepdim=keepdim)
    elif r.kind == "max":
        out = torch.amax(r.src, dims, keepdim=keepdim)
    elif r.kind == "min":
        out = torch.amin(r.src, dims, keepdim=keepdim)
    else:  # prod / all / any: one dim at a time (torch has no multi-dim forms)
        fn = {"prod": torch.prod, "all": torch.all, "any": torch.any}[r.kind]
        out = r.src
        for d in sorted(dims):
            out = fn(out, d, keepdim=True)
        if not keepdim:
            out = out.reshape([s for i, s in enumerate(r.src.shape) if i - rank not in dims])
    if r.init is not None:
        if r.kind == "sum":
            out = out + r.init
        elif r.kind == "prod":
            out = out * r.init
        elif r.kind == "max":
            out = torch.clamp(out, min=r.init)
        elif r.kind == "min":
            out = torch.clamp(out, max=r.init)
        elif r.kind == "all" and not r.init:
            out = torch.zeros_like(out)
        elif r.kind == "any" and r.init:
            out = torch.ones_like(out)
    r.memo[key] = out
    return out


def _keep_shape(src_shape: tuple[int, ...], out_rank: int, dims: tuple[int, ...]) -> list[int]:
    shape = [1] * out_rank
    for s, d in zip(src_shape, dims):
        shape[d] = s
    return shape


def bcast_source(b: Bcast) -> torch.Tensor:
    """The broadcast's source laid out in the output's rank (size-1 dims where it broadcasts)."""
    src = b.src
    if isinstance(src, Reduced) and _reinserts(src, b):
        return reduce_tensor(src, keepdim=True)
    t = materialize(src)
    if list(b.dims) != sorted(b.dims):
        order = sorted(range(len(b.dims)), key=lambda i: b.dims[i])
        t = t.permute(order)
        dims = tuple(sorted(b.dims))
    else:
        dims = tuple(b.dims)
    keep = _keep_shape(tuple(t.shape), len(b.shape), dims)
    return t if list(t.shape) == keep else t.reshape(keep)


def _reinserts(r: Reduced, b: Bcast) -> bool:
    """Does ``broadcast_in_dim`` put the reduced dims back as size-1 dims, in place (``keepdims=True``)?"""
    kept = [d for d in range(len(r.src.shape)) if d not in r.dims]
    return len(b.shape) == len(r.src.shape) and list(b.dims) == kept


def materialize(v: Any) -> torch.Tensor:
    """A real (traced) tensor for a deferred value."""
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, Splat):
        return torch.full(v.shape, v.value, dtype=torch_dtype(v.dtype))
    if isinstance(v, Reduced):
        return reduce_tensor(v, keepdim=False)
    if isinstance(v, Transposed):
        w = v.t.t()
        return w if v.shape is None or tuple(w.shape) == tuple(v.shape) else w.reshape(v.shape)
    if isinstance(v, Bcast):
        t = bcast_source(v)
        return t if tuple(t.shape) == tuple(v.shape) else t.expand(v.shape)
    if isinstance(v, Stacked):
        return stacked_tensor(v)
    if isinstance(v, ExpertWeight):
        return v.tensor()
    raise TypeError(f"cannot materialize {type(v).__name__}")


def elementwise_operand(v: Any, out_rank: int, implicit: bool = True) -> Any:
    """``v`` as an operand of an elementwise op whose result has rank ``out_rank``: splats as Python numbers,
    broadcasts implicit (PyTorch's right-aligned broadcasting) when ``implicit``, else laid out in the result's
    rank with size-1 dims (the ``unsqueeze``/``view`` captured code writes)."""
    if isinstance(v, Splat):
        return v.value
    if isinstance(v, Bcast):
        if isinstance(v.src, Splat):
            return v.src.value
        src = v.src
        if implicit and not isinstance(src, Reduced) and list(v.dims) == list(range(out_rank - len(v.dims), out_rank)):
            return materialize(src)
        return bcast_source(v)
    return materialize(v)


def elementwise_operands(vals: list, shape: tuple[int, ...]) -> list:
    """Operands of one elementwise op: implicit broadcasting where that yields the result's shape (what
    PyTorch code writes, ``x * inv_freq``), else explicit size-1 dims for the broadcast ones."""
    rank = len(shape)
    ops = [elementwise_operand(v, rank) for v in vals]
    shapes = [tuple(o.shape) for o in ops if isinstance(o, torch.Tensor)]
    try:
        ok = bool(shapes) and tuple(torch.broadcast_shapes(*shapes)) == tuple(shape)
    except RuntimeError:
        ok = False
    if ok or not any(isinstance(v, Bcast) for v in vals):
        return ops
    return [elementwise_operand(v, rank, implicit=False) for v in vals]
