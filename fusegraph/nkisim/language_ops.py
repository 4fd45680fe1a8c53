"""The element-wise / reduction functions of ``nki.language`` (``nl.add``, ``nl.exp``, ``nl.sum``, ...).

They play two roles, as in NKI: they are the operator tokens passed as ``op=`` to ISA instructions (each
carries its :class:`~fusegraph.nkisim.opsdef.OpSpec` as ``_nki_op``), and they are callable as the
experimental high-level API (``nl.add(x, y)`` returns a new SBUF tile).  The high-level forms validate their
operands like an instruction, compute with NumPy in float32, and are profiled as one instruction on the
engine NKI would use (ScalarE for activation functions, VectorE otherwise).  They do not model how the
compiler lowers them to several ISA instructions.

The functions are generated with the exact 0.3.0 signatures (checked against the API table by the tests).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .opsdef import SPECS

UNARY = (
    "abs", "arctan", "ceil", "cos", "erf", "erf_dx", "exp", "floor", "gelu", "gelu_apprx_sigmoid",
    "gelu_apprx_sigmoid_dx", "gelu_apprx_tanh", "gelu_dx", "invert", "log", "logical_not", "mish", "negative",
    "reciprocal", "relu", "rsqrt", "sigmoid", "sign", "silu", "silu_dx", "sin", "softplus", "sqrt", "square",
    "tan", "tanh", "trunc",
)
BINARY = (
    "add", "bitwise_and", "bitwise_or", "bitwise_xor", "divide", "equal", "fmod", "greater", "greater_equal",
    "left_shift", "less", "less_equal", "logical_and", "logical_or", "logical_xor", "maximum", "minimum", "mod",
    "multiply", "not_equal", "power", "right_shift", "subtract",
)
REDUCTIONS = ("max", "mean", "min", "prod", "sum", "var")

_F32 = np.float32

_NP_UNARY = {
    "ceil": np.ceil,
    "floor": np.floor,
    "trunc": np.trunc,
    "cos": lambda x: np.cos(x).astype(_F32),
    "tan": lambda x: np.tan(x).astype(_F32),
    "negative": np.negative,
    "logical_not": lambda x: (x == 0).astype(_F32),
}
_NP_BINARY = {
    "divide": np.divide,
    "fmod": np.fmod,
    "mod": np.mod,
}
_NP_REDUCE = {
    "max": np.max,
    "min": np.min,
    "sum": np.sum,
    "prod": np.prod,
    "mean": np.mean,
    "var": np.var,
    "all": lambda a, axis, keepdims: np.all(a != 0, axis=axis, keepdims=keepdims).astype(_F32),
}


def _unary_impl(name: str, x: Any, dtype: Any) -> Any:
    from .highlevel import elementwise

    spec = SPECS.get(name)
    if name == "invert":
        return elementwise(f"nl.{name}", [x], dtype, lambda a: np.invert(a), bitvec=True)
    if spec is not None and spec.act is not None:
        return elementwise(f"nl.{name}", [x], dtype, spec.act, engine="scalar")
    fn = _NP_UNARY[name]
    return elementwise(f"nl.{name}", [x], dtype, lambda a: np.asarray(fn(a), dtype=_F32))


def _binary_impl(name: str, x: Any, y: Any, dtype: Any) -> Any:
    from .highlevel import elementwise

    spec = SPECS.get(name)
    if spec is not None and spec.bitvec:
        return elementwise(f"nl.{name}", [x, y], dtype, spec.alu, bitvec=True)
    if spec is not None and spec.alu is not None:
        return elementwise(f"nl.{name}", [x, y], dtype, spec.alu)
    fn = _NP_BINARY[name]
    return elementwise(f"nl.{name}", [x, y], dtype, lambda a, b: np.asarray(fn(a, b), dtype=_F32))


def _reduce_impl(name: str, x: Any, axis: Any, dtype: Any, keepdims: bool) -> Any:
    from .highlevel import reduction

    return reduction(f"nl.{name}", x, axis, dtype, keepdims, _NP_REDUCE[name])


def _define(src: str, name: str, env: dict) -> Any:
    code = compile(src, __file__, "exec")  # keep frames attributed to this (internal) module
    exec(code, env)
    fn = env[name]
    fn.__module__ = "nki.language"
    fn.__qualname__ = name
    spec = SPECS.get(name)
    if spec is not None:
        fn._nki_op = spec
    return fn


_env: dict[str, Any] = {"_u": _unary_impl, "_b": _binary_impl, "_r": _reduce_impl}
for _n in UNARY:
    globals()[_n] = _define(
        f"def {_n}(x, dtype=None):\n    '''nl.{_n}: element-wise; also an operator token for ISA op= arguments.'''\n"
        f"    return _u({_n!r}, x, dtype)\n",
        _n,
        _env,
    )
for _n in BINARY:
    globals()[_n] = _define(
        f"def {_n}(x, y, dtype=None):\n    '''nl.{_n}: element-wise; also an operator token for ISA op= arguments.'''\n"
        f"    return _b({_n!r}, x, y, dtype)\n",
        _n,
        _env,
    )
for _n in REDUCTIONS:
    globals()[_n] = _define(
        f"def {_n}(x, axis, dtype=None, keepdims=False):\n    '''nl.{_n}: reduction along free axes.'''\n"
        f"    return _r({_n!r}, x, axis, dtype, keepdims)\n",
        _n,
        _env,
    )
all = _define(  # noqa: A001 - official name
    "def all(x, axis, dtype=None):\n    '''nl.all: logical AND reduction along free axes.'''\n"
    "    return _r('all', x, axis, dtype, False)\n",
    "all",
    _env,
)


def copy(x, dtype=None):
    """nl.copy: a copy of x in the same buffer (ScalarE activation copy); also the identity activation token."""
    from .highlevel import elementwise

    return elementwise("nl.copy", [x], dtype, lambda a: a, engine="scalar", same_buffer=True)


copy.__module__ = "nki.language"
copy._nki_op = SPECS["copy"]

OP_FUNCTIONS: dict[str, Any] = {n: globals()[n] for n in (*UNARY, *BINARY, *REDUCTIONS, "all", "copy")}

__all__ = sorted(OP_FUNCTIONS)
