"""Activation and reduction instructions: activation, activation_reduce, exponential, tensor_reduce,
tensor_scalar_reduce, tensor_partition_reduce.

ScalarE ``activation`` computes ``op(data * scale + bias)`` in float32 and can reduce (``nl.add``) along the
free axes into 128 per-lane accumulator registers that persist between instructions (``reduce_cmd``);
``reduce_res`` reads the registers out (profiled as one extra instruction).  VectorE ``exponential`` (trn3
only) has its own accumulators (shared with select_reduce/range_select/tensor_scalar_cumulative).
Inputs outside an activation function's documented Valid Input Range raise (rule ``activation-range``).
"""

from __future__ import annotations

import numpy as np

from . import dtypes as dt
from .checks import PSUM, Instr
from .enums import reduce_cmd, require_enum
from .isa_common import (
    act_op,
    alu_op,
    flat2,
    is_scalar,
    mark_written,
    name_arg,
    operand_values,
    raw2,
    reduce_op as reduce_op_spec,
    require_int,
    scalar_or_vector,
    store,
)
from .tensor import NkiTensor

_RC = reduce_cmd


def _regs(I: Instr, which: str, start: int, n: int) -> np.ndarray:
    regs = I.ctx.act_regs if which == "act" else I.ctx.vec_regs
    return regs[start : start + n]


def _bias_scale(I: Instr, bias, scale, P: int, inputs: list) -> None:
    g = scalar_or_vector(I, scale, "scale", P, require_fp32=True)
    if g is not None:
        inputs.append(("scale", g))
    if bias is not None:
        if isinstance(bias, NkiTensor):
            gb = I.per_partition_vector(bias, "bias", P)
            if bias.dtype is dt.tfloat32:
                raise I.fail("bias cannot be tfloat32", "dtype")
            inputs.append(("bias", gb))
        elif not is_scalar(bias):
            raise I.fail(f"bias must be None, a scalar or a [{P}, 1] tensor, got {type(bias).__name__}", "shape")


def _activate(I: Instr, spec, data, bias, scale, P: int) -> np.ndarray:
    x = flat2(I, data)
    s = operand_values(I, scale, P)
    x = x * s
    if bias is not None:
        x = x + operand_values(I, bias, P)
    x = x.astype(np.float32)
    check_valid_range(I, spec, x)
    return spec.act(x)


def check_valid_range(I: Instr, spec, x: np.ndarray) -> None:
    """Raise (rule ``activation-range``) when an activation input leaves the function's documented Valid Input
    Range: the ScalarE piecewise-polynomial approximation "will generate invalid output results" there
    (nki.api.shared.rst), so an exact result would hide a kernel that is wrong on hardware.  NaN inputs are not
    flagged (they propagate as NaN either way)."""
    if spec.valid is None:
        return
    lo, hi = (np.float32(v) for v in spec.valid)
    v = np.abs(x) if spec.valid_abs else x
    bad = (v < lo) | (v > hi)
    if not bad.any():
        return
    p, j = (int(i) for i in np.argwhere(bad)[0])
    raise I.fail(
        f"nl.{spec.name} input {float(x[p, j])!r} (data * scale + bias at partition {p}, element {j}; "
        f"{int(bad.sum())} element(s) in all) is outside its valid input range {spec.valid_text}; the Scalar "
        f"Engine generates invalid output there (nki.api.shared.rst, Supported Activation Functions)",
        "activation-range",
    )


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle,
               name=None):
    """dst = op(data * scale + bias) on the Scalar Engine, with optional free-axis add-reduction."""
    I = Instr("nisa.activation")
    spec = act_op(I, op, "op")
    cmd = require_enum(reduce_cmd, _RC, "reduce_cmd", I.name)
    gd = I.onchip(dst, "dst")
    g = I.onchip(data, "data")
    I.same_partitions([("dst", gd), ("data", g)])
    I.same_free([("dst", gd), ("data", g)])
    P = g.partitions
    inputs = [("data", g)]
    _bias_scale(I, bias, scale, P, inputs)
    if reduce_op is not None:
        reduce_op_spec(I, reduce_op, "reduce_op", allowed=("add",))
    if cmd is _RC.load_reduce:
        raise I.fail("reduce_cmd.load_reduce is not supported by activation", "op")
    if cmd in (_RC.reduce, _RC.reset_reduce) and reduce_op is None:
        raise I.fail(f"reduce_cmd={cmd} needs reduce_op=nl.add", "op")
    gr = None
    if reduce_res is not None:
        gr = I.per_partition_vector(reduce_res, "reduce_res", P)
    I.align(inputs, ("dst", gd))
    if I.data:
        out = _activate(I, spec, data, bias, scale, P)
        store(I, dst, out)
        regs = _regs(I, "act", g.start_partition, P)
        if cmd in (_RC.reset, _RC.reset_reduce):
            regs[...] = 0.0
        if cmd in (_RC.reduce, _RC.reset_reduce):
            regs += out.sum(axis=1, dtype=np.float32)
        if reduce_res is not None:
            store(I, reduce_res, regs.reshape(P, 1))
    mark_written(dst)
    I.record("activation", "scalar", P, g.free_elems, dst.dtype.name, name_arg(name))
    if gr is not None:
        mark_written(reduce_res)
        I.record("activation_read_reduce", "scalar", P, 1, reduce_res.dtype.name, name_arg(name))


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """activation() followed by a reset-and-reduce of the free axes into reduce_res."""
    I = Instr("nisa.activation_reduce")
    spec = act_op(I, op, "op")
    rspec = reduce_op_spec(I, reduce_op, "reduce_op", allowed=("add", "maximum", "minimum"))
    gd = I.onchip(dst, "dst")
    g = I.onchip(data, "data")
    I.same_partitions([("dst", gd), ("data", g)])
    I.same_free([("dst", gd), ("data", g)])
    P = g.partitions
    inputs = [("data", g)]
    _bias_scale(I, bias, scale, P, inputs)
    I.per_partition_vector(reduce_res, "reduce_res", P)
    I.align(inputs, ("dst", gd))
    if I.data:
        out = _activate(I, spec, data, bias, scale, P)
        store(I, dst, out)
        red = rspec.reduce(out, 1).astype(np.float32)
        _regs(I, "act", g.start_partition, P)[...] = red
        store(I, reduce_res, red.reshape(P, 1))
    mark_written(dst)
    mark_written(reduce_res)
    I.record("activation_reduce", "scalar", P, g.free_elems, dst.dtype.name, name_arg(name))


