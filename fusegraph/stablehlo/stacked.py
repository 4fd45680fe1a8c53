"""A stacked KV cache kept split: Keras's ``[B, layers, 2, L, KV, D]`` cache as one ``[B, KV, L, D]`` state
tensor per layer and k/v (HF's layout), so each layer's cache write is the in-place ``index_copy_`` on a state
tensor that the ``kv_cache_update`` pattern matches.

keras-hub reads a layer's cache with ``cache[:, i, ...]`` and ``[:, 0/1, ...]`` (``slice`` + ``reshape``),
writes the new row with ``slice_update`` (``dynamic_update_slice`` on ``[B, L, KV, D]``) and rebuilds the cache
with ``stack`` (``broadcast_in_dim`` + ``concatenate``). On a :class:`~.values.Stacked` value those ops only move
parts around; the cache write becomes ``index_copy(part, 2, pos, new.transpose(1, 2))``. Every op here is a pure
relayout (which element sits where), so it is exact; any other use of a split value materializes the logical
tensor (:func:`~.values.stacked_tensor`), which is always correct.

Which arguments are split is decided by :func:`split_layout` from the StableHLO alone (a donated argument of
rank 6 read only through per-layer slices); the importer presents each part as its own program input, and
:meth:`~.importer.ImportedInput.take` cuts it out of the argument.
"""
from __future__ import annotations

import itertools
from typing import Any, Sequence

import torch

from .ir import Value
from .values import Stacked, stacked_tensor

#: the part's storage layout: logical ``[B, L, KV, D]`` (Keras) = storage ``[B, KV, L, D]`` (HF) ``.permute``
KERAS_PERM = (0, 2, 1, 3)


def split_layout(v: Value) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(stack dims, perm) when the argument ``v`` is a Keras stacked cache ``[B, n1, n2, L, KV, D]`` read only
    through slices that take one index of dim 1 (``cache[:, i, ...]``), or a sequence-major cache
    ``[B, L, KV, D]`` (JAX code's usual layout) only written one position at a time along ``L`` (then it is one
    part, no stack dims, stored as HF's ``[B, KV, L, D]``); else ``None``."""
    shape = v.type.shape
    if len(shape) == 4 and v.users and all(_row_write_dim(u, v) == 1 or batched_row_write_dim(u, v) == 1
                                           for u in v.users):
        return (), KERAS_PERM  # a sequence-major cache [B, L, KV, D] written one position at a time
    if len(shape) != 6 or not v.users:
        return None
    for user in v.users:
        if user.name != "stablehlo.slice":
            return None
        starts, limits, strides = user.attrs["start_indices"], user.attrs["limit_indices"], user.attrs["strides"]
        for d, (a, b, st) in enumerate(zip(starts, limits, strides)):
            full = (a, b, st) == (0, shape[d], 1)
            if d == 1:
                if b - a != 1 or st != 1:
                    return None
            elif not full:
                return None
    return (1, 2), KERAS_PERM


def _row_write_dim(op: Any, v: Value) -> int | None:
    """The dim along which ``op`` writes rows of ``v`` at a dynamic position, every other dim whole: a
    ``dynamic_update_slice`` of ``v`` (``lax.dynamic_update_slice(cache, k, (0, pos, 0, 0))``) or a one-position
    ``scatter`` into it (``cache.at[:, pos].set(k)``); else ``None``."""
    if not op.operands or op.operands[0] is not v or any(o is v for o in op.operands[1:]):
        return None
    shape = v.type.shape
    if op.name == "stablehlo.dynamic_update_slice":
        moving = [d for d, (a, b) in enumerate(zip(op.operands[1].type.shape, shape)) if a != b]
        return moving[0] if len(moving) == 1 else None
    if op.name == "stablehlo.scatter" and len(op.operands) == 3:
        dn = op.attrs["scatter_dimension_numbers"]
        index_shape = list(op.operands[1].type.shape)
        if dn["index_vector_dim"] < len(index_shape):
            index_shape.pop(dn["index_vector_dim"])
        sd = dn["scatter_dims_to_operand_dims"]
        if len(sd) != 1 or dn["input_batching_dims"] or any(n != 1 for n in index_shape):
            return None
        window = [d for d in range(len(shape)) if d not in dn["inserted_window_dims"]]
        sizes = [op.operands[2].type.shape[u] for u in dn["update_window_dims"]]
        if len(window) != len(sizes) or any(n != shape[d] for d, n in zip(window, sizes) if d != sd[0]):
            return None
        return sd[0]
    return None


def batched_row_write_dim(op: Any, v: Value) -> int | None:
    """The dim along which a ``jax.vmap``'ed ``dynamic_update_slice`` writes rows of ``v`` (a scatter with the
    batch dim 0 as its batching dim, each sequence at its own position, every other dim whole); else ``None``."""
    if op.name != "stablehlo.scatter" or len(op.operands) != 3 or op.operands[0] is not v or \
            any(o is v for o in op.operands[1:]):
        return None
    dn = op.attrs["scatter_dimension_numbers"]
    shape = v.type.shape
    if dn["input_batching_dims"] != (0,) or dn["inserted_window_dims"] or \
            tuple(dn["update_window_dims"]) != tuple(range(1, len(shape))):  # updates [B, n, ...] like the operand
        return None
    window = [d for d in range(len(shape)) if d != 0]
    sizes = [op.operands[2].type.shape[u] for u in dn["update_window_dims"]]
    if len(window) != len(sizes):
        return None
    moving = [d for d, n in zip(window, sizes) if n != shape[d]]
    return moving[0] if len(moving) == 1 and moving[0] in dn["scatter_dims_to_operand_dims"] else None


def part_keys(shape: Sequence[int], stack_dims: Sequence[int]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(shape[d]) for d in stack_dims)))


