"""Element-wise ISA instructions: tensor_tensor, tensor_scalar, scalar_tensor_tensor, tensor_copy, memset,
reciprocal, tensor_copy_predicated, iota, affine_select.

Each function has exactly the 0.3.0 signature.  Checks run in data and shape-only runs alike; arithmetic only
in data runs.  Engines compute in float32 and round on write; bitvec operators work on integer bit patterns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import access
from . import dtypes as dt
from . import language_ops as nlops
from .checks import PSUM, SBUF, Instr
from . import enums as E
from .enums import engine
from .isa_common import (
    ENGINE_NAMES,
    alu_op,
    bits_u64,
    flat2,
    from_bits,
    is_scalar,
    mark_written,
    name_arg,
    no_psum_on_gpsimd,
    operand_values,
    pick_engine,
    raw2,
    require_int,
    scalar_or_vector,
    store,
)
from .opsdef import OpSpec
from .tensor import NkiTensor

_INT32S = (dt.int32, dt.uint32)


def _apply(spec: OpSpec, a: Any, b: Any, reverse: bool) -> np.ndarray:
    if spec.unary:
        return spec.alu(a, None)
    return spec.alu(b, a) if reverse else spec.alu(a, b)


def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """dst = data1 <op> data2 element-wise (Vector or GpSimd Engine)."""
    I = Instr("nisa.tensor_tensor")
    spec = alu_op(I, op, "op", allow_unary=False)
    gd = I.onchip(dst, "dst")
    g1 = I.onchip(data1, "data1")
    g2 = I.onchip(data2, "data2")
    I.same_partitions([("dst", gd), ("data1", g1), ("data2", g2)])
    I.same_free([("dst", gd), ("data1", g1), ("data2", g2)])
    if data1.buffer is PSUM and data2.buffer is PSUM:
        raise I.fail("data1 and data2 cannot both reside in PSUM", "buffer")
    all_int32 = all(t.dtype in _INT32S for t in (dst, data1, data2))
    any_psum = any(t.buffer is PSUM for t in (dst, data1, data2))
    default = E.engine.gpsimd if (spec.name == "power" or (all_int32 and not any_psum)) else E.engine.vector
    e = pick_engine(I, engine, (E.engine.vector, E.engine.gpsimd), default)
    if spec.name == "power" and e is not E.engine.gpsimd:
        raise I.fail("nl.power runs on the GpSimd engine only", "engine")
    no_psum_on_gpsimd(I, e, [("dst", dst), ("data1", data1), ("data2", data2)])
    if spec.bitvec:
        for a, t in (("dst", dst), ("data1", data1), ("data2", data2)):
            require_int(I, t, a, f"bitvec operator nl.{spec.name}")
    I.align([("data1", g1), ("data2", g2)], ("dst", gd))
    if I.data:
        if spec.bitvec:
            a = bits_u64(raw2(I, data1), data1.dtype)
            b = bits_u64(raw2(I, data2), data2.dtype)
            store(I, dst, from_bits(spec.alu(a, b), dst.dtype))
        elif all_int32 and e is E.engine.gpsimd:
            a = raw2(I, data1).astype(np.int64)
            b = raw2(I, data2).astype(np.int64)
            res = spec.alu(a, b)
            store(I, dst, np.asarray(res).astype(np.int64))
        else:
            store(I, dst, spec.alu(flat2(I, data1), flat2(I, data2)))
    mark_written(dst)
    I.record("tensor_tensor", ENGINE_NAMES[e], gd.partitions, gd.free_elems, dst.dtype.name, name_arg(name))


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
    """dst = (data <op0> operand0) <op1> operand1 with scalar or [P, 1] operands."""
    I = Instr("nisa.tensor_scalar")
    s0, s1 = _tensor_scalar_ops(I, op0, op1, operand1)
    gd = I.onchip(dst, "dst")
    g = I.onchip(data, "data")
    I.same_partitions([("dst", gd), ("data", g)])
    I.same_free([("dst", gd), ("data", g)])
    P = g.partitions
    inputs = [("data", g)]
    for arg, spec, operand in (("operand0", s0, operand0), ("operand1", s1, operand1)):
        if spec is None:
            continue
        if spec.unary and operand is None:
            continue
        og = scalar_or_vector(I, operand, arg, P, require_fp32=not spec.bitvec)
        if og is not None:
            inputs.append((arg, og))
        elif spec.bitvec and not isinstance(operand, (int, np.integer)):
            raise I.fail(f"{arg} must be an integer for bitvec operator nl.{spec.name}", "dtype")
    e = _tensor_scalar_engine(I, engine, s0, s1)
    no_psum_on_gpsimd(I, e, [("dst", dst), ("data", data), ("operand0", operand0), ("operand1", operand1)])
    if s0.bitvec:
        require_int(I, dst, "dst", "bitvec operators")
        require_int(I, data, "data", "bitvec operators")
    I.align(inputs, ("dst", gd))
    if I.data:
        _tensor_scalar_data(I, dst, data, ((s0, operand0, reverse0), (s1, operand1, reverse1)), P)
    mark_written(dst)
    I.record("tensor_scalar", ENGINE_NAMES[e], gd.partitions, gd.free_elems, dst.dtype.name, name_arg(name))


def _tensor_scalar_ops(I: Instr, op0: Any, op1: Any, operand1: Any) -> tuple[OpSpec, OpSpec | None]:
    """The two operators of a tensor_scalar: op1 and operand1 come together (a unary op1 needs no operand), and
    both operators are bitvec or both arithmetic."""
    s0 = alu_op(I, op0, "op0")
    s1 = None
    if op1 is None and operand1 is not None:
        raise I.fail("operand1 is set but op1 is None; both must be set or both be None", "shape")
    if op1 is not None:
        s1 = alu_op(I, op1, "op1")
        if operand1 is None and not s1.unary:
            raise I.fail("op1 is set but operand1 is None; both must be set or both be None", "shape")
        if s1.bitvec != s0.bitvec:
            raise I.fail("op0 and op1 must both be bitvec or both be arithmetic operators", "op")
    return s0, s1


def _tensor_scalar_engine(I: Instr, engine_arg: Any, s0: OpSpec, s1: OpSpec | None) -> Any:
    """The engine a tensor_scalar runs on (default Vector) and what each engine accepts: bitvec only on Vector,
    GpSimd only for rsqrt, the trn2 Scalar engine only for multiply/add combinations."""
    e = pick_engine(I, engine_arg, (E.engine.vector, E.engine.scalar, E.engine.gpsimd), E.engine.vector)
    if s0.bitvec and e is not E.engine.vector:
        raise I.fail("bitvec operators must run on the Vector engine", "engine")
    if e is E.engine.gpsimd and not (s0.name == "rsqrt" and s1 is None):
        raise I.fail("the GpSimd engine is only allowed for nl.rsqrt in tensor_scalar", "engine")
    if e is E.engine.scalar and I.ctx.target.name == "trn2":
        combo = (s0.name, s1.name if s1 else None)
        if combo not in (("multiply", "add"), ("multiply", None), ("add", None)):
            raise I.fail(
                f"the Scalar engine on trn2 only supports (multiply, add), (multiply, None) and (add, None); got "
                f"(nl.{combo[0]}, {('nl.' + combo[1]) if combo[1] else None})",
                "engine",
            )
    return e


def _tensor_scalar_data(I: Instr, dst: Any, data: Any, ops: tuple, P: int) -> None:
    """The arithmetic (data runs only): bitvec operators on the 64-bit patterns of the integers, arithmetic
    ones in float32; each ``(spec, operand, reverse)`` of ``ops`` applied in turn (a missing op1 skipped)."""
    if ops[0][0].bitvec:
        res = bits_u64(raw2(I, data), data.dtype)
        for spec, operand, rev in ops:
            if spec is None:
                continue
            b = np.uint64(int(operand) & ((1 << 64) - 1)) if operand is not None else None
            res = _apply(spec, res, b, bool(rev))
        store(I, dst, from_bits(res, dst.dtype))
    else:
        res = flat2(I, data)
        for spec, operand, rev in ops:
            if spec is None:
                continue
            b = operand_values(I, operand, P) if operand is not None else None
            res = _apply(spec, res, b, bool(rev))
        store(I, dst, res)


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    """dst = (data <op0> operand0) <op1> operand1 (operand1 a full tensor) on the Vector engine."""
    I = Instr("nisa.scalar_tensor_tensor")
    s0 = alu_op(I, op0, "op0", allow_bitvec=False)
    s1 = alu_op(I, op1, "op1", allow_bitvec=False, allow_unary=False)
    gd = I.onchip(dst, "dst")
    g = I.onchip(data, "data")
    g1 = I.onchip(operand1, "operand1")
    I.same_partitions([("dst", gd), ("data", g), ("operand1", g1)])
    I.same_free([("dst", gd), ("data", g), ("operand1", g1)])
    if data.buffer is PSUM and operand1.buffer is PSUM:
        raise I.fail("data and operand1 cannot both reside in PSUM", "buffer")
    inputs = [("data", g), ("operand1", g1)]
    if not (s0.unary and operand0 is None):
        og = scalar_or_vector(I, operand0, "operand0", g.partitions, require_fp32=False)
        if og is not None:
            inputs.append(("operand0", og))
    I.align(inputs, ("dst", gd))
    if I.data:
        P = g.partitions
        tmp = _apply(s0, flat2(I, data), operand_values(I, operand0, P) if operand0 is not None else None,
                     bool(reverse0))
        store(I, dst, _apply(s1, tmp, flat2(I, operand1), bool(reverse1)))
    mark_written(dst)
    I.record("scalar_tensor_tensor", "vector", gd.partitions, gd.free_elems, dst.dtype.name, name_arg(name))


def tensor_copy(dst, src, engine=engine.unknown, name=None):
    """On-chip copy/cast (the standard PSUM->SBUF eviction); bit-exact when dtypes match."""
    I = Instr("nisa.tensor_copy")
    gd = I.onchip(dst, "dst")
    gs = I.onchip(src, "src")
    I.same_partitions([("dst", gd), ("src", gs)])
    I.same_free([("dst", gd), ("src", gs)])
    e = pick_engine(I, engine, (E.engine.vector, E.engine.scalar, E.engine.gpsimd), E.engine.vector)
    no_psum_on_gpsimd(I, e, [("dst", dst), ("src", src)])
    I.align([("src", gs)], ("dst", gd))
    if I.data:
        if src.dtype is dst.dtype:
            store(I, dst, np.asarray(raw2(I, src)))
        elif src.dtype.is_packed or dst.dtype.is_packed:
            raise I.fail(f"cannot convert between {src.dtype.name} and {dst.dtype.name}", "dtype")
        else:
            store(I, dst, flat2(I, src))
    mark_written(dst)
    I.record("tensor_copy", ENGINE_NAMES[e], gd.partitions, gd.free_elems, dst.dtype.name, name_arg(name))


def memset(dst, value, engine=engine.unknown, name=None):
    """Fill dst with a compile-time constant whose type matches dst's dtype (SDK 2.29 rule)."""
    I = Instr("nisa.memset")
    gd = I.onchip(dst, "dst")
    e = pick_engine(I, engine, (E.engine.vector, E.engine.gpsimd), E.engine.vector)
    no_psum_on_gpsimd(I, e, [("dst", dst)])
    d = dst.dtype
    if not is_scalar(value):
        raise I.fail(f"value must be a compile-time constant, got {type(value).__name__}", "dtype")
    if d.is_packed and value != 0:
        raise I.fail(f"only value=0 is supported for packed dtype {d.name}", "dtype")
    if d.is_int and not isinstance(value, (int, np.integer)):
        raise I.fail(
            f"value {value!r} must be an integer literal for {d.name} dst (SDK 2.29 memset requires the value "
            f"type to match the dst dtype)",
            "dtype",
        )
    if I.data:
        if d.is_packed:
            store(I, dst, np.zeros(dst.shape, dtype=d.np))
        elif d.is_int:
            info = np.iinfo(d.np)
            if not info.min <= int(value) <= info.max:
                raise I.fail(f"value {value} does not fit {d.name}", "dtype")
            store(I, dst, np.full(dst.shape, int(value), dtype=d.np))
        else:
            store(I, dst, np.full(dst.shape, value, dtype=np.float32))
    mark_written(dst)
    I.record("memset", ENGINE_NAMES[e], gd.partitions, gd.free_elems, d.name, name_arg(name))


