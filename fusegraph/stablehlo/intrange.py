"""XLA's integer semantics on the importer's PyTorch ops: value ranges, wrapping and the guarded ops.

StableHLO ``i32`` values compute as PyTorch ``int64`` (what PyTorch indexes with and what the patterns expect),
so an ``i32`` add, subtract or multiply does not wrap at 32 bits the way XLA's does. Those ops (and negate,
the bitwise ops, data movement) only need the low 32 bits of their operands to give the low 32 bits of their
result, so a wide value (an ``int64`` outside the int32 range) stays correct modulo 2**32 through them; every
other consumer (compare, divide, remainder, max/min, clamp, converts to float or wider types, indices) needs
the wrapped value. The importer keeps an interval of the ``int64`` values each integer value can hold and
wraps a value (``((x + 2**31) & (2**32 - 1)) - 2**31``) only where such a consumer reads one that may be
outside the int32 range; results go back to JAX as int32, which wraps them too. Native PyTorch integer types
(``i8``, ``i16``, ``i64``, ``ui8``) wrap by themselves.

The interval also says where a division needs XLA's guards (``x / 0 == -1``, ``x % 0 == x``,
``INT64_MIN / -1 == INT64_MIN``, which PyTorch raises on or crashes with ``SIGFPE``), so index arithmetic that
cannot overflow (JAX's ``select(i < 0, i + n, i)`` wrap of a negative index, dividing by a nonzero constant)
gets no extra ops.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .ir import Op, TensorType, Value

Range = tuple[int, int]

I64 = (-2 ** 63, 2 ** 63 - 1)
I32 = (-2 ** 31, 2 ** 31 - 1)
LIMITS: dict[str, Range] = {
    "i8": (-2 ** 7, 2 ** 7 - 1), "i16": (-2 ** 15, 2 ** 15 - 1), "i32": I32, "i64": I64,
    "ui8": (0, 2 ** 8 - 1), "ui16": (0, 2 ** 16 - 1), "ui32": (0, 2 ** 32 - 1), "ui64": (0, 2 ** 64 - 1),
}

#: ops whose result's low 32 bits only depend on their operands' low 32 bits (ring operations, bitwise ops and
#: data movement): an ``i32`` operand may be wide there. Value: the operand positions that may be wide.
_ALL = None
_PASS: dict[str, tuple[int, ...] | None] = {
    "stablehlo.add": _ALL, "stablehlo.subtract": _ALL, "stablehlo.multiply": _ALL, "stablehlo.negate": _ALL,
    "stablehlo.and": _ALL, "stablehlo.or": _ALL, "stablehlo.xor": _ALL, "stablehlo.not": _ALL,
    "stablehlo.select": (1, 2), "stablehlo.broadcast_in_dim": _ALL, "stablehlo.reshape": _ALL,
    "stablehlo.transpose": _ALL, "stablehlo.slice": _ALL, "stablehlo.reverse": _ALL,
    "stablehlo.concatenate": _ALL, "stablehlo.pad": _ALL, "stablehlo.optimization_barrier": _ALL,
    "func.call": _ALL, "stablehlo.composite": _ALL, "stablehlo.dot_general": _ALL,
    "stablehlo.dynamic_update_slice": (0, 1), "stablehlo.dynamic_slice": (0,), "stablehlo.gather": (0,),
    "stablehlo.scatter": (0, 2),  # values written (replaced or added): their low 32 bits suffice
}

_SAME_AS_FIRST = ("stablehlo.broadcast_in_dim", "stablehlo.reshape", "stablehlo.transpose", "stablehlo.slice",
                  "stablehlo.reverse", "stablehlo.dynamic_slice", "stablehlo.gather")
_UNION = ("stablehlo.pad", "stablehlo.dynamic_update_slice")  # the operand and the value written


def limits(dtype: str) -> Range | None:
    """The value range of an integer element type (``None`` for floats and ``i1``)."""
    return LIMITS.get(dtype)


def type_range(t: TensorType) -> Range | None:
    return limits(t.dtype)


def is_wide(v: Value, r: Range | None) -> bool:
    """May the ``int64`` tensor of this ``i32`` value hold numbers outside the int32 range?"""
    return v.type.dtype == "i32" and r is not None and (r[0] < I32[0] or r[1] > I32[1])


def may_be_wide(op: Op, index: int) -> bool:
    """May operand ``index`` of ``op`` be read wide (the op only depends on its low 32 bits)?"""
    if op.name == "stablehlo.convert":  # truncating to a narrower integer type keeps the low bits
        out = op.result.type.dtype
        return out in ("i8", "i16", "i32", "ui8")
    if op.name == "stablehlo.reduce":
        return _reduce_kind(op) in ("sum", "prod")
    if op.name not in _PASS:
        return False
    which = _PASS[op.name]
    return which is None or index in which


def wrap_i32(t: torch.Tensor) -> torch.Tensor:
    """The int32 value (two's complement wrap) of an ``int64`` tensor, still as ``int64``."""
    return ((t + 2 ** 31) & (2 ** 32 - 1)) - 2 ** 31


def _clip(op: Op, v: Value, lo: int, hi: int) -> Range:
    """An interval of the values the result's tensor holds: ``i32`` keeps its ``int64`` interval (wide values are
    allowed, see the module docstring), a native type wraps by itself (its whole range)."""
    full = type_range(v.type)
    if v.type.dtype == "i32":
        return (lo, hi) if I64[0] <= lo and hi <= I64[1] else I64
    if full is None:
        return (lo, hi)
    return (lo, hi) if full[0] <= lo and hi <= full[1] else full


def _scatter_replaces(op: Op) -> bool:
    """A scatter whose update computation returns the update (``x.at[i].set(v)``)."""
    body = op.regions[0] if op.regions else None
    return body is not None and not body.ops and len(body.returns) == 1 and len(body.args) == 2 and \
        body.returns[0] is body.args[1]


def _hull(rs: Sequence[Range | None]) -> Range | None:
    rs = [r for r in rs if r is not None]
    if not rs:
        return None
    return min(r[0] for r in rs), max(r[1] for r in rs)


def _reduce_kind(op: Op) -> str | None:
    from .idioms import reduce_kind

    return reduce_kind(op)


def constant_int(v: Value, through: Callable[[Value], Value] | None = None) -> int | None:
    """The integer value of a splat constant (through broadcasts and reshapes), else ``None``."""
    v = (through or _through)(v)
    op = v.producer
    if op is None or op.name != "stablehlo.constant" or limits(v.type.dtype) is None:
        return None
    arr = op.attrs["value"].reshape(-1)
    if arr.size == 0 or not (arr == arr[0]).all():
        return None
    return int(arr[0])


def _through(v: Value, alias: dict[int, Value] | None = None) -> Value:
    """``v`` without the shape-only ops (broadcast, reshape) around it, and for an argument of a called function
    the caller's value (``alias``)."""
    while True:
        if alias is not None and id(v) in alias:
            v = alias[id(v)]
        elif v.producer is not None and v.producer.name in ("stablehlo.broadcast_in_dim", "stablehlo.reshape"):
            v = v.producer.operands[0]
        else:
            return v


_NEGATE = {"LT": "GE", "LE": "GT", "GT": "LE", "GE": "LT", "EQ": "NE", "NE": "EQ"}
_MIRROR = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "EQ": "EQ", "NE": "NE"}