def part_shape(shape: Sequence[int], stack_dims: Sequence[int], perm: Sequence[int]) -> tuple[int, ...]:
    """The storage shape of one part (the logical part permuted back)."""
    logical = [s for d, s in enumerate(shape) if d not in stack_dims]
    inv = _inverse(perm)
    return tuple(logical[inv[i]] for i in range(len(logical)))


def take_part(t: torch.Tensor, key: Sequence[int], stack_dims: Sequence[int], perm: Sequence[int]) -> torch.Tensor:
    """Part ``key`` of the logical tensor ``t``, in storage layout (a view)."""
    index: list[Any] = [slice(None)] * t.dim()
    for d, k in zip(stack_dims, key):
        index[d] = k
    return t[tuple(index)].permute(_inverse(perm))


def split_value(v: Any, shape: Sequence[int], stack_dims: Sequence[int], perm: Sequence[int]) -> list[torch.Tensor]:
    """The parts of a result that is written back into a split state argument, in :func:`part_keys` order."""
    keys = part_keys(shape, stack_dims)
    if isinstance(v, Stacked) and tuple(v.stack_dims) == tuple(stack_dims) and tuple(v.perm) == tuple(perm) \
            and set(v.parts) == set(keys) and tuple(v.shape) == tuple(shape):
        return [v.parts[k] for k in keys]
    t = stacked_tensor(v) if isinstance(v, Stacked) else v
    return [take_part(t, k, stack_dims, perm) for k in keys]


