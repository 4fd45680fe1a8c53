"""Top-k and selection instructions: max8, nc_find_index8, nc_match_replace8, select_reduce, range_select.

All run on the Vector Engine in float32.  ``nc_find_index8`` with a value that is not present is undefined
behaviour on hardware; the interpreter raises instead (rule ``undefined``) in data runs.
"""

from __future__ import annotations

import numpy as np

from . import dtypes as dt
from . import language_ops as nlops
from .checks import PSUM, Instr
from .enums import reduce_cmd, require_enum
from .isa_common import alu_op, flat2, is_scalar, mark_written, name_arg, raw2, store
from .isa_common import reduce_op as _reduce_spec
from .tensor import NkiTensor

_RC = reduce_cmd


def _topk_src(I: Instr, src, arg: str):
    g = I.onchip(src, arg)
    if not 8 <= g.free_elems <= 16384:
        raise I.fail(f"{arg} must have 8..16384 elements per partition, got {g.free_elems}", "shape")
    return g


def _dst8(I: Instr, dst, arg: str, P: int):
    g = I.onchip(dst, arg)
    if g.partitions != P or g.free_elems != 8:
        raise I.fail(f"{arg} must be [{P}, 8], got {dst.shape}", "shape")
    return g


def max8(dst, src, name=None):
    """The 8 largest values of each partition, in descending order."""
    I = Instr("nisa.max8")
    g = _topk_src(I, src, "src")
    gd = _dst8(I, dst, "dst", g.partitions)
    I.align([("src", g)], ("dst", gd))
    if I.data:
        v = flat2(I, src)
        top = -np.sort(-v, axis=1, kind="stable")[:, :8]
        store(I, dst, top)
    mark_written(dst)
    I.record("max8", "vector", g.partitions, g.free_elems, dst.dtype.name, name_arg(name))


def nc_find_index8(dst, data, vals, name=None):
    """Index of the first occurrence of each of the 8 values per partition (uint16/uint32 dst)."""
    I = Instr("nisa.nc_find_index8")
    g = _topk_src(I, data, "data")
    gd = _dst8(I, dst, "dst", g.partitions)
    gv = _dst8(I, vals, "vals", g.partitions)
    if dst.dtype not in (dt.uint16, dt.uint32):
        raise I.fail(f"dst must be uint16 or uint32, got {dst.dtype.name}", "dtype")
    I.align([("data", g), ("vals", gv)], ("dst", gd))
    if I.data:
        d = flat2(I, data)
        v = flat2(I, vals)
        eq = d[:, None, :] == v[:, :, None]
        found = eq.any(axis=2)
        if not found.all():
            p, k = np.argwhere(~found)[0]
            raise I.fail(
                f"value {v[p, k]!r} (vals[{p}, {k}]) does not occur in data partition {p}; this is undefined "
                f"behaviour on hardware",
                "undefined",
            )
        store(I, dst, np.argmax(eq, axis=2).astype(np.int64))
    mark_written(dst)
    I.record("nc_find_index8", "vector", g.partitions, g.free_elems, dst.dtype.name, name_arg(name))


def nc_match_replace8(dst, data, vals, imm, dst_idx=None, name=None):
    """Replace the first occurrence of each of the 8 values per partition with imm (optionally output indices)."""
    I = Instr("nisa.nc_match_replace8")
    g = _topk_src(I, data, "data")
    gd = I.onchip(dst, "dst")
    gv = _dst8(I, vals, "vals", g.partitions)
    I.same_partitions([("dst", gd), ("data", g)])
    I.same_free([("dst", gd), ("data", g)])
    if not is_scalar(imm):
        raise I.fail("imm must be a float immediate", "dtype")
    if dst_idx is not None:
        _dst8(I, dst_idx, "dst_idx", g.partitions)
        if dst_idx.dtype not in (dt.uint16, dt.uint32):
            raise I.fail(f"dst_idx must be uint16 or uint32, got {dst_idx.dtype.name}", "dtype")
    I.align([("data", g), ("vals", gv)], ("dst", gd))
    if I.data:
        d = flat2(I, data).copy()
        v = flat2(I, vals)
        idx = np.zeros((g.partitions, 8), dtype=np.int64)
        for k in range(8):
            eq = d == v[:, k : k + 1]
            found = eq.any(axis=1)
            if not found.all():
                p = int(np.argmin(found))
                raise I.fail(
                    f"value {v[p, k]!r} (vals[{p}, {k}]) does not occur in data partition {p}; undefined behaviour",
                    "undefined",
                )
            first = np.argmax(eq, axis=1)
            idx[:, k] = first
            d[np.arange(g.partitions), first] = np.float32(imm)
        store(I, dst, d)
        if dst_idx is not None:
            store(I, dst_idx, idx)
    mark_written(dst)
    I.record("nc_match_replace8", "vector", g.partitions, g.free_elems, dst.dtype.name, name_arg(name))


def _accumulate_max(I: Instr, cmd, start: int, P: int, values: np.ndarray, reduce_res) -> None:
    regs = I.ctx.vec_regs[start : start + P]
    if cmd is _RC.reset_reduce:
        regs[...] = -np.inf
    if cmd in (_RC.reduce, _RC.reset_reduce):
        np.maximum(regs, values.max(axis=1), out=regs)
    if reduce_res is not None:
        store(I, reduce_res, regs.reshape(P, 1))


