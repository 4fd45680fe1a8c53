"""``nki.language``: allocation, indexing helpers, loops, SPMD queries, tile-size constants and the
experimental high-level tile operations (the element-wise functions live in :mod:`.language_ops`).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import numpy as np

from . import access
from . import dtypes as dt
from .alloc import allocate
from .checks import ON_CHIP, Instr
from .context import current, maybe_current, session_target
from .enums import MemoryRegion
from .errors import NkiNotImplementedError, NkiValidationError
from .highlevel import elementwise
from .isa_common import mark_written
from .loops import DynamicLoop
from .registers import VirtualRegister
from .targets import get_target, resolve_sbuf_budget
from .tensor import DynSlice, NkiTensor

sbuf = MemoryRegion.sbuf
psum = MemoryRegion.psum
private_hbm = MemoryRegion.private_hbm
hbm = MemoryRegion.private_hbm
shared_hbm = MemoryRegion.shared_hbm


from .nkiobject import NKIObject  # noqa: E402 - re-exported as nl.NKIObject (the compiler's class semantics)


class _TileSizeMeta(type):
    @property
    def total_available_sbuf_size(cls) -> int:
        """Usable SBUF bytes per partition (the run's SBUF budget)."""
        ctx = maybe_current()
        if ctx is not None:
            return ctx.run.sbuf_budget
        return resolve_sbuf_budget(get_target(session_target()))

    @property
    def psum_min_align(cls) -> int:
        raise NkiNotImplementedError(
            "nl.tile_size.psum_min_align: the value is not published for SDK 2.29; fusegraph's interpreter does not "
            "guess it",
            rule="not-implemented",
        )

    @property
    def sbuf_min_align(cls) -> int:
        raise NkiNotImplementedError(
            "nl.tile_size.sbuf_min_align: the value is not published for SDK 2.29; fusegraph's interpreter does not "
            "guess it",
            rule="not-implemented",
        )


class tile_size(metaclass=_TileSizeMeta):  # noqa: N801 - official name
    """Hardware tile size constants."""

    pmax = 128
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    psum_fmax = 512
    bn_stats_fmax = 512


def ndarray(shape, dtype, buffer=MemoryRegion.sbuf, name="", address=None):
    """A new tensor in ``buffer``; its memory holds the sentinels (NaN for floats, 4 for ints)."""
    return allocate(current("nl.ndarray"), shape, dtype, buffer, name, address, api="nl.ndarray")


def _filled(api: str, shape, dtype, buffer, name, value) -> NkiTensor:
    ctx = current(api)
    t = allocate(ctx, shape, dtype, buffer, name, None, api=api, fill=None if ctx.shape_only else value)
    if t.on_chip:
        I = Instr(api)
        g = I.onchip(t, "result")
        mark_written(t)
        I.record("memset", "vector", g.partitions, g.free_elems, t.dtype.name, name or None)
    return t


def zeros(shape, dtype, buffer=MemoryRegion.sbuf, name=""):
    """A new tensor filled with zeros (lowers to memset)."""
    return _filled("nl.zeros", shape, dtype, buffer, name, 0)


def ones(shape, dtype, buffer=MemoryRegion.sbuf, name=""):
    """A new tensor filled with ones (lowers to memset)."""
    return _filled("nl.ones", shape, dtype, buffer, name, 1)


def full(shape, fill_value, dtype, buffer=MemoryRegion.sbuf, name=""):
    """A new tensor filled with ``fill_value`` (lowers to memset)."""
    return _filled("nl.full", shape, dtype, buffer, name, fill_value)


def zeros_like(x, dtype=None, buffer=None, name=""):
    """Zeros with the shape (and by default dtype/buffer) of ``x``."""
    return _filled("nl.zeros_like", x.shape, dtype or x.dtype, buffer or x.buffer, name, 0)


def empty_like(x, dtype=None, buffer=None, name=""):
    """An uninitialised tensor with the shape (and by default dtype/buffer) of ``x``."""
    return allocate(current("nl.empty_like"), x.shape, dtype or x.dtype, buffer or x.buffer, name, None,
                    api="nl.empty_like")


def ds(start, size):
    """A slice of ``size`` elements starting at ``start`` (for tensor indexing)."""
    return DynSlice(start, size)


def _range(api: str, start, stop, step) -> range:
    """A compile-time loop (unrolled when the kernel is specialised): its bounds must be Python ints."""
    for v in (start, stop, step):
        if isinstance(v, VirtualRegister):
            raise NkiValidationError(
                f"{api}: loop bounds must be compile-time ints; use nl.dynamic_range for register bounds",
                rule="loop",
            )
    if stop is None:
        start, stop = 0, start
    return range(int(start), int(stop), int(step))


def affine_range(start, stop=None, step=1):
    """Fully unrolled loop iterator (deprecated alias of static_range in 0.3)."""
    return _range("nl.affine_range", start, stop, step)


def sequential_range(start, stop=None, step=1):
    """Fully unrolled loop iterator (alias of static_range in 0.3)."""
    return _range("nl.sequential_range", start, stop, step)


def static_range(start, stop=None, step=1):
    """Fully unrolled loop iterator."""
    return _range("nl.static_range", start, stop, step)


def dynamic_range(start, stop=None, step=1):
    """A hardware loop: the body is traced once and replayed per iteration with the induction register bound
    (:mod:`.loops`); bounds may be VirtualRegisters (their runtime value, or the assumed value in shape-only runs),
    the step is a compile-time positive int."""
    return DynamicLoop(start, stop, step)


def program_id(axis=0):
    """Index of this program in the launch grid (0 or 1 for LNC=2)."""
    ctx = current("nl.program_id")
    if axis != 0:
        raise NkiValidationError(f"nl.program_id: only axis 0 exists (launch grids are 1-D), got {axis}",
                                 rule="lnc", location=ctx.where())
    return ctx.program_id


def num_programs(axes=0):
    """Number of programs in the launch grid (the LNC)."""
    ctx = current("nl.num_programs")
    if axes not in (0, None):
        raise NkiValidationError(f"nl.num_programs: only axis 0 exists, got {axes}", rule="lnc", location=ctx.where())
    return ctx.run.lnc


def program_ndim():
    """Number of launch-grid dims: 0 without ``kernel[lnc]``, else 1."""
    return current("nl.program_ndim").run.grid_ndim


@contextlib.contextmanager
def no_reorder():
    """Instructions execute in program order in the interpreter anyway; a ``dynamic_range`` inside is an error."""
    ctx = maybe_current()
    if ctx is None:
        yield
        return
    ctx.loops.no_reorder += 1
    try:
        yield
    finally:
        ctx.loops.no_reorder -= 1


def device_print(print_prefix, tensor):
    """Print a tensor's values to stdout (shape-only runs print the shape); the documented simulator behaviour."""
    ctx = current("nl.device_print")
    if not isinstance(tensor, NkiTensor):
        raise NkiValidationError("nl.device_print: tensor must be an NKI tensor", rule="shape", location=ctx.where())
    if ctx.shape_only or tensor._st.abstract:
        text = f"{print_prefix} <shape-only {tensor.shape} {tensor.dtype.name}>"
    else:
        text = f"{print_prefix} {np.asarray(access.read(ctx, tensor, check=False))!r}"
    sys.stdout.write(text + "\n")


def _buf(x: Any) -> MemoryRegion:
    if isinstance(x, NkiTensor):
        return x.buffer
    if isinstance(x, MemoryRegion):
        return x
    raise NkiValidationError(f"expected a buffer (nl.sbuf, ...), got {x!r}", rule="enum-arg")


def is_hbm(buffer):
    """True for private_hbm/shared_hbm."""
    return _buf(buffer).is_hbm


def is_on_chip(buffer):
    """True for SBUF/PSUM."""
    return _buf(buffer).on_chip


def is_psum(buffer):
    """True for PSUM."""
    return _buf(buffer) is MemoryRegion.psum


def is_sbuf(buffer):
    """True for SBUF."""
    return _buf(buffer) is MemoryRegion.sbuf


def load(src, dtype=None):
    """A new SBUF tile with the contents of HBM tensor ``src`` (one DMA)."""
    from .isa_dma import dma_copy

    ctx = current("nl.load")
    t = allocate(ctx, src.shape, dtype or src.dtype, MemoryRegion.sbuf, api="nl.load")
    dma_copy(dst=t, src=src)
    return t


def store(dst, value):
    """Copy an SBUF tile into ``dst`` (one DMA; PSUM tiles are rejected)."""
    from .isa_dma import dma_copy

    dma_copy(dst=dst, src=value)


def load_transpose2d(src, dtype=None):
    """A new SBUF tile holding the 2-D transpose of HBM tensor ``src`` (DMA transpose)."""
    from .isa_dma import dma_transpose
    from .isa_elementwise import tensor_copy

    ctx = current("nl.load_transpose2d")
    if len(src.shape) != 2:
        raise NkiValidationError("nl.load_transpose2d needs a 2-D src", rule="shape", location=ctx.where())
    t = allocate(ctx, (src.shape[1], src.shape[0]), src.dtype, MemoryRegion.sbuf, api="nl.load_transpose2d")
    dma_transpose(dst=t, src=src)
    if dtype is None or dt.get(dtype) is t.dtype:
        return t
    out = allocate(ctx, t.shape, dtype, MemoryRegion.sbuf, api="nl.load_transpose2d")
    tensor_copy(dst=out, src=t)
    return out


def transpose(x, dtype=None):
    """2-D transpose of a tile (Tensor Engine into PSUM, same dtype; converted to SBUF ``dtype`` if given)."""
    from .isa_elementwise import tensor_copy
    from .isa_pe import nc_transpose

    ctx = current("nl.transpose")
    P = x.shape[0]
    F = x.size // P
    out = allocate(ctx, (F, P), x.dtype, MemoryRegion.psum, api="nl.transpose")
    nc_transpose(dst=out, data=x)
    if dtype is None:
        return out
    res = allocate(ctx, (F, P), dtype, MemoryRegion.sbuf, api="nl.transpose")
    tensor_copy(dst=res, src=out)
    return res


def matmul(x, y, transpose_x=False):
    """x.T @ y into a new fp32 PSUM tile; only ``transpose_x=True`` works in SDK 2.29 (known issue)."""
    from .isa_pe import nc_matmul

    ctx = current("nl.matmul")
    if not transpose_x:
        raise NkiNotImplementedError(
            "nl.matmul(transpose_x=False) does not work in SDK 2.29 (documented known issue); pass transpose_x=True "
            "with x laid out [K, M], or use nisa.nc_matmul",
            rule="not-implemented",
            location=ctx.where(),
        )
    M = x.size // x.shape[0]
    N = y.size // y.shape[0]
    out = allocate(ctx, (M, N), dt.float32, MemoryRegion.psum, api="nl.matmul")
    nc_matmul(dst=out, stationary=x, moving=y)
    return out


def shared_identity_matrix(n, dtype="uint8", dst=None):
    """An ``[n, n]`` identity matrix in SBUF (for Tensor Engine transposes)."""
    ctx = current("nl.shared_identity_matrix")
    t = dst if dst is not None else allocate(ctx, (n, n), dtype, MemoryRegion.sbuf, api="nl.shared_identity_matrix")
    I = Instr("nl.shared_identity_matrix")
    g = I.onchip(t, "dst", allowed=(MemoryRegion.sbuf,))
    if g.partitions != n or g.free_elems != n:
        raise I.fail(f"dst must be [{n}, {n}], got {t.shape}", "shape")
    if I.data:
        access.write(ctx, t, np.eye(n, dtype=np.float32).reshape(t.shape))
    I.record("shared_identity_matrix", "gpsimd", n, n, t.dtype.name, None)
    return t


def softmax(x, axis=-1, dtype=None):
    """Softmax along the free axis of a tile (numerically stable; one ScalarE instruction in the profile)."""
    def fn(a):
        m = np.max(a, axis=axis, keepdims=True)
        e = np.exp(a - m)
        return (e / np.sum(e, axis=axis, keepdims=True)).astype(np.float32)

    if axis in (0, -len(x.shape)):
        raise NkiValidationError("nl.softmax cannot reduce the partition axis", rule="shape")
    return elementwise("nl.softmax", [x], dtype, fn, engine="scalar")


def broadcast_to(x, shape, dtype=None):
    """A new tile broadcasting ``x`` (same rank, dims equal or 1) to ``shape``."""
    shape = tuple(int(s) for s in shape)
    if tuple(x.shape) == shape and dtype is None:
        return x
    ctx = current("nl.broadcast_to")
    if len(shape) != len(x.shape) or any(a != b and a != 1 for a, b in zip(x.shape, shape)):
        raise NkiValidationError(f"nl.broadcast_to: cannot broadcast {x.shape} to {shape}", rule="shape",
                                 location=ctx.where())
    I = Instr("nl.broadcast_to")
    I.onchip(x, "x", allowed=ON_CHIP)
    out = allocate(ctx, shape, dtype or x.dtype, MemoryRegion.sbuf, api="nl.broadcast_to")
    if I.data:
        access.write(ctx, out, np.broadcast_to(access.read_f32(ctx, x), shape))
    I.record("nl.broadcast_to", "vector", shape[0], out.size // shape[0], out.dtype.name, None)
    return out


def expand_dims(x, axis):
    """A view of ``x`` with a size-1 dim inserted at ``axis`` (not the partition dim of on-chip tiles)."""
    nd = len(x.shape) + 1
    a = axis + nd if axis < 0 else axis
    shape = x.shape[:a] + (1,) + x.shape[a:]
    return x.reshape(shape)


def where(condition, x, y, dtype=None):
    """Element-wise select: x where condition != 0, else y."""
    return elementwise("nl.where", [condition, x, y], dtype,
                       lambda c, a, b: np.where(c != 0, a, b).astype(np.float32))
