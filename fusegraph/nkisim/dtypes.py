"""NKI data types: names, storage formats and rounding.

In NKI 0.3 dtypes are strings (``nl.bfloat16 == 'bfloat16'``).  :class:`DType` is a ``str`` subclass so that
kernels comparing ``t.dtype == nl.float32`` keep working, and it also compares equal to the matching NumPy
dtype / scalar type (``t.dtype == np.float32``), because kernels written against ``nki.simulate`` do both.

Storage: low-precision float types are stored with ``ml_dtypes`` (real bf16/fp8 bits, like the simulator's
``NKI_PRECISE_FP=1``); engines compute in float32 and round on write.  Special cases:

* ``float8_e4m3`` (the legacy NKI fp8 with max 240) is stored as ``ml_dtypes.float8_e4m3`` (IEEE-style
  e4m3: bias 7, max 240, has inf/nan) — the same value set as NKI's legacy type.
* ``tfloat32`` is stored as float32 with the mantissa rounded to 10 bits (round-to-nearest-even) on write.
* ``bool_`` is stored as uint8 (0/1).
* the x4 packed types (``float8_e4m3fn_x4``, ``float8_e5m2_x4``, ``float4_e2m1fn_x4``) are stored as raw 32-bit
  words: they can be moved (DMA, same-dtype copies, memset 0) but not computed on.
* float -> integer conversion rounds to nearest even and saturates to the integer range (the hardware
  rounding mode is not documented publicly; see docs/interpreter.md).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .errors import NkiValidationError


class DType(str):
    """An NKI dtype name carrying its storage format."""

    np: np.dtype  # storage dtype
    itemsize: int
    is_float: bool
    is_int: bool
    is_packed: bool
    bits: int

    def __new__(cls, name: str, storage: Any, *, is_float: bool, is_int: bool, is_packed: bool = False):
        obj = super().__new__(cls, name)
        obj.np = np.dtype(storage)
        obj.itemsize = obj.np.itemsize
        obj.is_float = is_float
        obj.is_int = is_int
        obj.is_packed = is_packed
        obj.bits = obj.itemsize * 8
        return obj

    @property
    def name(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"nl.{'bool_' if self.name == 'bool' else self.name}"

    def __eq__(self, other: object) -> bool:  # noqa: D105
        if isinstance(other, str):
            return str.__eq__(self, other) or (other == "bool_" and self.name == "bool")
        try:
            return _canonical(other) is self
        except (TypeError, NkiValidationError):
            return False

    def __ne__(self, other: object) -> bool:  # noqa: D105
        return not self.__eq__(other)

    __hash__ = str.__hash__

    def __reduce__(self):
        return (get, (self.name,))


bool_ = DType("bool", np.uint8, is_float=False, is_int=True)
int8 = DType("int8", np.int8, is_float=False, is_int=True)
int16 = DType("int16", np.int16, is_float=False, is_int=True)
int32 = DType("int32", np.int32, is_float=False, is_int=True)
uint8 = DType("uint8", np.uint8, is_float=False, is_int=True)
uint16 = DType("uint16", np.uint16, is_float=False, is_int=True)
uint32 = DType("uint32", np.uint32, is_float=False, is_int=True)
float16 = DType("float16", np.float16, is_float=True, is_int=False)
bfloat16 = DType("bfloat16", ml_dtypes.bfloat16, is_float=True, is_int=False)
tfloat32 = DType("tfloat32", np.float32, is_float=True, is_int=False)
float32 = DType("float32", np.float32, is_float=True, is_int=False)
float8_e4m3 = DType("float8_e4m3", ml_dtypes.float8_e4m3, is_float=True, is_int=False)
float8_e4m3fn = DType("float8_e4m3fn", ml_dtypes.float8_e4m3fn, is_float=True, is_int=False)
float8_e5m2 = DType("float8_e5m2", ml_dtypes.float8_e5m2, is_float=True, is_int=False)
float8_e4m3fn_x4 = DType("float8_e4m3fn_x4", np.uint32, is_float=False, is_int=False, is_packed=True)
float8_e5m2_x4 = DType("float8_e5m2_x4", np.uint32, is_float=False, is_int=False, is_packed=True)
float4_e2m1fn_x4 = DType("float4_e2m1fn_x4", np.uint32, is_float=False, is_int=False, is_packed=True)

ALL: dict[str, DType] = {
    d.name: d
    for d in (
        bool_,
        int8,
        int16,
        int32,
        uint8,
        uint16,
        uint32,
        float16,
        bfloat16,
        tfloat32,
        float32,
        float8_e4m3,
        float8_e4m3fn,
        float8_e5m2,
        float8_e4m3fn_x4,
        float8_e5m2_x4,
        float4_e2m1fn_x4,
    )
}
ALIASES: dict[str, DType] = {"bool_": bool_, "float": float32, "fp32": float32, "bf16": bfloat16, "fp16": float16}

_FROM_NUMPY: dict[np.dtype, DType] = {
    np.dtype(np.bool_): bool_,
    np.dtype(np.int8): int8,
    np.dtype(np.int16): int16,
    np.dtype(np.int32): int32,
    np.dtype(np.uint8): uint8,
    np.dtype(np.uint16): uint16,
    np.dtype(np.uint32): uint32,
    np.dtype(np.float16): float16,
    np.dtype(np.float32): float32,
    np.dtype(ml_dtypes.bfloat16): bfloat16,
    np.dtype(ml_dtypes.float8_e4m3): float8_e4m3,
    np.dtype(ml_dtypes.float8_e4m3fn): float8_e4m3fn,
    np.dtype(ml_dtypes.float8_e5m2): float8_e5m2,
}


def _canonical(x: Any) -> DType:
    if isinstance(x, DType):
        return x
    if isinstance(x, str):
        d = ALL.get(x) or ALIASES.get(x)
        if d is None:
            raise NkiValidationError(f"{x!r} is not an NKI dtype", rule="dtype")
        return d
    try:
        npd = np.dtype(x)
    except TypeError:
        npd = None
    if npd is not None and npd in _FROM_NUMPY:
        return _FROM_NUMPY[npd]
    torch_name = _torch_dtype_name(x)
    if torch_name is not None:
        return _canonical(torch_name)
    raise NkiValidationError(f"{x!r} is not an NKI dtype", rule="dtype")


def _torch_dtype_name(x: Any) -> str | None:
    mod = type(x).__module__
    if mod != "torch":
        return None
    name = str(x).replace("torch.", "")
    return {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16", "int32": "int32",
            "int16": "int16", "int8": "int8", "uint8": "uint8", "bool": "bool",
            "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}.get(name)


def get(x: Any) -> DType:
    """Canonical :class:`DType` for an NKI dtype name, numpy dtype/type, ml_dtypes type or torch dtype.

    Raises NkiValidationError (rule ``dtype``) for types NKI does not have (float64, int64, ...)."""
    return _canonical(x)


def is_fp32_like(d: DType) -> bool:
    return d is float32 or d is tfloat32


_F32_MANT_MASK = np.uint32(0xFFFFE000)


def round_tf32(values: np.ndarray) -> np.ndarray:
    """Round float32 values to tfloat32 precision (10 mantissa bits, round to nearest even)."""
    v = np.ascontiguousarray(values, dtype=np.float32)
    bits = v.view(np.uint32)
    finite = np.isfinite(v)
    lsb = (bits >> np.uint32(13)) & np.uint32(1)
    rounded = ((bits + np.uint32(0x0FFF) + lsb) & _F32_MANT_MASK).view(np.float32)
    return np.where(finite, rounded, v)


def cast_to(values: np.ndarray, d: DType) -> np.ndarray:
    """Convert float32 (or integer) computation results to the storage format of ``d`` (round on write)."""
    if d.is_packed:
        raise NkiValidationError(f"cannot compute into packed dtype {d.name}", rule="dtype")
    if d is tfloat32:
        return round_tf32(values)
    if d.is_int:
        vals = np.asarray(values)
        if vals.dtype.kind == "f":
            info = np.iinfo(d.np)
            vals = np.clip(np.nan_to_num(np.rint(vals), nan=0.0), info.min, info.max)
        return vals.astype(d.np)
    return np.asarray(values).astype(d.np)


def to_f32(values: np.ndarray) -> np.ndarray:
    """Engine input conversion: everything is computed in float32."""
    if values.dtype == np.float32:
        return values
    return values.astype(np.float32)