def select_reduce(dst, predicate, on_true, on_false, reduce_res=None, reduce_cmd=reduce_cmd.idle,
                  reduce_op=nlops.maximum, reverse_pred=False, name=None):
    """dst = where(predicate, on_true, on_false) with an optional max-reduction into reduce_res."""
    I = Instr("nisa.select_reduce")
    cmd = require_enum(reduce_cmd, _RC, "reduce_cmd", I.name)
    _check_max(I, reduce_op)
    gd = I.onchip(dst, "dst")
    gp = I.onchip(predicate, "predicate")
    gt = I.onchip(on_true, "on_true")
    I.same_partitions([("dst", gd), ("predicate", gp), ("on_true", gt)])
    I.same_free([("dst", gd), ("predicate", gp), ("on_true", gt)])
    if on_true.buffer is PSUM and predicate.buffer is PSUM:
        raise I.fail("on_true and predicate cannot both reside in PSUM", "buffer")
    if on_true.dtype in (dt.tfloat32, dt.int32, dt.uint32):
        raise I.fail(f"on_true cannot be {on_true.dtype.name}", "dtype")
    if predicate.dtype not in (dt.int8, dt.uint8, dt.int16, dt.uint16):
        raise I.fail(f"predicate must be int8/uint8/int16/uint16, got {predicate.dtype.name}", "dtype")
    inputs = [("predicate", gp), ("on_true", gt)]
    P = gt.partitions
    if isinstance(on_false, NkiTensor):
        inputs.append(("on_false", I.per_partition_vector(on_false, "on_false", P)))
    elif not is_scalar(on_false):
        raise I.fail("on_false must be a float32 scalar or a [P, 1] tensor", "shape")
    if reduce_res is not None:
        I.per_partition_vector(reduce_res, "reduce_res", P)
        if not reduce_res.dtype.is_float:
            raise I.fail(f"reduce_res must be a float type, got {reduce_res.dtype.name}", "dtype")
    I.align(inputs, ("dst", gd))
    if I.data:
        pred = raw2(I, predicate) != 0
        if reverse_pred:
            pred = ~pred
        f = flat2(I, on_false).reshape(P, 1) if isinstance(on_false, NkiTensor) else np.float32(on_false)
        res = np.where(pred, flat2(I, on_true), f).astype(np.float32)
        store(I, dst, res)
        _accumulate_max(I, cmd, gt.start_partition, P, res, reduce_res)
    mark_written(dst)
    I.record("select_reduce", "vector", P, gt.free_elems, dst.dtype.name, name_arg(name))


def _check_max(I: Instr, op) -> None:
    _reduce_spec(I, op, "reduce_op", allowed=("maximum",))


_CMPS = ("equal", "less", "less_equal", "greater", "greater_equal")


def range_select(dst, on_true_tile, comp_op0, comp_op1, bound0, bound1, reduce_cmd=reduce_cmd.reset_reduce,
                 reduce_res=None, reduce_op=nlops.maximum, range_start=0, on_false_value=-3.4028235e+38, name=None):
    """Keep elements whose free index (+range_start) satisfies both comparisons with bound0/bound1; max-reduce."""
    I = Instr("nisa.range_select")
    cmd = require_enum(reduce_cmd, _RC, "reduce_cmd", I.name)
    _check_max(I, reduce_op)
    s0 = alu_op(I, comp_op0, "comp_op0")
    s1 = alu_op(I, comp_op1, "comp_op1")
    for arg, s in (("comp_op0", s0), ("comp_op1", s1)):
        if s.name not in _CMPS:
            raise I.fail(f"{arg} must be one of {', '.join('nl.' + c for c in _CMPS)}, got nl.{s.name}", "op")
    if np.float32(on_false_value) != np.finfo(np.float32).min:
        raise I.fail("on_false_value must be FP32_MIN (-3.4028235e+38)", "op")
    if not isinstance(range_start, (int, np.integer)):
        raise I.fail("range_start must be a compile-time integer", "dtype")
    gd = I.onchip(dst, "dst")
    gt = I.onchip(on_true_tile, "on_true_tile")
    I.same_partitions([("dst", gd), ("on_true_tile", gt)])
    I.same_free([("dst", gd), ("on_true_tile", gt)])
    if not on_true_tile.dtype.is_float:
        raise I.fail(f"on_true_tile must be a float dtype, got {on_true_tile.dtype.name}", "dtype")
    P = gt.partitions
    inputs = [("on_true_tile", gt)]
    for arg, b in (("bound0", bound0), ("bound1", bound1)):
        gb = I.per_partition_vector(b, arg, P)
        if b.dtype is not dt.float32:
            raise I.fail(f"{arg} must be float32, got {b.dtype.name}", "dtype")
        inputs.append((arg, gb))
    if reduce_res is not None:
        I.per_partition_vector(reduce_res, "reduce_res", P)
    I.align(inputs, ("dst", gd))
    if I.data:
        idx = (np.float32(range_start) + np.arange(gt.free_elems, dtype=np.float32))[None, :]
        m = (s0.alu(idx, flat2(I, bound0)) != 0) & (s1.alu(idx, flat2(I, bound1)) != 0)
        res = np.where(m, flat2(I, on_true_tile), np.float32(on_false_value)).astype(np.float32)
        store(I, dst, res)
        _accumulate_max(I, cmd, gt.start_partition, P, res, reduce_res)
    mark_written(dst)
    I.record("range_select", "vector", P, gt.free_elems, dst.dtype.name, name_arg(name))