def _restrict(r: Range, direction: str, k: int) -> Range | None:
    """The part of ``r`` where ``x <direction> k`` holds (``None``: empty)."""
    lo, hi = r
    if direction == "LT":
        hi = min(hi, k - 1)
    elif direction == "LE":
        hi = min(hi, k)
    elif direction == "GT":
        lo = max(lo, k + 1)
    elif direction == "GE":
        lo = max(lo, k)
    elif direction == "EQ":
        lo, hi = max(lo, k), min(hi, k)
    return (lo, hi) if lo <= hi else None


class Ranges:
    """The interval of every integer value emitted so far (keyed by the StableHLO value)."""

    def __init__(self) -> None:
        self._r: dict[int, Range | None] = {}
        self._wrapped: set[int] = set()  # values whose tensor was replaced by its wrapped value
        self._alias: dict[int, Value] = {}  # an argument of the function being called -> the caller's value

    def bind(self, args: Sequence[Value], values: Sequence[Value]) -> None:
        """The arguments of a called function are the caller's values (JAX's ``_where`` helpers): idioms
        across the call see the same values."""
        for a, v in zip(args, values):
            self._alias[id(a)] = v

    def _through(self, v: Value) -> Value:
        return _through(v, self._alias)

    def get(self, v: Value) -> Range | None:
        return self._r.get(id(v), type_range(v.type))

    def set(self, v: Value, r: Range | None) -> None:
        self._r[id(v)] = r

    def mark_wrapped(self, v: Value) -> None:
        self._wrapped.add(id(v))
        self._r[id(v)] = I32

    # ---- transfer functions -------------------------------------------------------------------------------
    def results(self, op: Op, callee_returns: Sequence[Value] | None = None) -> list[Range | None]:
        """The intervals of ``op``'s results from its operands' (after it was emitted)."""
        if callee_returns is not None:
            return [self.get(v) for v in callee_returns]
        out = []
        for i, v in enumerate(op.results):
            if type_range(v.type) is None:
                out.append(None)
                continue
            r = self._result(op, i)
            out.append(type_range(v.type) if r is None else _clip(op, v, *r))
        return out

    def _result(self, op: Op, i: int) -> Range | None:
        name = op.name
        ins = [self.get(v) for v in op.operands]
        if name == "stablehlo.constant":
            arr = op.attrs["value"]
            return (int(arr.min()), int(arr.max())) if arr.size else None
        if name == "stablehlo.iota":
            return 0, max(op.result.type.shape[op.attrs["iota_dimension"]] - 1, 0)
        if name == "stablehlo.optimization_barrier":
            return ins[i]
        if name in _SAME_AS_FIRST:
            return ins[0]
        if name in _UNION:
            return _hull(ins[:2])
        if name == "stablehlo.concatenate":
            return _hull(ins)
        if name == "stablehlo.select":
            return self._select(op)
        if name == "stablehlo.sort":
            return ins[i]
        if name == "stablehlo.scatter":  # replace: the operand's and the updates' values; add: sums (may be wide)
            return _hull([ins[0], ins[2]]) if _scatter_replaces(op) else I64
        if name == "stablehlo.convert":
            return self._convert(op, ins[0])
        if any(r is None for r in ins):
            return None
        if name == "stablehlo.add":
            return ins[0][0] + ins[1][0], ins[0][1] + ins[1][1]
        if name == "stablehlo.subtract":
            return ins[0][0] - ins[1][1], ins[0][1] - ins[1][0]
        if name == "stablehlo.multiply":
            p = [a * b for a in ins[0] for b in ins[1]]
            return min(p), max(p)
        if name == "stablehlo.negate":
            return -ins[0][1], -ins[0][0]
        if name == "stablehlo.abs":
            lo, hi = ins[0]
            return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi))), max(abs(lo), abs(hi))
        if name in ("stablehlo.maximum", "stablehlo.minimum", "stablehlo.clamp"):
            return _hull(ins)
        if name == "stablehlo.divide":
            return self._divide(op, ins[0], ins[1])
        if name == "stablehlo.dot_general":
            dn = op.attrs["dot_dimension_numbers"]
            k = 1
            for d in dn["lhs_contract"]:
                k *= op.operands[0].type.shape[d]
            p = [a * b for a in ins[0] for b in ins[1]]
            return k * min(p + [0]), k * max(p + [0])
        if name == "stablehlo.reduce" and len(op.operands) == 2:
            kind = _reduce_kind(op)
            n = op.operands[0].type.numel // max(op.result.type.numel, 1)
            if kind == "sum":
                return n * ins[0][0] + ins[1][0], n * ins[0][1] + ins[1][1]
            if kind in ("max", "min"):
                return _hull(ins)
            return None  # a product: no useful bound (wraps like any other i32 product)
        if name in ("stablehlo.and", "stablehlo.or", "stablehlo.xor", "stablehlo.not"):
            # bitwise ops of sign-extended numbers are sign-extended: exact in, exact out
            return I64 if any(is_wide(v, r) for v, r in zip(op.operands, ins)) else None
        if name == "stablehlo.sign":
            return -1, 1
        if name in ("stablehlo.power",):
            return I64
        return None  # the result type's range (exact: an op of exact operands with a result in its type)

    def _convert(self, op: Op, r: Range | None) -> Range | None:
        src = op.operands[0].type.dtype
        out = op.result.type.dtype
        if src == "i1":
            return 0, 1
        if limits(src) is None or r is None:  # from a float: saturated, in the type's range
            return None
        full = limits(out)
        if out == "i32":
            return r  # the same int64 numbers: wide if they were (i64 -> i32 truncates, as JAX)
        return r if full[0] <= r[0] and r[1] <= full[1] else None

    def _divide(self, op: Op, a: Range, b: Range) -> Range:
        if b[0] > 0 or b[1] < 0:  # no zero divisor: the truncated quotient is monotone in each operand
            q = [_tdiv(x, y) for x in a for y in b]
            return min(q), max(q)
        big = max(abs(a[0]), abs(a[1]))  # |q| <= |a|, and x / 0 == -1
        return min(-big, -1), max(big, 0)

    def _select(self, op: Op) -> Range | None:
        """The union of the branches, each restricted to where it is chosen when the predicate compares one
        value with a constant and the branch is that value or that value plus/minus a constant (JAX's
        negative-index wrap ``select(i < 0, i + n, i)``: never outside the int32 range)."""
        pred, on_true, on_false = op.operands
        cmp = self._through(pred).producer
        found = None
        if cmp is not None and cmp.name == "stablehlo.compare" and \
                cmp.attrs.get("compare_type", "SIGNED") in ("SIGNED", "UNSIGNED"):
            x, y = cmp.operands
            d = cmp.attrs["comparison_direction"]
            k = constant_int(y, self._through)
            if k is None:
                k, x, d = constant_int(x, self._through), y, _MIRROR[d]
            if k is not None:
                found = (self._through(x), d, k)
        return _hull([self._branch(on_true, found, False), self._branch(on_false, found, True)])

    def _branch(self, v: Value, found: tuple | None, negate: bool) -> Range | None:
        r = self.get(v)
        if found is None:
            return r
        x, d, k = found
        if id(x) in self._wrapped or is_wide(x, self.get(x)):
            return r  # x's tensor is not the one the branch was computed from (or it is wide): no refinement
        xr = self.get(x)
        if xr is None:
            return r
        restricted = _restrict(xr, _NEGATE[d] if negate else d, k)
        base = self._through(v)
        if base is x:
            return restricted if restricted is not None else r
        p = base.producer
        if p is not None and p.name in ("stablehlo.add", "stablehlo.subtract") and len(p.operands) == 2:
            a, b = (self._through(o) for o in p.operands)
            c = constant_int(p.operands[1], self._through) if a is x else \
                constant_int(p.operands[0], self._through) if (b is x and p.name == "stablehlo.add") else None
            if c is not None:
                if restricted is None:
                    return r
                c = c if p.name == "stablehlo.add" else -c
                return restricted[0] + c, restricted[1] + c
        return r


