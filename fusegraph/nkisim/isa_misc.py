"""Less common data-movement and statistics instructions: nc_stream_shuffle, nc_n_gather, local_gather, bn_stats,
bn_aggr, tensor_tensor_scan."""

from __future__ import annotations

import numpy as np

from . import access
from . import dtypes as dt
from .checks import SBUF, Instr, start_partition_ok
from .isa_common import alu_op, flat2, is_scalar, mark_written, name_arg, raw2, store
from .tensor import NkiTensor


def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """Cross-partition move within each 32-partition quadrant: dst[q*32+i] = src[q*32+mask[i]] (255 = keep)."""
    I = Instr("nisa.nc_stream_shuffle")
    gd = I.onchip(dst, "dst", compute=False)
    gs = I.onchip(src, "src", compute=False)
    if dst.dtype is not src.dtype:
        raise I.fail(f"dst ({dst.dtype.name}) must have the same dtype as src ({src.dtype.name})", "dtype")
    I.same_free([("dst", gd), ("src", gs)])
    try:
        mask = [int(m) for m in shuffle_mask]
    except (TypeError, ValueError):
        raise I.fail(f"shuffle_mask must be a list of 32 ints, got {shuffle_mask!r}", "shape") from None
    if len(mask) != 32 or any(not (0 <= m < 32 or m == 255) for m in mask):
        raise I.fail("shuffle_mask must have 32 entries in [0, 32) or 255", "shape")
    active = -(-max(gs.partitions, gd.partitions) // 32) * 32
    for arg, g in (("src", gs), ("dst", gd)):
        if not start_partition_ok(g.start_partition, active):
            raise I.fail(
                f"{arg} starts at partition {g.start_partition} but {active} active partitions require a start of "
                f"{'0' if active > 64 else '0 or 64' if active > 32 else '0/32/64/96'}",
                "start-partition",
            )
    if I.data:
        s = np.asarray(raw2(I, src))
        d = np.array(access.read(I.ctx, dst, check=False)).reshape(dst.shape[0], -1)  # partitions not shuffled keep theirs
        for q in range(active // 32):
            for i, m in enumerate(mask):
                di, si = q * 32 + i, q * 32 + m
                if m == 255 or di >= gd.partitions:
                    continue
                if si >= gs.partitions:
                    raise I.fail(f"shuffle_mask[{i}]={m} reads partition {si} beyond src's {gs.partitions}", "shape")
                d[di] = s[si]
        store(I, dst, d)
    mark_written(dst)
    I.record("nc_stream_shuffle", "vector", gd.partitions, gd.free_elems, dst.dtype.name, name_arg(name))


def nc_n_gather(dst, data, indices, name=None):
    """Per-partition gather: dst[p, j] = flat(data[p])[indices[p, j]] (GpSimd, SBUF only)."""
    I = Instr("nisa.nc_n_gather")
    gd = I.onchip(dst, "dst", allowed=(SBUF,))
    g = I.onchip(data, "data", allowed=(SBUF,))
    gi = I.onchip(indices, "indices", allowed=(SBUF,))
    I.same_partitions([("dst", gd), ("data", g), ("indices", gi)])
    I.same_free([("dst", gd), ("indices", gi)])
    if dst.dtype is not data.dtype:
        raise I.fail(f"dst dtype ({dst.dtype.name}) must equal data dtype ({data.dtype.name})", "dtype")
    if indices.dtype is not dt.uint32:
        raise I.fail(f"indices must be uint32, got {indices.dtype.name}", "dtype")
    I.align([("data", g), ("indices", gi)], ("dst", gd))
    if I.data:
        idx = np.asarray(raw2(I, indices)).astype(np.int64)
        if (idx >= g.free_elems).any():
            raise I.fail(f"an index is outside [0, {g.free_elems})", "out-of-bounds")
        store(I, dst, np.take_along_axis(np.asarray(raw2(I, data)), idx, axis=1))
    I.record("nc_n_gather", "gpsimd", gd.partitions, gd.free_elems, dst.dtype.name, name_arg(name))


_LG_ELEMS_PER_IDX = (1, 2, 4, 8, 16, 32)
_LG_CORE_PARTITIONS = 16
_LG_MAX_INDICES = 4096


def local_gather(dst, src_buffer, index, num_elem_per_idx=1, num_valid_indices=None, name=None):
    """Gather within each GpSimd core's 16 partitions (GpSimd, SBUF only).

    The 2.29 docstring and its NumPy reference (``test_nki_isa_local_gather.py``): for each 16-partition slice (one
    GpSimd core), ``indices_1d = index[slice].flatten(order='F')[:num_valid_indices]`` (partition dimension first),
    and every partition of the slice gathers ``num_elem_per_idx`` contiguous elements of its own row at each index
    (the index is the element offset within the partition: the reference passes ``index * num_elem_per_idx``).
    Constraints: uint16 indices, ``src_buffer.shape[0] == index.shape[0]`` and a multiple of 16, ``num_elem_per_idx``
    in {1, 2, 4, 8, 16, 32}, at most 4096 indices per core, no dtype cast.  Out-of-bound indices are "undefined"
    (rule ``undefined``, data runs)."""
    I = Instr("nisa.local_gather")
    gd = I.onchip(dst, "dst", allowed=(SBUF,))
    g = I.onchip(src_buffer, "src_buffer", allowed=(SBUF,))
    gi = I.onchip(index, "index", allowed=(SBUF,))
    if index.dtype is not dt.uint16:
        raise I.fail(f"index must be uint16, got {index.dtype.name}", "dtype")
    if dst.dtype is not src_buffer.dtype:
        raise I.fail(f"dst dtype ({dst.dtype.name}) must equal src_buffer dtype ({src_buffer.dtype.name}): "
                     f"local_gather does not cast", "dtype")
    if g.partitions != gi.partitions or g.partitions % _LG_CORE_PARTITIONS:
        raise I.fail(f"src_buffer ({g.partitions} partitions) and index ({gi.partitions}) must have the same partition "
                     f"count, a multiple of {_LG_CORE_PARTITIONS}", "shape")
    I.same_partitions([("src_buffer", g), ("dst", gd)])
    if num_elem_per_idx not in _LG_ELEMS_PER_IDX:
        raise I.fail(f"num_elem_per_idx must be one of {_LG_ELEMS_PER_IDX}, got {num_elem_per_idx!r}", "shape")
    cores = g.partitions // _LG_CORE_PARTITIONS
    per_core = (gi.partitions * gi.free_elems) // cores
    valid = per_core if num_valid_indices is None else int(num_valid_indices)
    if not 0 < valid <= per_core:
        raise I.fail(f"num_valid_indices={num_valid_indices!r} must be in [1, {per_core}] (the indices of one "
                     f"16-partition slice of index)", "shape")
    if valid > _LG_MAX_INDICES:
        raise I.fail(f"{valid} indices per GpSimd core exceed {_LG_MAX_INDICES}", "shape")
    if gd.free_elems != valid * num_elem_per_idx:
        raise I.fail(f"dst has {gd.free_elems} elements per partition; num_valid_indices x num_elem_per_idx = "
                     f"{valid * num_elem_per_idx}", "shape")
    if I.data:
        src = np.asarray(raw2(I, src_buffer))
        idx = np.asarray(raw2(I, index)).astype(np.int64)
        out = np.empty((g.partitions, valid, num_elem_per_idx), dtype=src.dtype)
        span = np.arange(num_elem_per_idx)
        for c in range(cores):
            rows = slice(c * _LG_CORE_PARTITIONS, (c + 1) * _LG_CORE_PARTITIONS)
            ids = idx[rows].flatten(order="F")[:valid]
            cols = ids[:, None] + span[None, :]
            if (cols < 0).any() or (cols >= g.free_elems).any():
                raise I.fail(f"an index of GpSimd core {c} reads outside the {g.free_elems} elements of a partition "
                             f"(undefined on hardware)", "undefined")
            out[rows] = src[rows][:, cols]
        store(I, dst, out.reshape(g.partitions, -1))
    I.record("local_gather", "gpsimd", gd.partitions, gd.free_elems, dst.dtype.name, name_arg(name))


def bn_stats(dst, data, name=None):
    """Per-partition (count, mean, var*count) of the even and of the odd elements (<=512 elements)."""
    I = Instr("nisa.bn_stats")
    gd = I.onchip(dst, "dst")
    g = I.onchip(data, "data")
    I.same_partitions([("dst", gd), ("data", g)])
    if g.free_elems > 512:
        raise I.fail(f"data has {g.free_elems} elements per partition; bn_stats handles at most 512", "shape")
    if gd.free_elems != 6:
        raise I.fail(f"dst must have 6 elements per partition, got {gd.free_elems}", "shape")
    I.align([("data", g)], ("dst", gd))
    if I.data:
        x = flat2(I, data).astype(np.float64)
        out = []
        for part in (x[:, 0::2], x[:, 1::2]):
            n = part.shape[1]
            mean = part.mean(axis=1) if n else np.zeros(x.shape[0])
            var = part.var(axis=1) if n else np.zeros(x.shape[0])
            out += [np.full(x.shape[0], n, dtype=np.float64), mean, var * n]
        store(I, dst, np.stack(out, axis=1).astype(np.float32))
    mark_written(dst)
    I.record("bn_stats", "vector", g.partitions, g.free_elems, dst.dtype.name, name_arg(name))


def bn_aggr(dst, data, name=None):
    """Aggregate bn_stats tuples (count, mean, var*count) into (mean, variance) per partition."""
    I = Instr("nisa.bn_aggr")
    gd = I.onchip(dst, "dst")
    g = I.onchip(data, "data")
    I.same_partitions([("dst", gd), ("data", g)])
    if g.free_elems % 3:
        raise I.fail(f"data must hold (count, mean, var*count) triples, got {g.free_elems} elements", "shape")
    if gd.free_elems != 2:
        raise I.fail(f"dst must have 2 elements per partition (mean, variance), got {gd.free_elems}", "shape")
    I.align([("data", g)], ("dst", gd))
    if I.data:
        t = flat2(I, data).astype(np.float64).reshape(g.partitions, -1, 3)
        c, m, m2 = t[..., 0], t[..., 1], t[..., 2]
        n = c.sum(axis=1)
        safe = np.where(n > 0, n, 1)
        mean = (c * m).sum(axis=1) / safe
        var = (m2.sum(axis=1) + (c * (m - mean[:, None]) ** 2).sum(axis=1)) / safe
        store(I, dst, np.stack([mean, var], axis=1).astype(np.float32))
    mark_written(dst)
    I.record("bn_aggr", "vector", g.partitions, g.free_elems, dst.dtype.name, name_arg(name))


def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None):
    """Scan along the free axis: r[i] = op1(op0(data0[i], r[i-1]), data1[i]), r[-1] = initial."""
    I = Instr("nisa.tensor_tensor_scan")
    s0 = alu_op(I, op0, "op0", allow_bitvec=False, allow_unary=False)
    s1 = alu_op(I, op1, "op1", allow_bitvec=False, allow_unary=False)
    gd = I.onchip(dst, "dst")
    g0 = I.onchip(data0, "data0")
    g1 = I.onchip(data1, "data1")
    I.same_partitions([("dst", gd), ("data0", g0), ("data1", g1)])
    I.same_free([("dst", gd), ("data0", g0), ("data1", g1)])
    if data0.buffer.name == "psum" and data1.buffer.name == "psum":
        raise I.fail("data0 and data1 cannot both reside in PSUM", "buffer")
    P = g0.partitions
    inputs = [("data0", g0), ("data1", g1)]
    if isinstance(initial, NkiTensor):
        inputs.append(("initial", I.per_partition_vector(initial, "initial", P)))
    elif not is_scalar(initial):
        raise I.fail("initial must be a float32 scalar or a [P, 1] tensor", "shape")
    I.align(inputs, ("dst", gd))
    if I.data:
        a = flat2(I, data0)
        b = flat2(I, data1)
        prev = flat2(I, initial).reshape(P) if isinstance(initial, NkiTensor) else np.full(P, initial, np.float32)
        out = np.empty_like(a)
        for i in range(a.shape[1]):
            t = s0.alu(prev, a[:, i]) if reverse0 else s0.alu(a[:, i], prev)
            prev = (s1.alu(b[:, i], t) if reverse1 else s1.alu(t, b[:, i])).astype(np.float32)
            out[:, i] = prev
        store(I, dst, out)
    mark_written(dst)
    I.record("tensor_tensor_scan", "vector", P, g0.free_elems, dst.dtype.name, name_arg(name))
