"""Reading and writing tensor views, runtime indirection, and access-pattern geometry.

Direct views become NumPy views of the storage buffer (``np.ndarray(buffer=...)``, which also re-checks the
bounds).  Indirect views (``.ap`` with ``scalar_offset``/``vector_offset``) become gathers/scatters through
element-address arrays; their index values come from memory in data runs and from ``assume`` in shape-only
runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..warnings import warn
from . import assume as assume_mod
from . import dtypes as dt
from .enums import oob_mode
from .errors import NkiValidationError
from .registers import VirtualRegister
from .tensor import NkiTensor, extent


def np_view(t: NkiTensor) -> np.ndarray:
    """Writable NumPy view of a direct (non-indirect) tensor view (data runs only)."""
    isz = t.dtype.itemsize
    return np.ndarray(
        t.shape,
        dtype=t.dtype.np,
        buffer=t._st.buf,
        offset=t._offset * isz,
        strides=tuple(s * isz for s in t._strides),
    )


def grid(shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> np.ndarray:
    """Element addresses of a strided pattern (int64, shaped like ``shape``)."""
    out = np.full(shape, offset, dtype=np.int64)
    nd = len(shape)
    for k, (n, s) in enumerate(zip(shape, strides)):
        if n > 1 and s:
            view_shape = [1] * nd
            view_shape[k] = n
            out += (np.arange(n, dtype=np.int64) * s).reshape(view_shape)
    return out


# ---------------------------------------------------------------------------- index values


def index_values(ctx, index: object, kind: str, count: int, limit: int, target_label: str, where,
                 column_major: bool = False) -> np.ndarray:
    """Runtime index values: ``count`` int64 values from an index tensor or a register (``where``: callable).

    ``column_major``: read a 2-D index tile column by column (``indices.T.flatten()``, the order of an indirect
    ``dma_transpose``) and keep the first ``count`` values."""
    tr = ctx.rec.tracer
    if tr is not None:  # the access depends on the instruction that wrote the index (a top-k, a register load)
        tr.touch(f"r{index.id}" if isinstance(index, VirtualRegister) else f"s{index._st.id}", False)
    if isinstance(index, VirtualRegister):
        if index.value is None:
            raise NkiValidationError(f"register {index.name} used as an index before it was written", rule="register",
                                     location=where())
        return np.full(count, int(index.value), dtype=np.int64)
    assert isinstance(index, NkiTensor)
    if index._st.mem is not None:
        index._st.mem.last_use = ctx.rec.count
    if not index.dtype.is_int:
        raise NkiValidationError(
            f"{kind}_offset index tensor must have an integer dtype, got {index.dtype.name}", rule="dtype",
            location=where(),
        )
    if ctx.shape_only or index._st.abstract:
        positions = grid(index.shape, index._strides, index._offset)
        positions = (positions.T if column_major else positions).reshape(-1)[:count]
        req = assume_mod.AssumeRequest(
            name=index._st.name or index._st.label,
            kind=kind,
            positions=positions,
            alloc_shape=index._st.shape,
            limit=limit,
            target=target_label,
        )
        vals = assume_mod.resolve(ctx.run.assume, req)
    else:
        vals = np.asarray(np_view(index))
        vals = (vals.T if column_major else vals).reshape(-1)[:count].astype(np.int64)
    if vals.size != count:
        vals = np.resize(vals, count)
    return vals


@dataclass
class Resolved:
    """A runtime-resolved indirect view: a direct (shifted) view for scalar offsets, element addresses plus
    a per-row validity mask for vector offsets, or ``skip`` when ``oob_mode.skip`` drops the transfer."""

    view: NkiTensor | None = None
    addr: np.ndarray | None = None  # int64, shape = view shape (vector gathers, data runs only)
    valid: np.ndarray | None = None  # bool per row (first dim); None = all valid
    skip: bool = False


def _span(shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> tuple[int, int]:
    lo = hi = offset
    for n, st in zip(shape, strides):
        if n > 1:
            d = (n - 1) * st
            if d < 0:
                lo += d
            else:
                hi += d
    return lo, hi


def resolve_indirect(ctx, t: NkiTensor, mode: oob_mode, op: str, where, gather_transpose: bool = False) -> Resolved:
    """Resolve the runtime offsets of an indirect view; ``where`` is a callable giving the error location.

    A ``vector_offset`` index must be ``[P, 1]`` (one row per partition) unless ``gather_transpose`` (an indirect
    ``dma_transpose``, whose own checks ran): then rows come from ``indices.T.flatten()[:P]``."""
    ind = t._ind
    if ind.kind == "vector" and not gather_transpose:
        idx = ind.index
        if idx.size != t.shape[0] or idx.shape[0] != t.shape[0]:
            raise NkiValidationError(
                f"{op}: vector_offset shape {idx.shape} must be [P, 1] with P = {t.shape[0]} (the first pattern dim)",
                rule="ap",
                location=where(),
            )
    limit_elems = t._st.nbytes // t.dtype.itemsize
    if ind.kind == "scalar":
        lo, hi = _span(t.shape, t._strides, t._offset)
        lim = (limit_elems - 1 - hi) // ind.mult + 1 if ind.mult else 0
        v = int(index_values(ctx, ind.index, "scalar", 1, max(lim, 0), t._st.label, where)[0])
        shift = v * ind.mult
        if lo + shift < 0 or hi + shift >= limit_elems:
            if mode is oob_mode.skip:
                return Resolved(skip=True)
            raise NkiValidationError(
                f"{op}: runtime scalar_offset value {v} (x{ind.mult} elements) moves the access outside tensor "
                f"'{t._st.label}' of shape {t._st.shape} (oob_mode.error)",
                rule="out-of-bounds",
                location=where(),
            )
        return Resolved(view=NkiTensor(t._st, t.shape, t._strides, t._offset + shift, t.dtype))
    # vector: the first pattern dim is replaced by the per-partition row index
    lo, hi = _span(t.shape[1:], t._strides[1:], t._offset)
    lim = (limit_elems - 1 - hi) // ind.mult + 1 if ind.mult else 0
    rows = index_values(ctx, ind.index, "vector", t.shape[0], max(lim, 0), t._st.label, where,
                        column_major=gather_transpose)
    row_ok = (rows * ind.mult + lo >= 0) & (rows * ind.mult + hi < limit_elems)
    valid = None
    if not row_ok.all():
        if mode is not oob_mode.skip:
            bad = int(rows[~row_ok][0])
            raise NkiValidationError(
                f"{op}: runtime vector_offset index {bad} (x{ind.mult} elements) is outside tensor '{t._st.label}' "
                f"of shape {t._st.shape} (oob_mode.error)",
                rule="out-of-bounds",
                location=where(),
            )
        valid = row_ok
    addr = None
    if not ctx.shape_only and t._st.buf is not None:
        inner = grid(t.shape[1:], t._strides[1:], t._offset)
        shape_b = (t.shape[0],) + (1,) * (len(t.shape) - 1)
        addr = inner[None, ...] + (rows * ind.mult).reshape(shape_b)
        if valid is not None:
            addr = np.where(valid.reshape(shape_b), addr, 0)
    return Resolved(addr=addr, valid=valid)


# ---------------------------------------------------------------------------- engine operands with a runtime offset


def resolve_engine_offset(ctx, t: NkiTensor, op: str, where) -> NkiTensor:
    """The direct view an engine (compute) instruction accesses for an on-chip ``.ap(scalar_offset=...)`` view.

    ``tensor_copy_dynamic_src/dst`` were replaced by ``tensor_copy`` with ``.ap(scalar_offset=)`` (0.3.0 update
    guide): the runtime value moves the access *within each partition* by ``value * prod(shape[indirect_dim+1:])``
    elements; leaving the partition's allocation is an out-of-bounds access.  The value is read once per
    instruction (cached in ``ctx.ind_cache``, cleared when the next instruction starts)."""
    hit = ctx.ind_cache.get(id(t))
    if hit is not None and hit[0] is t:
        return hit[1]
    ind = t._ind
    st = t._st
    isz = t.dtype.itemsize
    static = geometry(NkiTensor(st, t.shape, t._strides, t._offset, t.dtype))
    lo, hi = static.free_lo, static.free_hi  # bytes within the partition
    step = ind.mult * isz
    limit = (st.free_bytes - hi) // step + 1 if step else 0
    v = int(index_values(ctx, ind.index, "scalar", 1, max(limit, 0), st.label, where)[0])
    shift = v * step
    if lo + shift < 0 or hi + shift > st.free_bytes:
        raise NkiValidationError(
            f"{op}: runtime scalar_offset value {v} (x{ind.mult} elements) moves the access to bytes "
            f"[{lo + shift}, {hi + shift}) of each partition, outside the {st.free_bytes} bytes per partition of "
            f"'{st.label}'",
            rule="out-of-bounds",
            location=where(),
        )
    view = NkiTensor(st, t.shape, t._strides, t._offset + v * ind.mult, t.dtype)
    ctx.ind_cache[id(t)] = (t, view)
    return view


def cached_engine_view(ctx, t: NkiTensor) -> NkiTensor | None:
    """The view resolved for ``t`` by the running instruction, if any."""
    hit = ctx.ind_cache.get(id(t)) if ctx is not None else None
    return hit[1] if hit is not None and hit[0] is t else None


def _direct(ctx, t: NkiTensor) -> NkiTensor:
    """Direct view for an indirect view read/written outside a DMA (engine operands)."""
    if t._ind.kind == "scalar" and t._st.buffer.on_chip:
        return resolve_engine_offset(ctx, t, "instruction", ctx.where)
    raise NkiValidationError(
        f"a {t._ind.kind}_offset view of '{t._st.label}' ({t._st.buffer.name}) can only be accessed by a DMA "
        f"instruction here (engines take a scalar_offset on SBUF/PSUM operands)",
        rule="dynamic-offset",
        location=ctx.where(),
    )


# ---------------------------------------------------------------------------- read / write


def read(ctx, t: NkiTensor, res: Resolved | None = None, *, check: bool = True) -> np.ndarray:
    """Values of a view in its storage dtype (a view or a copy; never written through).

    ``check``: raise ``uninitialized-read`` when the view covers SBUF/PSUM bytes never written since their
    allocation (their sentinel NaN/4 would flow into the result unnoticed); ``nl.device_print`` reads unchecked."""
    if t._ind is None:
        view = t
    elif res is None:
        view = _direct(ctx, t)
    elif res.view is not None:
        view = res.view
    else:
        if check and t._st.written is not None:
            _require_written(ctx, t, _addr_mask(t, res.addr))
        return t._st.flat(t.dtype)[res.addr]
    if check and view._st.written is not None:
        _require_written(ctx, view, mask_view(view))
    return np_view(view)


def mask_view(t: NkiTensor) -> np.ndarray:
    """The written-mask bytes of a direct view, shaped ``t.shape + (itemsize,)`` (a view: writable)."""
    isz = t.dtype.itemsize
    return np.ndarray(t.shape + (isz,), dtype=np.bool_, buffer=t._st.written, offset=t._offset * isz,
                      strides=tuple(s * isz for s in t._strides) + (1,))


def _addr_mask(t: NkiTensor, addr: np.ndarray) -> np.ndarray:
    isz = t.dtype.itemsize
    return t._st.written.reshape(-1, isz)[addr]


#: ``FUSEGRAPH_NKISIM_UNINITIALIZED``: what a read of never-written SBUF/PSUM does: ``warn`` (default: one warning
#: per kernel and process, naming the first read), ``error`` (the ``uninitialized-read`` rule error) or ``off``
UNINITIALIZED_ENV = "FUSEGRAPH_NKISIM_UNINITIALIZED"
_warned_kernels: set[tuple[str, str]] = set()


def _require_written(ctx, t: NkiTensor, mask: np.ndarray) -> None:
    """Flag a read of bytes never written since their allocation. A warning by default, not an error, because
    hardware-tested nki-library kernels (moe_tkg: a ``sendrecv`` of a partly written tile, a ``local_gather`` over
    a tile of which it uses the written part) do it legitimately."""
    if mask.all():
        return
    mode = os.environ.get(UNINITIALIZED_ENV, "warn").strip().lower()
    if mode == "off":
        return
    st = t._st
    op = getattr(ctx, "instr_name", None) or "an instruction"
    what = (f"'{st.label}' ({st.buffer.name}, view {t.shape}) never written since its allocation: uninitialised "
            f"memory (the interpreter's sentinel {'NaN' if st.dtype.is_float else '4'}) flows into the result")
    if mode != "error":
        kernel = (str(ctx.run.kernel_file), str(ctx.run.kernel_name))
        if kernel in _warned_kernels:
            return
        _warned_kernels.add(kernel)
        warn(f"[uninitialized-read] kernel {ctx.run.kernel_name}: {op} reads elements of {what} (at {ctx.where()}); "
             f"write them first or read only the written part (later such reads of this kernel are not reported; "
             f"{UNINITIALIZED_ENV}=error makes each an error)")
        return
    isz = t.dtype.itemsize
    missing = int((~mask.reshape(-1, isz).all(axis=1)).sum())
    raise NkiValidationError(
        f"{op}: reads {missing} of {t.size} elements of {what}; write them first (memset, DMA, an instruction's "
        f"dst) or read only the part that was written",
        rule="uninitialized-read",
        location=ctx.where(),
    )


def _mark(ctx, t: NkiTensor, res: Resolved | None) -> None:
    """Record that ``t`` (or the elements ``res`` resolved) was written (tracked storages only)."""
    if t._st.written is None:
        return
    if t._ind is None:
        mask_view(t)[...] = True
    elif res is None:
        mask_view(_direct(ctx, t))[...] = True
    elif res.view is not None:
        mask_view(res.view)[...] = True
    else:
        rows = t._st.written.reshape(-1, t.dtype.itemsize)
        rows[res.addr if res.valid is None else res.addr[res.valid]] = True


def written_before(t: NkiTensor) -> np.ndarray | None:
    """A copy of a direct view's written mask (per element), for instructions that write only part of their dst
    (predicated copies, skipped rows): :func:`keep_unwritten` restores what they left alone."""
    if t._st.written is None or t._ind is not None:
        return None
    return mask_view(t).all(axis=-1)


def keep_unwritten(t: NkiTensor, before: np.ndarray | None, changed: np.ndarray) -> None:
    """After a partial write of ``t`` (``changed``: the elements it wrote, broadcastable to ``t.shape``), the
    elements it did not write are as written as they were before."""
    if before is None:
        return
    now = before | np.broadcast_to(changed, t.shape)
    mask_view(t)[...] = now[..., None]


def mark_bytes(st, shape: tuple[int, ...], byte_offset: int, byte_strides: tuple[int, ...]) -> None:
    """Record a write made straight into ``st``'s buffer (a byte pattern; e.g. a widened PE transpose)."""
    if st.written is not None:
        np.ndarray(shape, dtype=np.bool_, buffer=st.written, offset=byte_offset, strides=byte_strides)[...] = True