def _inverse(perm: Sequence[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def _is_identity(perm: Sequence[int]) -> bool:
    return list(perm) == list(range(len(perm)))


# ---- ops on split values (each returns None when the op is not a pure move of parts) ------------------------
def slice_(s: Stacked, starts: Sequence[int], limits: Sequence[int], strides: Sequence[int]) -> Stacked | None:
    """``slice``: ranges of stack dims select parts; every other dim must be taken whole."""
    ranges = []
    for d, (a, b, st) in enumerate(zip(starts, limits, strides)):
        if d in s.stack_dims:
            ranges.append(range(a, b, st))
        elif (a, b, st) != (0, s.shape[d], 1):
            return None
    shape = tuple(len(ranges[s.stack_dims.index(d)]) if d in s.stack_dims else n for d, n in enumerate(s.shape))
    parts = {}
    for new_key in part_keys(shape, s.stack_dims):
        old = tuple(r[i] for r, i in zip(ranges, new_key))
        parts[new_key] = s.parts[old]
    return Stacked(parts, shape, s.stack_dims, s.perm)


def reshape(s: Stacked, new_shape: Sequence[int]) -> Stacked | None:
    """A reshape that only drops size-1 stack dims or inserts size-1 dims (which become stack dims)."""
    old = list(s.shape)
    new = list(new_shape)
    i = j = 0
    mapping: list[tuple[str, int | None]] = []  # per new dim: ("old", old dim) or ("new", None)
    while i < len(old) or j < len(new):
        if i < len(old) and j < len(new) and old[i] == new[j]:
            mapping.append(("old", i))
            i += 1
            j += 1
        elif i < len(old) and old[i] == 1 and i in s.stack_dims:  # a size-1 stack dim goes away
            i += 1
        elif j < len(new) and new[j] == 1:
            mapping.append(("new", None))
            j += 1
        else:
            return None
    return _remap(s, mapping, tuple(new))


def broadcast(s: Stacked, shape: Sequence[int], dims: Sequence[int]) -> Stacked | None:
    """``broadcast_in_dim`` that only inserts size-1 dims (``x[:, None]``, ``stack``'s first step)."""
    dims = list(dims)
    if dims != sorted(dims) or len(dims) != len(s.shape):
        return None
    mapping: list[tuple[str, int | None]] = []
    for j, n in enumerate(shape):
        if j in dims:
            i = dims.index(j)
            if s.shape[i] != n:
                return None
            mapping.append(("old", i))
        elif n == 1:
            mapping.append(("new", None))
        else:
            return None
    return _remap(s, mapping, tuple(shape))


def _remap(s: Stacked, mapping: list[tuple[str, int | None]], shape: tuple[int, ...]) -> Stacked:
    """Stack dims of the new shape: old stack dims that survive, plus every inserted size-1 dim."""
    new_sd, source = [], []  # source: the old stack-dim position feeding each new stack dim, or None
    for j, (kind, i) in enumerate(mapping):
        if kind == "new":
            new_sd.append(j)
            source.append(None)
        elif i in s.stack_dims:
            new_sd.append(j)
            source.append(s.stack_dims.index(i))
    parts = {}
    for old_key, part in s.parts.items():
        parts[tuple(0 if src is None else old_key[src] for src in source)] = part
    return Stacked(parts, shape, tuple(new_sd), s.perm)


def concatenate(vals: Sequence[Stacked], dim: int) -> Stacked | None:
    """``concatenate`` of split values along one of their (common) stack dims: the union of their parts."""
    first = vals[0]
    if dim not in first.stack_dims:
        return None
    k = first.stack_dims.index(dim)
    for v in vals:
        if v.stack_dims != first.stack_dims or v.perm != first.perm or \
                any(a != b for d, (a, b) in enumerate(zip(v.shape, first.shape)) if d != dim):
            return None
    parts, offset = {}, 0
    for v in vals:
        for key, part in v.parts.items():
            parts[key[:k] + (key[k] + offset,) + key[k + 1:]] = part
        offset += v.shape[dim]
    shape = tuple(offset if d == dim else n for d, n in enumerate(first.shape))
    return Stacked(parts, shape, first.stack_dims, first.perm)


def storage_dim(s: Stacked, logical_dim: int) -> int:
    """The dim of a single part's storage tensor that holds logical dim ``logical_dim`` (no stack dims)."""
    return s.perm[logical_dim]


def to_storage(s: Stacked, logical: torch.Tensor) -> torch.Tensor:
    """A logical-layout tensor shaped like ``s``'s part, in ``s``'s storage layout."""
    return logical if _is_identity(s.perm) else logical.permute(_inverse(s.perm))


def transpose(s: Stacked, permutation: Sequence[int]) -> Stacked:
    """``transpose``: logical dim ``j`` of the result is dim ``permutation[j]``; parts keep their storage, only
    the view (``perm``) and the stack dims' order change."""
    p = list(permutation)
    shape = tuple(s.shape[d] for d in p)
    new_sd = [j for j, d in enumerate(p) if d in s.stack_dims]
    source = [s.stack_dims.index(p[j]) for j in new_sd]  # the old key coordinate of each new stack dim
    old_part_dims = [d for d in range(len(s.shape)) if d not in s.stack_dims]
    q = [old_part_dims.index(d) for d in p if d not in s.stack_dims]  # new logical part = old.permute(q)
    perm = tuple(s.perm[i] for i in q)
    parts = {tuple(key[c] for c in source): part for key, part in s.parts.items()}
    return Stacked(parts, shape, tuple(new_sd), perm)