def reciprocal(dst, data, name=None):
    """dst = 1 / data on the Vector engine (float32 math)."""
    I = Instr("nisa.reciprocal")
    gd = I.onchip(dst, "dst")
    g = I.onchip(data, "data")
    I.same_partitions([("dst", gd), ("data", g)])
    I.same_free([("dst", gd), ("data", g)])
    I.align([("data", g)], ("dst", gd))
    if I.data:
        store(I, dst, np.float32(1.0) / flat2(I, data))
    mark_written(dst)
    I.record("reciprocal", "vector", gd.partitions, gd.free_elems, dst.dtype.name, name_arg(name))


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    """Copy src (tensor or scalar) into dst where predicate != 0 (== 0 with reverse_pred)."""
    I = Instr("nisa.tensor_copy_predicated")
    gd = I.onchip(dst, "dst")
    gp = I.onchip(predicate, "predicate")
    pairs = [("dst", gd), ("predicate", gp)]
    inputs = [("predicate", gp)]
    if isinstance(src, NkiTensor):
        gs = I.onchip(src, "src")
        pairs.append(("src", gs))
        inputs.insert(0, ("src", gs))
        if src.dtype is not dst.dtype:
            raise I.fail(f"src ({src.dtype.name}) and dst ({dst.dtype.name}) must share the same dtype", "dtype")
        if src.buffer is PSUM and predicate.buffer is PSUM:
            raise I.fail("src and predicate cannot both reside in PSUM", "buffer")
    elif not is_scalar(src):
        raise I.fail(f"src must be a tensor or a scalar, got {type(src).__name__}", "shape")
    if predicate.dtype not in (dt.uint8, dt.uint16, dt.uint32):
        raise I.fail(f"predicate must be uint8, uint16 or uint32, got {predicate.dtype.name}", "dtype")
    I.same_partitions(pairs)
    I.same_free(pairs)
    I.align(inputs, ("dst", gd))
    if I.data:
        pred = raw2(I, predicate) != 0
        if reverse_pred:
            pred = ~pred
        cur = np.array(access.read(I.ctx, dst, check=False)).reshape(pred.shape)  # kept where pred is false
        if isinstance(src, NkiTensor):
            new = raw2(I, src)
        else:
            new = dt.cast_to(np.full(cur.shape, src, dtype=np.float32), dst.dtype)
        before = access.written_before(dst)
        store(I, dst, np.where(pred, new, cur).astype(dst.dtype.np))
        access.keep_unwritten(dst, before, pred.reshape(dst.shape))
    mark_written(dst)
    I.record("tensor_copy_predicated", "vector", gd.partitions, gd.free_elems, dst.dtype.name, name_arg(name))


