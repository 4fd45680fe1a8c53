"""Recognize JAX idioms in StableHLO whose PyTorch spelling is one ATen op the patterns are written with.

Each function looks at the StableHLO producers of a value (never at names of private functions, which JAX
chooses freely) and returns what the ATen form needs, or ``None``. Every rewrite is exact math: the ATen op
computes the same function (``softmax`` is ``exp(x - max) / sum``, ``silu`` is ``x * sigmoid(x)``).
"""
from __future__ import annotations

import math

import numpy as np

from .ir import Op, Value


def producer(v: Value, name: str, through_broadcast: bool = False) -> Op | None:
    """The op named ``name`` that produces ``v`` (optionally looking through ``broadcast_in_dim`` chains)."""
    op = v.producer
    while through_broadcast and op is not None and op.name == "stablehlo.broadcast_in_dim":
        op = op.operands[0].producer
    return op if op is not None and op.name == name else None


def is_splat(arr: np.ndarray) -> bool:
    """Every element of a constant's data equal (NaN equal to NaN: ``dense<0x7FC00000>`` is a splat)."""
    flat = arr.reshape(-1)
    if not flat.size:
        return False
    if np.all(flat == flat[0]):
        return True
    try:
        return bool(np.all(np.isnan(flat)))
    except TypeError:  # integers, booleans
        return False


def splat_value(v: Value) -> float | int | bool | None:
    """The value of a splat constant (through broadcasts and converts of one), else ``None``."""
    op = v.producer
    while op is not None and op.name in ("stablehlo.broadcast_in_dim", "stablehlo.convert", "stablehlo.reshape"):
        op = op.operands[0].producer
    if op is None or op.name != "stablehlo.constant":
        return None
    arr = op.attrs["value"]
    if arr.size == 0:
        return None
    if not is_splat(arr):
        return None
    return arr.reshape(-1)[0].item()


def reduce_kind(op: Op) -> str | None:
    """``sum``/``max``/``min``/``prod``/``all``/``any`` of a single-operand ``stablehlo.reduce``, else ``None``."""
    if op.name != "stablehlo.reduce" or len(op.operands) != 2 or not op.regions:
        return None
    body = op.regions[0]
    if len(body.ops) != 1 or len(body.returns) != 1 or body.returns[0] is not body.ops[0].result:
        return None
    inner = body.ops[0]
    if set(map(id, inner.operands)) != set(map(id, body.args)):
        return None
    dtype = op.operands[0].type.dtype
    return {"stablehlo.add": "sum", "stablehlo.maximum": "max", "stablehlo.minimum": "min",
            "stablehlo.multiply": "prod",
            "stablehlo.and": "all" if dtype == "i1" else None,
            "stablehlo.or": "any" if dtype == "i1" else None}.get(inner.name)


def _reduce_of(v: Value, kind: str) -> Op | None:
    op = producer(v, "stablehlo.reduce", through_broadcast=True)
    if op is None:
        reshape = producer(v, "stablehlo.reshape", through_broadcast=True)
        if reshape is not None:  # jnp's keepdims may also be a reshape of the reduction
            op = producer(reshape.operands[0], "stablehlo.reduce")
    return op if op is not None and reduce_kind(op) == kind else None


def mean_of(divide: Op) -> Op | None:
    """``divide(reduce_sum(x, dims) [broadcast], N)`` with ``N`` the number of reduced elements: ``mean``."""
    num, den = divide.operands
    r = _reduce_of(num, "sum")
    n = splat_value(den)
    if r is None or n is None or splat_value(r.operands[1]) not in (0, 0.0):
        return None
    count = math.prod(r.operands[0].type.shape[d] for d in r.attrs["dimensions"])
    return r if float(n) == float(count) and r.operands[0].type.dtype not in ("i1",) and \
        not r.operands[0].type.dtype.startswith(("i", "ui")) else None


def softmax_of(divide: Op) -> tuple[Value, int] | None:
    """``e / sum(e, d)`` with ``e = exp(x - max(x, d))`` (jax.nn.softmax, also with the ``max(-inf, .)`` guard
    and a stop_gradient): (x, d)."""
    e, s = divide.operands
    exp = producer(e, "stablehlo.exponential")
    r_sum = _reduce_of(s, "sum")
    if exp is None or r_sum is None or r_sum.operands[0] is not e or len(r_sum.attrs["dimensions"]) != 1:
        return None
    return _shifted_exp(exp, r_sum)


