"""Tensor references of the tensor path: a strided view ``(shape, strides, offset)`` of one HBM buffer.

Why strided views: on the tensor path every value lives in HBM (a kernel argument, or a buffer of the kernel's
scratch), and every op reads its operands through a DMA access pattern. A view op (transpose, slice, expand,
select, unsqueeze, a reshape of a contiguous run) then moves no data at all: it is a new :class:`TRef` of the same
buffer, and the consumer's access pattern walks it. The rules are PyTorch's own stride arithmetic, so a view here
addresses exactly the elements the eager view does; where PyTorch would have to copy (a reshape of a transposed
value), :func:`view_of` says so and the lowering materializes the value first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from .. import ir

INT64_MAX = 9223372036854775807


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class TRef:
    """Elements ``value[offset + sum(i_d * strides[d])]`` for every index ``i`` of ``shape`` (``value``'s buffer
    read as a flat array)."""

    value: ir.Value
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def dtype(self) -> Any:
        return self.value.dtype

    def contiguous(self) -> bool:
        """Row-major without gaps (any offset): a reshape is a new view, a store is one contiguous run."""
        return all(st == cs for st, cs, n in zip(self.strides, contiguous_strides(self.shape), self.shape) if n != 1)

    def whole(self) -> bool:
        """The whole buffer in row-major order."""
        return self.offset == 0 and self.contiguous() and self.numel == math.prod(self.value.shape)


def whole(v: ir.Value) -> TRef:
    """The buffer ``v`` as it is."""
    shape = tuple(int(s) for s in v.shape)
    return TRef(v, shape, contiguous_strides(shape), 0)


def broadcast_to(ref: TRef, shape: Sequence[int]) -> TRef:
    """``ref`` expanded to ``shape`` by PyTorch's broadcasting rule (leading dims added, size-1 dims stride 0)."""
    shape = tuple(int(s) for s in shape)
    pad = len(shape) - len(ref.shape)
    if pad < 0:
        raise ValueError(f"cannot broadcast {ref.shape} to {shape}")
    src_shape = (1,) * pad + ref.shape
    src_strides = (0,) * pad + ref.strides
    strides = []
    for n, m, st in zip(shape, src_shape, src_strides):
        if m == n:
            strides.append(st if n != 1 else 0)
        elif m == 1:
            strides.append(0)
        else:
            raise ValueError(f"cannot broadcast {ref.shape} to {shape}")
    return TRef(ref.value, shape, tuple(strides), ref.offset)


def _dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def reshape(ref: TRef, shape: Sequence[int]) -> TRef | None:
    """A view of ``ref`` as ``shape`` without moving data, or None when PyTorch would have to copy (the algorithm
    of PyTorch's ``computeStride``: every run of old dims that new dims split or merge must be contiguous)."""
    shape = [int(s) for s in shape]
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = ref.numel // max(known, 1)
    new = tuple(shape)
    if math.prod(new) != ref.numel:
        return None
    if ref.numel == 0 or ref.contiguous():
        return TRef(ref.value, new, contiguous_strides(new), ref.offset)
    strides = _compute_stride(ref.shape or (1,), ref.strides or (1,), new)
    return None if strides is None else TRef(ref.value, new, strides, ref.offset)


