"""ALU operators and activation functions of the NKI ISA (the ``op=`` tokens).

The tokens are the ``nki.language`` functions themselves (``nl.add``, ``nl.exp``, ...): each carries an
:class:`OpSpec` describing what it means as an ALU operator (tensor_tensor / tensor_scalar / tensor_reduce)
and/or as a ScalarE activation function.  The lists follow the 2.29 tables "Supported Math Operators for
NKI ISA" and "Supported Activation Functions" (nki.api.shared.rst).  Activation functions are computed
exactly in float32 here; the hardware uses piecewise-polynomial approximations that "generate invalid output
results" outside their documented Valid Input Range, so each spec carries that range (``valid``) and
``nisa.activation`` raises (rule ``activation-range``) for inputs outside it (see docs/interpreter.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

F32 = np.float32


@dataclass(frozen=True)
class OpSpec:
    name: str
    alu: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None  # binary ALU (or unary if unary=True)
    unary: bool = False
    bitvec: bool = False
    reduce: Callable[[np.ndarray, int], np.ndarray] | None = None  # legal reduction: f(array, axis)
    act: Callable[[np.ndarray], np.ndarray] | None = None  # activation function
    compare: bool = False
    #: documented Valid Input Range of the ScalarE activation (inclusive; None = [-inf, inf]); ``valid_abs``:
    #: the range applies to ``|x|`` (reciprocal: +-[2^-42, 2^42])
    valid: tuple[float, float] | None = None
    valid_abs: bool = False
    valid_text: str = ""


def _f(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=F32)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-x))).astype(F32)


_erf_impl: Callable[[np.ndarray], np.ndarray] | None = None


def _erf(x: np.ndarray) -> np.ndarray:
    global _erf_impl
    if _erf_impl is None:
        try:
            import torch

            def _torch_erf(a: np.ndarray) -> np.ndarray:
                return torch.erf(torch.from_numpy(np.ascontiguousarray(a, dtype=F32))).numpy()

            _erf_impl = _torch_erf
        except Exception:  # pragma: no cover - torch is a dependency
            _erf_impl = np.vectorize(math.erf, otypes=[F32])
    return _erf_impl(x)


_SQRT1_2 = F32(1.0 / math.sqrt(2.0))
_SQRT_2_PI = F32(math.sqrt(2.0 / math.pi))
_INV_SQRT_2PI = F32(1.0 / math.sqrt(2.0 * math.pi))
_2_SQRT_PI = F32(2.0 / math.sqrt(math.pi))


def _gelu(x):
    return (0.5 * x * (1.0 + _erf(x * _SQRT1_2))).astype(F32)


def _gelu_dx(x):
    return (0.5 * (1.0 + _erf(x * _SQRT1_2)) + x * _INV_SQRT_2PI * np.exp(-0.5 * x * x)).astype(F32)


def _gelu_tanh(x):
    return (0.5 * x * (1.0 + np.tanh(_SQRT_2_PI * (x + F32(0.044715) * x * x * x)))).astype(F32)


def _gelu_sig(x):
    return (x * _sigmoid(F32(1.702) * x)).astype(F32)


def _gelu_sig_dx(x):
    s = _sigmoid(F32(1.702) * x)
    return (s + F32(1.702) * x * s * (1.0 - s)).astype(F32)


def _silu(x):
    return (x * _sigmoid(x)).astype(F32)


def _silu_dx(x):
    s = _sigmoid(x)
    return (s * (1.0 + x * (1.0 - s))).astype(F32)


def _softplus(x):
    return np.logaddexp(F32(0.0), x).astype(F32)


def _mish(x):
    return (x * np.tanh(_softplus(x))).astype(F32)


def _erf_dx(x):
    return (_2_SQRT_PI * np.exp(-x * x)).astype(F32)


def _logical(fn):
    return lambda a, b: fn(a != 0, b != 0).astype(F32)


def _cmp(fn):
    return lambda a, b: fn(a, b).astype(F32)


def _sub_reduce(a: np.ndarray, axis: int) -> np.ndarray:
    # Left fold a0 - a1 - a2 ... (the hardware semantics of a subtract-reduction are not documented).
    first = np.take(a, 0, axis=axis)
    return first - np.sum(np.delete(a, 0, axis=axis), axis=axis)


def _bit(fn):
    return lambda a, b: fn(a, b)


def _right_shift(a, b):
    # logical shift on the operand's bit pattern (operands are passed as unsigned views)
    return np.right_shift(a, b)


# name -> spec; the language module attaches these to its functions
SPECS: dict[str, OpSpec] = {
    # arithmetic ALU ops
    "add": OpSpec("add", alu=np.add, reduce=lambda a, ax: np.sum(a, axis=ax)),
    "subtract": OpSpec("subtract", alu=np.subtract, reduce=_sub_reduce),
    "multiply": OpSpec("multiply", alu=np.multiply, reduce=lambda a, ax: np.prod(a, axis=ax)),
    "maximum": OpSpec("maximum", alu=np.maximum, reduce=lambda a, ax: np.max(a, axis=ax)),
    "minimum": OpSpec("minimum", alu=np.minimum, reduce=lambda a, ax: np.min(a, axis=ax)),
    "equal": OpSpec("equal", alu=_cmp(np.equal), compare=True),
    "not_equal": OpSpec("not_equal", alu=_cmp(np.not_equal), compare=True),
    "greater": OpSpec("greater", alu=_cmp(np.greater), compare=True),
    "greater_equal": OpSpec("greater_equal", alu=_cmp(np.greater_equal), compare=True),
    "less": OpSpec("less", alu=_cmp(np.less), compare=True),
    "less_equal": OpSpec("less_equal", alu=_cmp(np.less_equal), compare=True),
    "logical_and": OpSpec(
        "logical_and", alu=_logical(np.logical_and), reduce=lambda a, ax: np.all(a != 0, axis=ax).astype(F32)
    ),
    "logical_or": OpSpec(
        "logical_or", alu=_logical(np.logical_or), reduce=lambda a, ax: np.any(a != 0, axis=ax).astype(F32)
    ),
    "logical_xor": OpSpec(
        "logical_xor",
        alu=_logical(np.logical_xor),
        reduce=lambda a, ax: (np.sum(a != 0, axis=ax) % 2).astype(F32),
    ),
    "power": OpSpec("power", alu=np.power),
    # unary ALU ops (also activation functions where listed)
    "rsqrt": OpSpec("rsqrt", alu=lambda a, b: (1.0 / np.sqrt(a)).astype(F32), unary=True,
                    act=lambda x: (1.0 / np.sqrt(x)).astype(F32), valid=(2.0**-87, 2.0**97),
                    valid_text="[2^-87, 2^97]"),
    "reciprocal": OpSpec("reciprocal", alu=lambda a, b: (1.0 / a).astype(F32), unary=True,
                         act=lambda x: (1.0 / x).astype(F32), valid=(2.0**-42, 2.0**42), valid_abs=True,
                         valid_text="+-[2^-42, 2^42]"),
    "abs": OpSpec("abs", alu=lambda a, b: np.abs(a), unary=True, act=np.abs),
    # bitvec ops
    "bitwise_and": OpSpec("bitwise_and", alu=_bit(np.bitwise_and), bitvec=True,
                          reduce=lambda a, ax: np.bitwise_and.reduce(a, axis=ax)),
    "bitwise_or": OpSpec("bitwise_or", alu=_bit(np.bitwise_or), bitvec=True,
                         reduce=lambda a, ax: np.bitwise_or.reduce(a, axis=ax)),
    "bitwise_xor": OpSpec("bitwise_xor", alu=_bit(np.bitwise_xor), bitvec=True,
                          reduce=lambda a, ax: np.bitwise_xor.reduce(a, axis=ax)),
    "invert": OpSpec("invert", alu=lambda a, b: np.invert(a), bitvec=True, unary=True),
    "left_shift": OpSpec("left_shift", alu=_bit(np.left_shift), bitvec=True),
    "right_shift": OpSpec("right_shift", alu=_right_shift, bitvec=True),
    # activation-only functions
    "copy": OpSpec("copy", act=lambda x: x),
    "square": OpSpec("square", act=lambda x: (x * x).astype(F32)),
    "sigmoid": OpSpec("sigmoid", act=_sigmoid),
    "relu": OpSpec("relu", act=lambda x: np.maximum(x, F32(0.0))),
    "gelu": OpSpec("gelu", act=_gelu),
    "gelu_dx": OpSpec("gelu_dx", act=_gelu_dx),
    "gelu_apprx_tanh": OpSpec("gelu_apprx_tanh", act=_gelu_tanh),
    "gelu_apprx_sigmoid": OpSpec("gelu_apprx_sigmoid", act=_gelu_sig),
    "gelu_apprx_sigmoid_dx": OpSpec("gelu_apprx_sigmoid_dx", act=_gelu_sig_dx),
    "silu": OpSpec("silu", act=_silu),
    "silu_dx": OpSpec("silu_dx", act=_silu_dx),
    "tanh": OpSpec("tanh", act=lambda x: np.tanh(x).astype(F32)),
    "softplus": OpSpec("softplus", act=_softplus),
    "mish": OpSpec("mish", act=_mish),
    "erf": OpSpec("erf", act=lambda x: _erf(x).astype(F32)),
    "erf_dx": OpSpec("erf_dx", act=_erf_dx),
    "exp": OpSpec("exp", act=lambda x: np.exp(x).astype(F32)),
    "log": OpSpec("log", act=lambda x: np.log(x).astype(F32), valid=(2.0**-64, 2.0**64), valid_text="[2^-64, 2^64]"),
    # pi and pi/2 as float32 (which round up), so that a range-reduced float32 value of exactly +-pi is valid
    "sin": OpSpec("sin", act=lambda x: np.sin(x).astype(F32), valid=(-float(F32(math.pi)), float(F32(math.pi))),
                  valid_text="[-pi, pi] (no range reduction)"),
    "arctan": OpSpec("arctan", act=lambda x: np.arctan(x).astype(F32),
                     valid=(-float(F32(math.pi / 2)), float(F32(math.pi / 2))), valid_text="[-pi/2, pi/2]"),
    "sqrt": OpSpec("sqrt", act=lambda x: np.sqrt(x).astype(F32), valid=(2.0**-116, 2.0**118),
                   valid_text="[2^-116, 2^118]"),
    "sign": OpSpec("sign", act=lambda x: np.sign(x).astype(F32)),
}

ALU_OPS = frozenset(k for k, v in SPECS.items() if v.alu is not None)
ACTIVATIONS = frozenset(k for k, v in SPECS.items() if v.act is not None)
REDUCIBLE = frozenset(k for k, v in SPECS.items() if v.reduce is not None)


def spec_of(op: Any) -> OpSpec | None:
    return getattr(op, "_nki_op", None)


def describe(op: Any) -> str:
    s = spec_of(op)
    if s is not None:
        return f"nl.{s.name}"
    return repr(op)