def exponential(dst, src, max_value=0.0, reduce_res=None, reduce_cmd=reduce_cmd.idle, reduce_init=0.0, name=None):
    """dst = exp(src - max_value) on the Vector Engine with an optional running sum (trn3 only)."""
    I = Instr("nisa.exponential")
    t = I.ctx.target
    if not t.supports_exponential:
        raise I.fail(f"nisa.exponential is only available on NeuronCore-v4 (trn3), target is {t.name}", "target")
    cmd = require_enum(reduce_cmd, _RC, "reduce_cmd", I.name)
    if cmd is _RC.reset:
        raise I.fail("reduce_cmd.reset is not supported by exponential", "op")
    if cmd is not _RC.load_reduce and reduce_init != 0.0:
        raise I.fail("reduce_init must be 0.0 unless reduce_cmd is load_reduce", "op")
    gd = I.onchip(dst, "dst")
    g = I.onchip(src, "src")
    I.same_partitions([("dst", gd), ("src", g)])
    I.same_free([("dst", gd), ("src", g)])
    P = g.partitions
    inputs = [("src", g)]
    gm = scalar_or_vector(I, max_value, "max_value", P, require_fp32=True)
    if gm is not None:
        inputs.append(("max_value", gm))
    if reduce_res is not None:
        I.per_partition_vector(reduce_res, "reduce_res", P)
    I.align(inputs, ("dst", gd))
    if I.data:
        out = np.exp(flat2(I, src) - operand_values(I, max_value, P)).astype(np.float32)
        store(I, dst, out)
        regs = _regs(I, "vec", g.start_partition, P)
        if cmd is _RC.reset_reduce:
            regs[...] = 0.0
        elif cmd is _RC.load_reduce:
            regs[...] = np.float32(reduce_init)
        if cmd is not _RC.idle:
            regs += out.sum(axis=1, dtype=np.float32)
        if reduce_res is not None:
            store(I, reduce_res, regs.reshape(P, 1))
    mark_written(dst)
    if reduce_res is not None:
        mark_written(reduce_res)
    I.record("exponential", "vector", P, g.free_elems, dst.dtype.name, name_arg(name))