def _compute_stride(old: tuple[int, ...], old_strides: tuple[int, ...],
                    new: tuple[int, ...]) -> tuple[int, ...] | None:
    out = [0] * len(new)
    view_d = len(new) - 1
    base = old_strides[-1]
    tensor_numel, view_numel = 1, 1
    for d in range(len(old) - 1, -1, -1):
        tensor_numel *= old[d]
        if d == 0 or (old[d - 1] != 1 and old_strides[d - 1] != tensor_numel * base):
            while view_d >= 0 and (view_numel < tensor_numel or new[view_d] == 1):
                out[view_d] = view_numel * base
                view_numel *= new[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if d > 0:
                base = old_strides[d - 1]
                tensor_numel, view_numel = 1, 1
    return tuple(out) if view_d == -1 else None


def permute(ref: TRef, dims: Sequence[int]) -> TRef:
    dims = [_dim(d, len(ref.shape)) for d in dims]
    return TRef(ref.value, tuple(ref.shape[d] for d in dims), tuple(ref.strides[d] for d in dims), ref.offset)


def transpose(ref: TRef, a: int, b: int) -> TRef:
    order = list(range(len(ref.shape)))
    a, b = _dim(a, len(order)), _dim(b, len(order))
    order[a], order[b] = order[b], order[a]
    return permute(ref, order)


def unsqueeze(ref: TRef, dim: int) -> TRef:
    dim = _dim(dim, len(ref.shape) + 1)
    st = ref.strides[dim] * ref.shape[dim] if dim < len(ref.shape) else 1
    return TRef(ref.value, ref.shape[:dim] + (1,) + ref.shape[dim:], ref.strides[:dim] + (st,) + ref.strides[dim:],
                ref.offset)


def squeeze(ref: TRef, dims: Sequence[int] | None) -> TRef:
    rank = len(ref.shape)
    drop = set(range(rank)) if dims is None else {_dim(d, rank) for d in dims}
    keep = [i for i in range(rank) if not (i in drop and ref.shape[i] == 1)]
    return TRef(ref.value, tuple(ref.shape[i] for i in keep), tuple(ref.strides[i] for i in keep), ref.offset)


def expand(ref: TRef, sizes: Sequence[int]) -> TRef:
    sizes = list(sizes)
    pad = len(sizes) - len(ref.shape)
    full = [ref.shape[i - pad] if s == -1 else s for i, s in enumerate(sizes)]
    return broadcast_to(ref, full)


def slice_(ref: TRef, dim: int, start: int | None, end: int | None, step: int = 1) -> TRef:
    dim = _dim(dim, len(ref.shape))
    n = ref.shape[dim]
    start = 0 if start is None else start
    end = n if end is None or end >= INT64_MAX else end
    start = max(0, min(n, start + n if start < 0 else start))
    end = max(start, min(n, end + n if end < 0 else end))
    count = len(range(start, end, step))
    shape = ref.shape[:dim] + (count,) + ref.shape[dim + 1:]
    strides = ref.strides[:dim] + (ref.strides[dim] * step,) + ref.strides[dim + 1:]
    return TRef(ref.value, shape, strides, ref.offset + start * ref.strides[dim])


def select(ref: TRef, dim: int, index: int) -> TRef:
    dim = _dim(dim, len(ref.shape))
    index = index + ref.shape[dim] if index < 0 else index
    return TRef(ref.value, ref.shape[:dim] + ref.shape[dim + 1:], ref.strides[:dim] + ref.strides[dim + 1:],
                ref.offset + index * ref.strides[dim])


def split(ref: TRef, sizes: Sequence[int], dim: int) -> tuple[TRef, ...]:
    out, start = [], 0
    for s in sizes:
        out.append(slice_(ref, dim, start, start + s))
        start += s
    return tuple(out)


def unfold(ref: TRef, dim: int, size: int, step: int) -> TRef:
    dim = _dim(dim, len(ref.shape))
    count = (ref.shape[dim] - size) // step + 1
    shape = ref.shape[:dim] + (count,) + ref.shape[dim + 1:] + (size,)
    strides = ref.strides[:dim] + (ref.strides[dim] * step,) + ref.strides[dim + 1:] + (ref.strides[dim],)
    return TRef(ref.value, shape, strides, ref.offset)


def view_of(op: str, args: list[Any], out_shape: Any) -> TRef | tuple[TRef, ...] | None:
    """The view ``op`` makes of ``args[0]`` (a :class:`TRef`; the op's other arguments as constants), or None when
    it cannot be a view (the caller copies). ``out_shape``: the node's shape(s), from the program."""
    ref = args[0]
    rest = args[1:]
    if op in ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"):
        return reshape(ref, out_shape)
    if op in ("aten.alias.default", "aten.detach.default", "aten.lift_fresh_copy.default"):
        return ref
    if op == "aten.unsqueeze.default":
        return unsqueeze(ref, rest[0])
    if op == "aten.squeeze.dim":
        return squeeze(ref, [rest[0]])
    if op == "aten.squeeze.dims":
        return squeeze(ref, rest[0])
    if op == "aten.squeeze.default":
        return squeeze(ref, None)
    if op == "aten.expand.default":
        return expand(ref, rest[0])
    if op == "aten.permute.default":
        return permute(ref, rest[0])
    if op == "aten.transpose.int":
        return transpose(ref, rest[0], rest[1])
    if op == "aten.t.default":
        return transpose(ref, 0, 1) if len(ref.shape) == 2 else ref
    if op == "aten.slice.Tensor":
        dim, start, end, step = (list(rest) + [0, None, None, 1][len(rest):])[:4]
        return slice_(ref, dim, start, end, step)
    if op == "aten.select.int":
        return select(ref, rest[0], rest[1])
    if op == "aten.narrow.default":
        return slice_(ref, rest[0], rest[1], rest[1] + rest[2])
    if op == "aten.split.Tensor":
        size, dim = rest[0], rest[1] if len(rest) > 1 else 0
        n = ref.shape[_dim(dim, len(ref.shape))]
        return split(ref, [min(size, n - s) for s in range(0, n, size)], dim)
    if op == "aten.split_with_sizes.default":
        return split(ref, rest[0], rest[1] if len(rest) > 1 else 0)
    if op == "aten.unbind.int":
        dim = rest[0] if rest else 0
        return tuple(select(ref, dim, i) for i in range(ref.shape[_dim(dim, len(ref.shape))]))
    if op == "aten.unfold.default":
        return unfold(ref, rest[0], rest[1], rest[2])
    return None


__all__ = ["TRef", "broadcast_to", "contiguous_strides", "expand", "permute", "reshape", "select", "slice_",
           "split", "squeeze", "transpose", "unfold", "unsqueeze", "view_of", "whole"]
