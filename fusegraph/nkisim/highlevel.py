"""Implementation of the experimental high-level ``nki.language`` operations (new-tile-returning API).

These exist in NKI 0.3 as convenience wrappers that the compiler lowers to one or more ISA instructions.
We validate operands like an instruction, compute with NumPy, and count each call as one instruction on the
engine NKI would pick; the exact lowering (instruction count) is not modelled.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import access
from . import dtypes as dt
from .alloc import allocate
from .checks import ON_CHIP, Instr
from .enums import MemoryRegion
from .isa_common import bits_u64, from_bits, is_scalar, mark_written
from .tensor import NkiTensor


def _promote(tiles: list[NkiTensor]) -> dt.DType:
    best = tiles[0].dtype
    for t in tiles[1:]:
        best = dt.promote(best, t.dtype)
    return best


def elementwise(
    api: str,
    inputs: list[Any],
    dtype: Any,
    fn: Callable[..., np.ndarray],
    *,
    engine: str = "vector",
    bitvec: bool = False,
    same_buffer: bool = False,
) -> NkiTensor:
    I = Instr(api)
    tiles = [x for x in inputs if isinstance(x, NkiTensor)]
    if not tiles:
        raise I.fail("at least one argument must be a tile", "shape")
    geos = []
    for i, x in enumerate(inputs):
        if isinstance(x, NkiTensor):
            geos.append((f"arg{i}", I.onchip(x, f"arg{i}", allowed=ON_CHIP)))
            if x.shape != tiles[0].shape:
                raise I.fail(
                    f"tile shapes {tiles[0].shape} and {x.shape} differ (the high-level API does not broadcast)",
                    "shape",
                )
        elif not is_scalar(x):
            raise I.fail(f"arg{i} must be a tile or a scalar, got {type(x).__name__}", "shape")
    I.align(geos, None)
    out_dtype = dt.get(dtype) if dtype is not None else _promote(tiles)
    buf = tiles[0].buffer if same_buffer else MemoryRegion.sbuf
    out = allocate(I.ctx, tiles[0].shape, out_dtype, buf, api=api)
    if I.data:
        if bitvec:
            vals = [bits_u64(np.asarray(access.read(I.ctx, x)), x.dtype) if isinstance(x, NkiTensor)
                    else np.uint64(int(x)) for x in inputs]
            res = from_bits(np.asarray(fn(*vals)), out_dtype)
        else:
            vals = [access.read_f32(I.ctx, x) if isinstance(x, NkiTensor) else np.float32(x) for x in inputs]
            res = np.asarray(fn(*vals))
        access.write(I.ctx, out, np.broadcast_to(res, out.shape))
    mark_written(out)
    g = geos[0][1]
    I.record(api, engine, g.partitions, g.free_elems, out_dtype.name, None)
    return out


def _axes(I: Instr, x: NkiTensor, axis: Any) -> tuple[int, ...]:
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    nd = len(x.shape)
    norm = tuple(sorted(int(a) + nd if int(a) < 0 else int(a) for a in axes))
    if not norm or 0 in norm or norm != tuple(range(norm[0], nd)):
        raise I.fail(
            f"axis={axis!r} must name the last contiguous free dims of a tile of shape {x.shape} (never dim 0)",
            "shape",
        )
    return norm


def reduction(api: str, x: Any, axis: Any, dtype: Any, keepdims: bool, fn: Callable[..., np.ndarray]) -> NkiTensor:
    I = Instr(api)
    g = I.onchip(x, "x")
    axes = _axes(I, x, axis)
    shape = tuple(1 if i in axes else n for i, n in enumerate(x.shape)) if keepdims else tuple(
        n for i, n in enumerate(x.shape) if i not in axes
    )
    if len(shape) < 2:
        shape = shape + (1,) * (2 - len(shape))
    out_dtype = dt.get(dtype) if dtype is not None else x.dtype
    out = allocate(I.ctx, shape, out_dtype, MemoryRegion.sbuf, api=api)
    if I.data:
        vals = np.asarray(fn(access.read_f32(I.ctx, x), axis=axes, keepdims=True), dtype=np.float32)
        access.write(I.ctx, out, vals.reshape(shape))
    I.record(api, "vector", g.partitions, g.free_elems, out_dtype.name, None)
    return out