def _reduce_axes(I: Instr, data: NkiTensor, axis) -> tuple[int, ...]:
    if isinstance(axis, (int, np.integer)):
        axes = (int(axis),)
    elif isinstance(axis, (tuple, list)) and axis:
        axes = tuple(int(a) for a in axis)
    else:
        raise I.fail(f"axis must be an int or a non-empty tuple/list of ints, got {axis!r}", "shape")
    nd = len(data.shape)
    norm = tuple(sorted(a + nd if a < 0 else a for a in axes))
    if 0 in norm:
        raise I.fail("axis 0 (the partition axis) cannot be reduced", "shape")
    if norm != tuple(range(norm[0], nd)) or norm[0] < 1:
        raise I.fail(
            f"axis={axis!r} must be the last contiguous free dims ending at the final dim of a tile of shape "
            f"{data.shape} (NKI 0.3 uses real axis indices)",
            "shape",
        )
    return norm


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """Reduce the last free axes of data with op (Vector Engine); negate multiplies the result by -1.

    ``keepdims`` only changes the logical dst shape; dst is validated by its element count per partition."""
    I = Instr("nisa.tensor_reduce")
    spec = reduce_op_spec(I, op, "op")
    gd = I.onchip(dst, "dst")
    g = I.onchip(data, "data")
    I.same_partitions([("dst", gd), ("data", g)])
    axes = _reduce_axes(I, data, axis)
    kept = 1
    for i, n in enumerate(data.shape):
        if i > 0 and i not in axes:
            kept *= n
    if gd.free_elems != kept:
        raise I.fail(
            f"dst has {gd.free_elems} elements per partition but reducing axes {axes} of {data.shape} leaves {kept}",
            "shape",
        )
    if spec.bitvec:
        if negate:
            raise I.fail("negate is only applicable to arithmetic operators", "op")
        require_int(I, data, "data", f"bitvec operator nl.{spec.name}")
        require_int(I, dst, "dst", f"bitvec operator nl.{spec.name}")
    I.align([("data", g)], ("dst", gd))
    if I.data:
        P = g.partitions
        if spec.bitvec:
            vals = np.asarray(raw2(I, data)).reshape(data.shape).astype(np.int64)
            red = spec.reduce(vals.reshape(P, kept, -1), 2)
            store(I, dst, red.astype(np.int64))
        else:
            vals = flat2(I, data).reshape(P, kept, -1)
            red = spec.reduce(vals, 2).astype(np.float32)
            if negate:
                red = -red
            store(I, dst, red)
    mark_written(dst)
    I.record("tensor_reduce", "vector", g.partitions, g.free_elems, dst.dtype.name, name_arg(name))


def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res, reverse0=False, name=None):
    """dst = data <op0> operand0 and reduce_res = reduce_op(dst) along the free axes (Vector Engine)."""
    I = Instr("nisa.tensor_scalar_reduce")
    s0 = alu_op(I, op0, "op0", allow_bitvec=False)
    rspec = reduce_op_spec(I, reduce_op, "reduce_op", allowed=("add", "subtract", "multiply", "maximum", "minimum"))
    if reverse0:
        raise I.fail("reverse0 is not supported yet by tensor_scalar_reduce (SDK 2.29)", "op")
    gd = I.onchip(dst, "dst")
    g = I.onchip(data, "data")
    I.same_partitions([("dst", gd), ("data", g)])
    I.same_free([("dst", gd), ("data", g)])
    P = g.partitions
    inputs = [("data", g)]
    go = scalar_or_vector(I, operand0, "operand0", P, require_fp32=True)
    if go is not None:
        inputs.append(("operand0", go))
    I.per_partition_vector(reduce_res, "reduce_res", P)
    I.align(inputs, ("dst", gd))
    if I.data:
        res = s0.alu(flat2(I, data), operand_values(I, operand0, P))
        store(I, dst, res)
        store(I, reduce_res, rspec.reduce(np.asarray(res, dtype=np.float32), 1).reshape(P, 1))
    mark_written(dst)
    mark_written(reduce_res)
    I.record("tensor_scalar_reduce", "vector", P, g.free_elems, dst.dtype.name, name_arg(name))


_PARTITION_REDUCE_OPS = ("add", "maximum", "bitwise_or", "bitwise_and")


def tensor_partition_reduce(dst, op, data, name=None):
    """dst[0, f] = op over partitions p of data[p, f] (GpSimd Engine).

    The 2.29 docstring: "Apply a reduction operation across partitions of an input data tile using GpSimd Engine",
    op one of add, max, bitwise_or, bitwise_and; its SDK example reduces a ``(128, 32, 4)`` tile into ``(1, 32, 4)``.
    So dst has one partition and data's free elements; GpSimd cannot access PSUM.  Arithmetic reduces in float32
    (cast to dst on write), bitvec operators on integer bit patterns, like ``tensor_reduce``."""
    I = Instr("nisa.tensor_partition_reduce")
    spec = reduce_op_spec(I, op, "op", allowed=_PARTITION_REDUCE_OPS)
    for arg, t in (("dst", dst), ("data", data)):
        if isinstance(t, NkiTensor) and t.buffer is PSUM:
            raise I.fail(f"{arg} is in PSUM but the GpSimd engine cannot access PSUM", "engine")
    gd = I.onchip(dst, "dst")
    g = I.onchip(data, "data")
    if gd.partitions != 1:
        raise I.fail(f"dst must have one partition (the reduction result), got {gd.partitions}", "shape")
    I.same_free([("dst", gd), ("data", g)])
    if spec.bitvec:
        require_int(I, data, "data", f"bitvec operator nl.{spec.name}")
        require_int(I, dst, "dst", f"bitvec operator nl.{spec.name}")
    if I.data:
        P = g.partitions
        if spec.bitvec:
            vals = np.asarray(raw2(I, data)).astype(np.int64)
            store(I, dst, spec.reduce(vals, 0).reshape(1, -1).astype(np.int64))
        else:
            store(I, dst, spec.reduce(flat2(I, data).reshape(P, -1), 0).reshape(1, -1).astype(np.float32))
    mark_written(dst)
    I.record("tensor_partition_reduce", "gpsimd", g.partitions, g.free_elems, dst.dtype.name, name_arg(name))