def _pattern_values(I: Instr, pattern: Any, partitions: int, free: int, offset: Any, channel_multiplier: Any) -> np.ndarray:
    try:
        pairs = [(int(p[0]), int(p[1])) for p in pattern]
    except (TypeError, ValueError, IndexError):
        raise I.fail(f"pattern must be a list of [step, num] pairs, got {pattern!r}", "shape") from None
    if not 1 <= len(pairs) <= 4:
        raise I.fail(f"pattern must have 1 to 4 [step, num] pairs, got {len(pairs)}", "shape")
    total = 1
    for _, n in pairs:
        total *= n
    if total != free:
        raise I.fail(
            f"pattern {pattern} has {total} elements but dst has {free} elements per partition", "shape"
        )
    if not isinstance(offset, (int, np.integer)) or not isinstance(channel_multiplier, (int, np.integer)):
        raise I.fail("offset and channel_multiplier must be int32 compile-time constants", "dtype")
    vals = np.full((partitions,) + tuple(n for _, n in pairs), int(offset), dtype=np.int64)
    vals += (np.arange(partitions, dtype=np.int64) * int(channel_multiplier)).reshape((partitions,) + (1,) * len(pairs))
    for k, (step, n) in enumerate(pairs):
        shp = [1] * (len(pairs) + 1)
        shp[k + 1] = n
        vals += (np.arange(n, dtype=np.int64) * step).reshape(shp)
    return vals.reshape(partitions, free)


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """dst[p, i...] = offset + p * channel_multiplier + sum(step_k * i_k) (int32 math, GpSimd)."""
    I = Instr("nisa.iota")
    gd = I.onchip(dst, "dst", allowed=(SBUF,))
    vals = _pattern_values(I, pattern, gd.partitions, gd.free_elems, offset, channel_multiplier)
    if I.data:
        v32 = vals.astype(np.int32)
        store(I, dst, v32 if dst.dtype.is_int else v32.astype(np.float32))
    I.record("iota", "gpsimd", gd.partitions, gd.free_elems, dst.dtype.name, name_arg(name))


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=nlops.equal, offset=0,
                  name=None):
    """dst = on_true_tile where cmp_op(affine_value, 0) else on_false_value (GpSimd; causal masks)."""
    I = Instr("nisa.affine_select")
    spec = alu_op(I, cmp_op, "cmp_op")
    if not spec.compare:
        raise I.fail(f"cmp_op must be a comparison operator, got nl.{spec.name}", "op")
    gd = I.onchip(dst, "dst", allowed=(SBUF,))
    gt = I.onchip(on_true_tile, "on_true_tile", allowed=(SBUF,))
    I.same_partitions([("dst", gd), ("on_true_tile", gt)])
    I.same_free([("dst", gd), ("on_true_tile", gt)])
    if not is_scalar(on_false_value):
        raise I.fail(f"on_false_value must be a float32 scalar, got {type(on_false_value).__name__}", "dtype")
    I.align([("on_true_tile", gt)], ("dst", gd))
    vals = _pattern_values(I, pattern, gd.partitions, gd.free_elems, offset, channel_multiplier)
    if I.data:
        pred = spec.alu(vals.astype(np.float64), np.float64(0.0)) != 0
        if on_true_tile.dtype is dst.dtype and not dst.dtype.is_packed:
            # same dtype: selected elements are moved bit-exactly (the FP32 cast only happens when the dtypes
            # differ), so int32 values above 2^24 survive; the fp32 on_false_value is converted to dst's dtype
            false_val = dt.cast_to(np.full((1, 1), on_false_value, dtype=np.float32), dst.dtype)
            store(I, dst, np.where(pred, raw2(I, on_true_tile), false_val))
        else:
            store(I, dst, np.where(pred, flat2(I, on_true_tile), np.float32(on_false_value)))
    I.record("affine_select", "gpsimd", gd.partitions, gd.free_elems, dst.dtype.name, name_arg(name))


__all__ = [
    "affine_select",
    "iota",
    "memset",
    "reciprocal",
    "scalar_tensor_tensor",
    "tensor_copy",
    "tensor_copy_predicated",
    "tensor_scalar",
    "tensor_tensor",
]