def _tdiv(x: int, y: int) -> int:
    """Integer division rounding toward zero (StableHLO's), exact for any size."""
    q = abs(x) // abs(y)
    return q if (x >= 0) == (y > 0) else -q


def xla_divide(a: int, b: int, dtype: str, divide: bool = True) -> int:
    """XLA's integer ``divide`` (or ``remainder``) of two numbers of ``dtype``, wrapped into its range."""
    if b == 0:
        q = all_ones(dtype) if divide else a
    else:
        q = _tdiv(a, b)
        q = q if divide else a - q * b
    lo, hi = limits(dtype)
    return (q - lo) % (hi - lo + 1) + lo


def all_ones(dtype: str) -> int:
    """XLA's quotient of a division by zero: every bit set (-1 signed, the maximum unsigned)."""
    lim = limits(dtype)
    return lim[1] if lim is not None and lim[0] == 0 else -1


def contains(r: Range | None, x: int) -> bool:
    return r is None or r[0] <= x <= r[1]


def float_to_int(x: torch.Tensor, dtype: str, target: torch.dtype) -> torch.Tensor:
    """XLA's float -> integer convert: round toward zero, saturate at the type's limits (+-inf too), NaN -> 0.
    PyTorch's cast is undefined out of range (it wraps or gives 0 on CPU). ``hi + 1`` and ``lo`` are powers of
    two (or 0): exact in a float type, or beyond its range (fp16: +-inf), and only +-inf compare so there."""
    lo, hi = limits(dtype)
    big = x >= float(hi + 1)
    small = x <= float(lo)
    bad = big | small | torch.isnan(x)
    safe = torch.where(bad, torch.zeros((), dtype=x.dtype), x).to(target)
    out = torch.where(big, torch.full((), hi, dtype=target), safe)
    return torch.where(small, torch.full((), lo, dtype=target), out)


def as_exact(value: Any) -> Any:
    """A deferred or real ``i32`` value with its tensor wrapped into the int32 range (splats are exact)."""
    from .values import Bcast, Splat, materialize

    if isinstance(value, Splat):
        return value
    if isinstance(value, Bcast):
        if isinstance(value.src, Splat):
            return value
        return Bcast(wrap_i32(materialize(value.src)), value.shape, value.dims)
    return wrap_i32(materialize(value))
