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


def promote(a: DType, b: DType) -> DType:
    """Result dtype of an arithmetic ``nl.*`` call on tiles of dtypes ``a`` and ``b`` (order-independent).

    The "NKI Type Promotion" table (nki.api.shared.rst until aws-neuron-sdk db1586c3; the 2.29 ``nl`` docstrings
    still refer to it): (float, int) -> the float; (float, float) -> the wider float, or a widened type that fits
    both ranges: fp16 + bf16 -> fp32, two different fp8 -> bf16, fp8 + fp16/bf16 -> the 16-bit type, tf32 beats
    the 16-bit types; (int, int) -> the wider int, mixed signedness widens to the next signed type (int8 + uint8
    -> int16, int8/int16 + uint16 -> int32) and int32 + uint32 (or any signed + uint32) -> fp32 (no int64)."""
    if a is b:
        return a
    if a.is_packed or b.is_packed:
        raise NkiValidationError(f"cannot compute on packed dtypes {a.name} and {b.name}", rule="dtype")
    if a.is_float != b.is_float:
        return a if a.is_float else b
    if a.is_float:
        return _promote_float(a, b)
    return _promote_int(a, b)


def _promote_float(a: DType, b: DType) -> DType:
    rank = {"float32": 4, "tfloat32": 3, "float16": 2, "bfloat16": 2}
    ra, rb = rank.get(a.name, 1), rank.get(b.name, 1)  # fp8 types rank 1
    if ra != rb:
        return a if ra > rb else b
    if ra == 2:  # fp16 vs bf16: neither holds the other's range/precision
        return float32
    return bfloat16  # two different fp8 formats


def _promote_int(a: DType, b: DType) -> DType:
    sa, sb = a.name.startswith("int"), b.name.startswith("int")  # bool_ counts as uint8
    if sa == sb:
        return a if a.itemsize >= b.itemsize else b
    signed, unsigned = (a, b) if sa else (b, a)
    if signed.itemsize > unsigned.itemsize:
        return signed
    return {1: int16, 2: int32}.get(unsigned.itemsize, float32)


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
            return float_to_int(vals, d)
        return vals.astype(d.np)
    return np.asarray(values).astype(d.np)


def float_to_int(values: np.ndarray, d: DType) -> np.ndarray:
    """Round to nearest even and saturate float values into integer dtype ``d`` (NaN -> 0).

    Clipping happens in float64: in float32 the bound ``2**31 - 1`` rounds up to ``2**31`` (and ``2**32 - 1`` to
    ``2**32``), whose conversion wraps to INT_MIN / 0, so large values and +inf used to come out negative."""
    info = np.iinfo(d.np)
    v = np.rint(np.asarray(values, dtype=np.float64))
    v = np.nan_to_num(v, nan=0.0, posinf=float(info.max), neginf=float(info.min))
    return np.clip(v, float(info.min), float(info.max)).astype(d.np)


def to_f32(values: np.ndarray) -> np.ndarray:
    """Engine input conversion: everything is computed in float32."""
    if values.dtype == np.float32:
        return values
    return values.astype(np.float32)
