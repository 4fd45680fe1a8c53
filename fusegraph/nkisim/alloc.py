"""Tensor allocation (``nl.ndarray`` and friends) with on-chip capacity accounting.

* SBUF/PSUM tensors are private to a program; their bytes per partition are charged to the program's
  accountant until the storage dies (last reference dropped) — see :mod:`fusegraph.nkisim.memory`.
* ``shared_hbm`` tensors are shared by the programs of an LNC=2 launch: both programs run the same code,
  so the n-th allocation with the same (name, shape, dtype) in each program is the same tensor.
* Fresh memory holds the official sentinels (NaN / 4); shape-only runs allocate no data at all.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from . import dtypes as dt
from .context import ProgramContext
from .enums import MemoryRegion, require_buffer
from .errors import NkiValidationError
from .loops import keep_allocation, reused_allocation
from .storage import Storage, sentinel_buffer
from .tensor import NkiTensor


def _shape(ctx: ProgramContext, shape: Any, where: str) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    try:
        out = tuple(int(s) for s in shape)
        ok = all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in shape)
    except TypeError:
        ok = False
        out = ()
    if not ok or not out or any(s <= 0 for s in out):
        raise NkiValidationError(f"shape must be a non-empty tuple of positive ints, got {shape!r}", rule="shape",
                                 location=where)
    return out


def allocate(
    ctx: ProgramContext,
    shape: Sequence[int],
    dtype: Any,
    buffer: Any,
    name: str = "",
    address: Any = None,
    *,
    api: str = "nl.ndarray",
    fill: Any = None,
) -> NkiTensor:
    """Allocate a tensor; ``fill=None`` means sentinel-filled (uninitialised) memory."""
    where = ctx.where()
    buf_kind = require_buffer(buffer, "buffer", api)
    shp = _shape(ctx, shape, where)
    d = dt.get(dtype)
    if name is None:  # nki-library passes name=None; treated like the default ''
        name = ""
    if not isinstance(name, str):
        raise NkiValidationError(f"{api}: name must be a string, got {name!r}", rule="shape", location=where)
    reused = reused_allocation(ctx)  # a replayed nl.dynamic_range iteration: the tensor traced once, reused
    if reused is not None:
        if fill is not None and reused._st.buf is not None:
            reused._st.buf[...] = _fresh(shp, d, fill)
        return reused
    what = f"{api}({shp}, {d.name}, {buf_kind.name}{', ' + repr(name) if name else ''})"
    address_pf = _manual_address(what, buf_kind, address, where) if address is not None else None
    start_partition = address_pf[0] if address_pf else 0
    if buf_kind.on_chip:
        _check_partitions(what, shp, start_partition, where)
    ctx.alloc_seq += 1
    label = name or f"{buf_kind.name}#{ctx.alloc_seq}"
    if buf_kind is MemoryRegion.shared_hbm:
        return keep_allocation(ctx, NkiTensor.full(_shared_storage(ctx, shp, d, buf_kind, name, label, fill)))
    st = Storage(
        shp,
        d,
        buf_kind,
        buf=None if ctx.shape_only else _fresh(shp, d, fill),
        name=name,
        label=label,
        kind="internal",
        start_partition=start_partition,
        manual=address_pf is not None,
        program=ctx.program_id,
    )
    if buf_kind.on_chip and fill is None and st.buf is not None:
        st.written = np.zeros(st.nbytes, dtype=np.bool_)  # reads of bytes never written are flagged (access.py)
    if buf_kind.on_chip:
        st.mem = ctx.mem.new(buf_kind.name, st.id, st.free_bytes, address_pf, what, where, ctx.rec.count)
    return keep_allocation(ctx, NkiTensor.full(st))


def _manual_address(what: str, buf_kind: MemoryRegion, address: Any, where: str) -> tuple[int, int]:
    """``address=`` of a manually placed SBUF/PSUM tensor as ``(partition_offset, free_byte_offset)``, checked:
    only on-chip tensors have an address, and it is a pair of non-negative ints."""
    if not buf_kind.on_chip:
        raise NkiValidationError(f"{what}: address= is only valid for SBUF/PSUM tensors", rule="buffer",
                                 location=where)
    try:
        p_off, f_off = (int(address[0]), int(address[1]))
    except (TypeError, ValueError, IndexError):
        raise NkiValidationError(f"{what}: address must be (partition_offset, free_byte_offset), got {address!r}",
                                 rule="shape", location=where) from None
    if p_off < 0 or f_off < 0:
        raise NkiValidationError(f"{what}: negative address {address!r}", rule="shape", location=where)
    return p_off, f_off


def _check_partitions(what: str, shp: tuple[int, ...], start_partition: int, where: str) -> None:
    """An on-chip tensor's partition dim fits the 128 partitions from where it starts."""
    if shp[0] > 128:
        raise NkiValidationError(
            f"{what}: partition dimension {shp[0]} exceeds maximum 128", rule="partition-dim", location=where
        )
    if start_partition + shp[0] > 128:
        raise NkiValidationError(
            f"{what}: partitions [{start_partition}, {start_partition + shp[0]}) exceed the 128 partitions",
            rule="partition-dim",
            location=where,
        )


def _shared_storage(ctx: ProgramContext, shp: tuple[int, ...], d: dt.DType, buf_kind: MemoryRegion, name: str,
                    label: str, fill: Any) -> Storage:
    """The storage of a ``shared_hbm`` allocation: the programs of an LNC=2 launch run the same code, so the n-th
    allocation of one (name, shape, dtype) in each program of a rank is one tensor, created by the first."""
    run = ctx.run
    with run.lock:
        seq_key = (name, shp, d.name)
        counts = ctx.shared_counts
        n = counts.get(seq_key, 0)
        counts[seq_key] = n + 1
        key = (ctx.rank, name, shp, d.name, n)
        st = run.shared_allocs.get(key)
        if st is None:
            st = Storage(
                shp, d, buf_kind, buf=None if ctx.shape_only else _fresh(shp, d, fill), name=name,
                label=label, kind="internal", program=ctx.program_id,
            )
            if run.lnc > 1:
                run.shared_allocs[key] = st
    return st


def _fresh(shape: tuple[int, ...], d: dt.DType, fill: Any) -> np.ndarray:
    n = 1
    for s in shape:
        n *= s
    nbytes = n * d.itemsize
    if fill is None:
        return sentinel_buffer(nbytes, d)
    buf = np.empty(nbytes, dtype=np.uint8)
    if d.is_packed:
        buf.fill(0)
    else:
        buf.view(d.np)[...] = dt.cast_to(np.asarray(fill, dtype=np.float32 if d.is_float else np.int64), d)
    return buf