def read_f32(ctx, t: NkiTensor) -> np.ndarray:
    v = read(ctx, t)
    if t.dtype.is_packed:
        raise NkiValidationError(f"cannot compute on packed dtype {t.dtype.name}", rule="dtype", location=ctx.where())
    return dt.to_f32(v)


def write(ctx, t: NkiTensor, values: np.ndarray, res: Resolved | None = None) -> None:
    """Write values (any numeric dtype; converted with rounding on write) into a view."""
    vals = values if values.dtype == t.dtype.np and t.dtype is not dt.tfloat32 else dt.cast_to(values, t.dtype)
    if vals.shape != t.shape:
        vals = vals.reshape(t.shape)
    if res is None or not res.skip:
        _mark(ctx, t, res)
    if t._ind is None:
        np_view(t)[...] = vals
        return
    if res is None:
        np_view(_direct(ctx, t))[...] = vals
        return
    if res.skip:
        return
    if res.view is not None:
        np_view(res.view)[...] = vals
        return
    flat = t._st.flat(t.dtype)
    if res.valid is None:
        flat[res.addr] = vals
    else:
        flat[res.addr[res.valid]] = vals[res.valid]


# ---------------------------------------------------------------------------- geometry


@dataclass
class Geo:
    """Partition geometry of an on-chip view."""

    start_partition: int
    partitions: int
    partition_stride_ok: bool
    free_lo: int  # byte range within a partition
    free_hi: int
    free_elems: int