def _shifted_exp(exp: Op, r_sum: Op) -> tuple[Value, int] | None:
    """``exp(x - max(x, d))`` summed by ``r_sum`` over the same single dim ``d`` (from 0): (x, d)."""
    sub = producer(exp.operands[0], "stablehlo.subtract")
    if sub is None:
        return None
    x, m = sub.operands
    guard = producer(m, "stablehlo.maximum", through_broadcast=True)
    if guard is not None:  # max(-inf, reduce_max(x)): the initial value of jnp.max
        a, b = guard.operands
        m = b if splat_value(a) == -math.inf else a if splat_value(b) == -math.inf else m
    r_max = _reduce_of(m, "max")
    if r_max is None or r_max.operands[0] is not x or r_max.attrs["dimensions"] != r_sum.attrs["dimensions"]:
        return None
    if splat_value(r_sum.operands[1]) not in (0, 0.0):
        return None
    return x, r_sum.attrs["dimensions"][0]


def rounded_softmax_of(divide: Op) -> tuple[Value, int] | None:
    """jax.nn.softmax on a bf16/fp16 value: ``e / convert(sum(convert(e, f32), d), dtype)`` with
    ``e = exp(x - max(x, d))`` all in that dtype (``jnp.sum`` accumulates low-precision floats in fp32): (x, d).
    Every op rounds to the dtype, so this is not ``torch.softmax`` (fp32 inside, one rounding)."""
    dtype = divide.result.type.dtype
    if dtype not in ("bf16", "f16"):
        return None
    e, s = divide.operands
    exp = producer(e, "stablehlo.exponential")
    back = producer(s, "stablehlo.convert", through_broadcast=True)
    if exp is None or back is None or back.result.type.dtype != dtype or exp.result.type.dtype != dtype:
        return None
    r_sum = _reduce_of(back.operands[0], "sum")
    if r_sum is None or len(r_sum.attrs["dimensions"]) != 1 or r_sum.result.type.dtype != "f32":
        return None
    up = producer(r_sum.operands[0], "stablehlo.convert")
    if up is None or up.operands[0] is not e:
        return None
    return _shifted_exp(exp, r_sum)


def sigmoid_of(v: Value) -> Value | None:
    """``logistic(x)`` or ``1 / (1 + exp(-x))`` (how jax.nn.sigmoid lowers): x."""
    op = producer(v, "stablehlo.logistic")
    if op is not None:
        return op.operands[0]
    div = producer(v, "stablehlo.divide")
    if div is None or splat_value(div.operands[0]) != 1:
        return None
    add = producer(div.operands[1], "stablehlo.add")
    if add is None:
        return None
    a, b = add.operands
    e = b if splat_value(a) == 1 else a if splat_value(b) == 1 else None
    exp = producer(e, "stablehlo.exponential") if e is not None else None
    neg = producer(exp.operands[0], "stablehlo.negate") if exp is not None else None
    return neg.operands[0] if neg is not None else None


def silu_of(multiply: Op) -> Value | None:
    """``x * sigmoid(x)`` (jax.nn.silu): x."""
    a, b = multiply.operands
    for x, s in ((a, b), (b, a)):
        if sigmoid_of(s) is x:
            return x
    return None


_STATIC_OPS = ("stablehlo.constant", "stablehlo.broadcast_in_dim", "stablehlo.reshape", "stablehlo.convert",
               "stablehlo.minimum", "stablehlo.maximum", "stablehlo.concatenate", "stablehlo.iota")


def static_array(v: Value, limit: int = 16) -> np.ndarray | None:
    """The data of a value computed from constants only by data movement and min/max (the bounds of the clamp
    ``jax.vmap`` puts around a batched ``dynamic_update_slice``'s start indices), in its own shape; else
    ``None``. Integer values only (as int64): what index bounds are."""
    op = v.producer
    if op is None or op.name not in _STATIC_OPS or limit <= 0 or not v.type.dtype.startswith(("i", "ui")) or \
            v.type.dtype == "i1":
        return None
    shape = tuple(v.type.shape)
    if op.name == "stablehlo.constant":
        return np.broadcast_to(np.asarray(op.attrs["value"], dtype=np.int64), shape)
    if op.name == "stablehlo.iota":
        dim = op.attrs["iota_dimension"]
        index = [1] * len(shape)
        index[dim] = shape[dim]
        return np.broadcast_to(np.arange(shape[dim], dtype=np.int64).reshape(index), shape)
    ins = [static_array(o, limit - 1) for o in op.operands]
    if any(a is None for a in ins):
        return None
    if op.name == "stablehlo.broadcast_in_dim":
        src = ins[0]
        dims = list(op.attrs["broadcast_dimensions"])
        index = [1] * len(shape)
        for i, d in enumerate(dims):
            index[d] = src.shape[i]
        return np.broadcast_to(src.reshape(index), shape)
    if op.name == "stablehlo.reshape":
        return ins[0].reshape(shape)
    if op.name == "stablehlo.convert":
        return ins[0] if v.type.dtype in ("i32", "i64") else None
    if op.name == "stablehlo.concatenate":
        return np.concatenate(ins, axis=op.attrs["dimension"])
    return np.minimum(ins[0], ins[1]) if op.name == "stablehlo.minimum" else np.maximum(ins[0], ins[1])
