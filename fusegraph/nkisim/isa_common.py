"""Helpers shared by the ISA instruction implementations (operator tokens, engines, operands, PSUM state)."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import access
from . import dtypes as dt
from .checks import PSUM, Instr
from .context import maybe_current
from .enums import MemoryRegion, engine, require_enum
from .opsdef import OpSpec, spec_of
from .storage import PSUM_MATMUL, PSUM_OTHER
from .tensor import NkiTensor

ENGINE_NAMES = {
    engine.tensor: "tensor",
    engine.vector: "vector",
    engine.scalar: "scalar",
    engine.gpsimd: "gpsimd",
    engine.dma: "dma",
    engine.sync: "dma",
}


def alu_op(I: Instr, op: Any, arg: str, *, allow_unary: bool = True, allow_bitvec: bool = True) -> OpSpec:
    spec = spec_of(op)
    if spec is None:
        if isinstance(op, (int, str)):
            raise I.fail(
                f"{arg} must be an nki.language operator function (e.g. nl.add), got {op!r}; raw ints/strings are "
                f"rejected since SDK 2.29",
                "enum-arg",
            )
        if getattr(op, "__module__", "") == "nki.language":
            raise I.fail(f"{arg}=nl.{op.__name__} is not an ALU operator of the ISA (see the nki-aluop table)", "op")
        raise I.fail(f"{arg} must be an nki.language operator function (e.g. nl.add), got {op!r}", "op")
    if spec.alu is None:
        raise I.fail(f"{arg}=nl.{spec.name} is not an ALU operator of the ISA (see the nki-aluop table)", "op")
    if spec.unary and not allow_unary:
        raise I.fail(f"{arg}=nl.{spec.name} is a unary operator; a binary operator is required here", "op")
    if spec.bitvec and not allow_bitvec:
        raise I.fail(f"{arg}=nl.{spec.name} is a bitvec operator; only arithmetic operators are allowed here", "op")
    return spec


def act_op(I: Instr, op: Any, arg: str) -> OpSpec:
    spec = spec_of(op)
    if spec is None:
        if isinstance(op, (int, str)):
            raise I.fail(
                f"{arg} must be an activation function object (e.g. nl.exp), got {op!r}; raw ints/strings are "
                f"rejected since SDK 2.29",
                "enum-arg",
            )
        if getattr(op, "__module__", "") == "nki.language":
            raise I.fail(f"{arg}=nl.{op.__name__} is not an activation function of the ScalarE table", "op")
        raise I.fail(f"{arg} must be an activation function (e.g. nl.exp), got {op!r}", "op")
    if spec.act is None:
        raise I.fail(f"{arg}=nl.{spec.name} is not an activation function of the ScalarE table", "op")
    return spec


def reduce_op(I: Instr, op: Any, arg: str, allowed: tuple[str, ...] | None = None) -> OpSpec:
    spec = alu_op(I, op, arg)
    if spec.reduce is None:
        raise I.fail(f"{arg}=nl.{spec.name} is not a legal reduction operator", "op")
    if allowed is not None and spec.name not in allowed:
        raise I.fail(
            f"{arg}=nl.{spec.name} is not supported here (allowed: {', '.join('nl.' + a for a in allowed)})", "op"
        )
    return spec


def pick_engine(I: Instr, value: Any, allowed: tuple[engine, ...], default: engine) -> engine:
    e = require_enum(value, engine, "engine", I.name)
    if e is engine.unknown:
        return default
    if e not in allowed:
        raise I.fail(
            f"engine={e} is not allowed (allowed: {', '.join(str(a) for a in allowed)})", "engine"
        )
    return e


def no_psum_on_gpsimd(I: Instr, e: engine, tensors: list[tuple[str, Any]]) -> None:
    if e is not engine.gpsimd:
        return
    for arg, t in tensors:
        if isinstance(t, NkiTensor) and t.buffer is PSUM:
            raise I.fail(f"{arg} is in PSUM but the GpSimd engine cannot access PSUM", "engine")


def is_scalar(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def scalar_or_vector(I: Instr, x: Any, arg: str, partitions: int, *, require_fp32: bool = True):
    """An immediate scalar or a ``[P, 1]`` tensor operand; returns (geometry or None)."""
    if is_scalar(x):
        return None
    if isinstance(x, NkiTensor):
        g = I.per_partition_vector(x, arg, partitions)
        if require_fp32 and x.dtype is not dt.float32:
            raise I.fail(f"{arg} must be float32 when it is a tensor, got {x.dtype.name}", "dtype")
        return g
    raise I.fail(f"{arg} must be a scalar constant or a [{partitions}, 1] tensor, got {type(x).__name__}", "shape")


def operand_values(I: Instr, x: Any, partitions: int) -> np.ndarray | float:
    """Data-mode value of a scalar/vector operand, broadcastable against ``[P, F]``."""
    if isinstance(x, NkiTensor):
        return access.read_f32(I.ctx, x).reshape(partitions, 1)
    return np.float32(x)


def flat2(I: Instr, t: NkiTensor) -> np.ndarray:
    """float32 values of a view as ``[partitions, elements per partition]``."""
    v = access.read_f32(I.ctx, t)
    return v.reshape(t.shape[0], -1) if t.shape else v.reshape(1, 1)


def raw2(I: Instr, t: NkiTensor) -> np.ndarray:
    v = access.read(I.ctx, t)
    return v.reshape(t.shape[0], -1)


def store(I: Instr, t: NkiTensor, values: np.ndarray) -> None:
    access.write(I.ctx, t, np.asarray(values).reshape(t.shape))


def bits_u64(a: np.ndarray, d: dt.DType) -> np.ndarray:
    """Bit pattern of integer values as uint64 (masked to the dtype width)."""
    mask = (1 << d.bits) - 1
    return a.astype(np.int64).astype(np.uint64) & np.uint64(mask)


def from_bits(bits: np.ndarray, d: dt.DType) -> np.ndarray:
    mask = np.uint64((1 << d.bits) - 1)
    u = (bits & mask).astype({8: np.uint8, 16: np.uint16, 32: np.uint32}[d.bits])
    return u.view(d.np)


def require_int(I: Instr, t: NkiTensor, arg: str, why: str) -> None:
    if not t.dtype.is_int:
        raise I.fail(f"{arg} must have an integer dtype for {why}, got {t.dtype.name}", "dtype")


# ------------------------------------------------------------------------------------- PSUM state


def psum_state_view(t: NkiTensor) -> np.ndarray:
    st = t._st
    state = st.ensure_psum_state()
    isz = t.dtype.itemsize
    return np.ndarray(
        t.shape + (isz,),
        dtype=np.uint8,
        buffer=state,
        offset=t._offset * isz,
        strides=tuple(s * isz for s in t._strides) + (1,),
    )


def mark_written(t: NkiTensor, by_matmul: bool = False) -> None:
    """Record that an instruction wrote ``t`` (PSUM only): resets the matmul accumulation state."""
    if t._st.buffer is not MemoryRegion.psum:
        return
    if t._ind is not None:  # a runtime-offset operand: mark what the running instruction resolved
        t = access.cached_engine_view(maybe_current(), t)
        if t is None:
            return
    psum_state_view(t)[...] = PSUM_MATMUL if by_matmul else PSUM_OTHER


def name_arg(name: Any) -> str | None:
    return name if isinstance(name, str) and name else None