def geometry(t: NkiTensor) -> Geo:
    st = t._st
    isz = t.dtype.itemsize
    fb = st.free_bytes or 1
    byte_off = t._offset * isz
    p0 = byte_off // fb
    f0 = byte_off % fb
    parts = t.shape[0] if t.shape else 1
    stride_ok = parts <= 1 or t._strides[0] * isz == fb
    lo = hi = f0
    for n, s in zip(t.shape[1:], t._strides[1:]):
        if n > 1:
            d = (n - 1) * s * isz
            if d < 0:
                lo += d
            else:
                hi += d
    free_elems = 1
    for n in t.shape[1:]:
        free_elems *= n
    if t._ind is not None and t._ind.kind == "vector":
        stride_ok = True
    return Geo(st.start_partition + p0, parts, stride_ok, lo, hi + isz, free_elems)


def merged_dims(shape: tuple[int, ...], strides: tuple[int, ...]) -> list[tuple[int, int]]:
    """(count, stride) pairs after dropping size-1 dims and merging contiguous neighbours."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    out: list[tuple[int, int]] = []
    for n, s in reversed(dims):
        if out and s == out[-1][0] * out[-1][1]:
            cn, cs = out[-1]
            out[-1] = (cn * n, cs)
        else:
            out.append((n, s))
    return list(reversed(out))


def contiguous_run(t: NkiTensor, on_chip: bool) -> int:
    """Elements per contiguous run (within one partition for on-chip views)."""
    shape, strides = t.shape, t._strides
    if on_chip or (t._ind is not None and t._ind.kind == "vector"):
        shape, strides = shape[1:], strides[1:]
    run = 1
    for n, s in reversed(list(zip(shape, strides))):
        if n == 1:
            continue
        if s == run:
            run *= n
        else:
            break
    return max(run, 1)


def view_span(t: NkiTensor) -> tuple[int, int]:
    return extent(t)
