"""Translate StableHLO ops into PyTorch calls, one op at a time (the calls are traced into ATen by
:mod:`.importer`).

Each handler gets the op and its operands' current values (tensors or the deferred values of :mod:`.values`) and
returns the results. Handlers write ops the way captured PyTorch code writes them (``linear``, ``softmax``,
``x.mean(-1, keepdim=True)``, ``index_copy`` for a cache write), so the program built from a JAX step has the
op forms fusegraph's patterns are traced to. Ops without a handler, and op forms a handler does not cover,
raise :class:`~.ir.UnsupportedOp` naming the op: the caller then runs the original function instead.
"""
from __future__ import annotations

import contextlib
import math
import operator
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F

from . import idioms, intrange, layout_idioms, stacked
from .ir import Function, Module, Op, UnsupportedOp, Value, module_path
from .values import (Bcast, ExpertWeight, Reduced, Splat, Stacked, Transposed, bcast_source, elementwise_operand,
                     elementwise_operands, materialize, permuted, python_scalar, torch_dtype)

Handler = Callable[["Emitter", Op, list], list]
HANDLERS: dict[str, Handler] = {}


def handles(*names: str) -> Callable[[Handler], Handler]:
    def deco(fn: Handler) -> Handler:
        for n in names:
            HANDLERS[n] = fn
        return fn

    return deco


def supported_ops() -> list[str]:
    """Every op name the importer translates (some only in the forms docs/jax.md lists)."""
    return sorted(HANDLERS) + ["func.call", "stablehlo.composite"]


class Emitter:
    """Runs a StableHLO function by calling PyTorch for each op (under ``make_fx`` this records the ATen graph)."""

    def __init__(self, module: Module, buffers: dict[int, torch.Tensor] | None = None) -> None:
        self.module = module
        self.buffers = buffers or {}  # id(constant op) -> the program input holding that constant
        self._values: dict[int, Any] = {}  # the environment of the function being run (for idioms)
        #: keras-hub rotary-table ops: id(op) -> (key, RopeTable, folded inv_freq input); see importer
        self.tables: dict[int, tuple] = {}
        self._table_memo: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._table_casts: dict[tuple, torch.Tensor] = {}  # (id of a memo table, dtype): its cast
        #: the int64 interval of every integer value (XLA's int32 wrap, division guards: see intrange)
        self.ranges = intrange.Ranges()

    # ---- running functions -------------------------------------------------------------------------------
    def run(self, fn: Function, args: Sequence[Any], scope: str | None = None, source: str | None = None,
            arg_ranges: Sequence[Any] | None = None) -> list:
        env: dict[int, Any] = {id(v): a for v, a in zip(fn.body.args, args)}
        for i, v in enumerate(fn.body.args):
            self.ranges.set(v, arg_ranges[i] if arg_ranges is not None else intrange.type_range(v.type))
        saved, self._values = self._values, env
        try:
            for op in fn.body.ops:
                with self._meta(op, scope, source):
                    self.step(op, env)
            return [env[id(v)] for v in fn.body.returns]
        finally:
            self._values = saved

    def step(self, op: Op, env: dict[int, Any]) -> None:
        """Emit one op: its results into ``env``, their integer intervals into :attr:`ranges`."""
        outs = self.emit(op, self._operands(op, env))
        if len(outs) != len(op.results):
            raise UnsupportedOp(op.name, f"{len(outs)} results for {len(op.results)}")
        for r, o in zip(op.results, outs):
            env[id(r)] = o
        callee = self._callee(op)
        for r, rr in zip(op.results, self.ranges.results(op, callee.body.returns if callee else None)):
            self.ranges.set(r, rr)

    def _operands(self, op: Op, env: dict[int, Any]) -> list:
        """The op's operand values; an ``i32`` operand whose int64 tensor may be outside the int32 range is
        wrapped first where the op reads more than its low 32 bits (once: the wrapped value replaces it)."""
        for i, v in enumerate(op.operands):
            if intrange.is_wide(v, self.ranges.get(v)) and not intrange.may_be_wide(op, i):
                env[id(v)] = intrange.as_exact(env[id(v)])
                self.ranges.mark_wrapped(v)
        return [env[id(v)] for v in op.operands]

    def _callee(self, op: Op) -> Function | None:
        if op.name == "func.call":
            return self.module.functions[op.attrs["callee"]]
        if op.name == "stablehlo.composite":
            return self.module.functions[op.attrs["decomposition"]]
        return None

    def emit(self, op: Op, vals: list) -> list:
        callee = self._callee(op)
        if callee is not None:
            self.ranges.bind(callee.body.args, op.operands)
            return self.run(callee, vals, op.scope or None, op.source,
                            arg_ranges=[self.ranges.get(v) for v in op.operands])
        handler = HANDLERS.get(op.name)
        if handler is None:
            detail = f"custom_call target {op.attrs.get('call_target_name')!r}" if op.name == "stablehlo.custom_call" else ""
            raise UnsupportedOp(op.name, detail)
        out = handler(self, op, vals)
        return out if isinstance(out, list) else [out]

    @contextlib.contextmanager
    def _meta(self, op: Op, scope: str | None, source: str | None) -> Iterator[None]:
        """Make every ATen node this op records carry its JAX scope as the module path (``layers.0.mlp``) and
        its source line, the way dynamo's nodes carry ``nn_module_stack`` and ``stack_trace``."""
        scope = scope if scope is not None else op.scope
        source = source or op.source
        path = module_path(scope) if scope else ""
        stack = {"L['self']": ("L['self']", "jax")}
        if path:
            stack[f"L['self'].{path}"] = (f"L['self'].{path}", "jax.named_scope")
        meta = {"nn_module_stack": stack}
        if source:
            file, _, line = source.rpartition(":")
            meta["stack_trace"] = f'  File "{file}", line {line}, in jax\n    {source} {op.name}\n'
        saved = fx_traceback.current_meta
        fx_traceback.current_meta = meta
        try:
            yield
        finally:
            fx_traceback.current_meta = saved


# ---- helpers ------------------------------------------------------------------------------------------------
def _rank(op: Op) -> int:
    return len(op.result.type.shape)


def _shape(op: Op) -> tuple[int, ...]:
    return op.result.type.shape


def _dtype(op: Op) -> torch.dtype:
    return torch_dtype(op.result.type, op.name)


def _np_dtype(name: str):
    from .parse import _numpy_dtype

    return _numpy_dtype(name)


def _fold(op: Op, fn: Callable, *vals: Any) -> Splat:
    """Constant-fold an op on splats with numpy in the op's own element types (bf16 rounding included)."""
    args = [np.asarray(v.value, dtype=_np_dtype(v.dtype)) for v in vals]
    out = np.asarray(fn(*args)).astype(_np_dtype(op.result.type.dtype))
    return Splat(python_scalar(out.item(), op.result.type.dtype), op.result.type.dtype, _shape(op))


def _splat(v: Any) -> Splat | None:
    if isinstance(v, Splat):
        return v
    if isinstance(v, Bcast) and isinstance(v.src, Splat):
        return v.src
    return None


def _fit(op: Op, t: Any) -> Any:
    """An elementwise result whose implicit broadcast is smaller than the op's result: keep it deferred."""
    shape = _shape(op)
    if not isinstance(t, torch.Tensor) or tuple(t.shape) == shape:
        return t
    rank = len(shape)
    dims = tuple(range(rank)) if t.dim() == rank else tuple(range(rank - t.dim(), rank))
    return Bcast(t, shape, dims)


def _is_int(op_or_type: Any) -> bool:
    t = op_or_type.result.type if isinstance(op_or_type, Op) else op_or_type
    return t.dtype.startswith(("i", "ui")) and t.dtype != "i1"


def _scalar_tensor(value: Any, op: Op) -> torch.Tensor:
    return torch.full((), value, dtype=_dtype(op))


# ---- constants, shapes, layout ------------------------------------------------------------------------------
@handles("stablehlo.constant")
def _constant(em: Emitter, op: Op, vals: list) -> Any:
    arr = op.attrs["value"]
    dtype = op.result.type.dtype
    flat = arr.reshape(-1)
    if idioms.is_splat(arr):
        return Splat(python_scalar(flat[0].item(), dtype), dtype, _shape(op))
    if id(op) in em.buffers:
        return em.buffers[id(op)]
    raise UnsupportedOp(op.name, "non-splat constant without a buffer input")  # pragma: no cover


@handles("stablehlo.iota")
def _iota(em: Emitter, op: Op, vals: list) -> Any:
    dim = op.attrs["iota_dimension"]
    n = _shape(op)[dim]
    return Bcast(torch.arange(n, dtype=_dtype(op)), _shape(op), (dim,))


@handles("stablehlo.broadcast_in_dim")
def _broadcast_in_dim(em: Emitter, op: Op, vals: list) -> Any:
    (src,) = vals
    dims = tuple(op.attrs["broadcast_dimensions"])
    if isinstance(src, Splat):
        return Splat(src.value, src.dtype, _shape(op))
    if isinstance(src, Bcast):
        return Bcast(src.src, _shape(op), tuple(dims[d] for d in src.dims))
    if isinstance(src, Stacked):
        out = stacked.broadcast(src, _shape(op), dims)
        if out is not None:
            return out
    return Bcast(src, _shape(op), dims)


@handles("stablehlo.reshape")
def _reshape(em: Emitter, op: Op, vals: list) -> Any:
    (src,) = vals
    s = _splat(src)
    if s is not None:
        return Splat(s.value, s.dtype, _shape(op))
    if isinstance(src, Stacked):
        out = stacked.reshape(src, _shape(op))
        if out is not None:
            return out
    t = materialize(src)
    return t if tuple(t.shape) == _shape(op) else t.reshape(_shape(op))


@handles("stablehlo.transpose")
def _transpose(em: Emitter, op: Op, vals: list) -> Any:
    (src,) = vals
    perm = list(op.attrs["permutation"])
    s = _splat(src)
    if s is not None:
        return Splat(s.value, s.dtype, _shape(op))
    if isinstance(src, Stacked):
        return stacked.transpose(src, perm)
    if isinstance(src, Transposed) and perm == [1, 0] and len(src.t.shape) == len(perm) and \
            (src.shape is None or len(src.shape) == 2):
        return src.t
    if isinstance(src, torch.Tensor) and perm == [1, 0] and op.operands[0].producer is None:
        # ``W.T`` of a 2-d argument (tied embeddings' ``x @ embed.T``): deferred, so ``x @ W.T`` is ``linear(x, W)``
        # and any other use is ``W.t()``
        return Transposed(src)
    t = materialize(src)
    moved = [i for i, p in enumerate(perm) if p != i]
    if not moved:
        return t
    if len(moved) == 2:
        return t.transpose(*moved)
    return t.permute(perm)


@handles("stablehlo.convert")
def _convert(em: Emitter, op: Op, vals: list) -> Any:
    experts = layout_idioms.dense_experts_of(em.module, op)  # bf16: the expert sum accumulated in fp32, rounded
    out = _dense_experts(em, op, experts) if experts is not None else None
    if out is not None:
        return out
    x = layout_idioms.fp32_silu_of(em.module, op)
    if x is not None and id(x) in em_values(em):  # silu computed in fp32, rounded once: bf16 ``F.silu``
        return _fit(op, F.silu(materialize(em_values(em)[id(x)])))
    (src,) = vals
    s = _splat(src)
    if s is not None:
        return _fold(op, _xla_convert(op), s)
    if intrange.limits(op.result.type.dtype) is not None and intrange.limits(op.operands[0].type.dtype) is None \
            and op.operands[0].type.dtype != "i1":  # float -> integer: XLA saturates (PyTorch's cast does not)
        return _fit(op, intrange.float_to_int(materialize(src) if not isinstance(src, Bcast) else
                                              elementwise_operand(src, _rank(op)), op.result.type.dtype, _dtype(op)))
    table = _table_cast(em, op, src)
    if table is not None:
        return table
    t = materialize(src) if not isinstance(src, Bcast) else None
    if t is None:  # convert before expanding (what `x[..., None].astype(f32)` means)
        inner = elementwise_operand(src, _rank(op))
        out = inner.to(_dtype(op)) if isinstance(inner, torch.Tensor) else inner
        return _fit(op, out)
    return t if t.dtype == _dtype(op) else t.to(_dtype(op))


def _xla_convert(op: Op) -> Callable:
    """A convert folded on a constant with XLA's float -> integer semantics (saturating, NaN -> 0)."""
    lim = intrange.limits(op.result.type.dtype)
    if lim is None or intrange.limits(op.operands[0].type.dtype) is not None:
        return lambda a: a

    def fold(a: np.ndarray) -> np.ndarray:
        x = np.asarray(a, dtype=np.float64)
        return np.where(np.isnan(x), 0, np.clip(np.trunc(np.nan_to_num(x, nan=0.0)), lim[0], lim[1]))

    return fold


@handles("stablehlo.slice")
def _slice(em: Emitter, op: Op, vals: list) -> Any:
    (src,) = vals
    s = _splat(src)
    if s is not None:
        return Splat(s.value, s.dtype, _shape(op))
    starts, limits, strides = op.attrs["start_indices"], op.attrs["limit_indices"], op.attrs["strides"]
    if isinstance(src, Stacked):
        out = stacked.slice_(src, starts, limits, strides)
        if out is not None:
            return out
    t = materialize(src)
    index: list = []
    for size, a, b, st in zip(t.shape, starts, limits, strides):
        if (a, b, st) == (0, size, 1):
            index.append(slice(None))
        else:
            index.append(slice(a or None, None if b == size else b, None if st == 1 else st))
    while index and index[-1] == slice(None):
        index.pop()
    if not index:
        return t
    lead = len(index) - 1
    if all(i == slice(None) for i in index[:lead]) and lead > 0:
        return t[(Ellipsis, index[-1])] if lead == t.dim() - 1 else t[tuple(index)]
    return t[tuple(index)]


@handles("stablehlo.concatenate")
def _concatenate(em: Emitter, op: Op, vals: list) -> Any:
    dim = op.attrs["dimension"]
    found = layout_idioms.split_rope_of(op)
    if found is not None:
        out = _split_rope(em, op, *found)
        if out is not None:
            return out
    splats = [_splat(v) for v in vals]
    if all(splats) and len({(s.value, s.dtype) for s in splats}) == 1:
        return Splat(splats[0].value, splats[0].dtype, _shape(op))
    if all(isinstance(v, Stacked) for v in vals):
        out = stacked.concatenate(vals, dim)
        if out is not None:
            return out
    parts = [materialize(v) for v in vals]
    return torch.cat(parts, dim=dim - _rank(op))


@handles("stablehlo.pad")
def _pad(em: Emitter, op: Op, vals: list) -> Any:
    src, value = vals
    if any(op.attrs["interior_padding"]):
        raise UnsupportedOp(op.name, "interior padding")
    pv = _splat(value)
    if pv is None:
        raise UnsupportedOp(op.name, "non-constant padding value")
    t = materialize(src)
    pads: list[int] = []
    for lo, hi in reversed(list(zip(op.attrs["edge_padding_low"], op.attrs["edge_padding_high"]))):
        pads += [lo, hi]
    return F.pad(t, pads, value=pv.value)


@handles("stablehlo.reverse")
def _reverse(em: Emitter, op: Op, vals: list) -> Any:
    return torch.flip(materialize(vals[0]), list(op.attrs["dimensions"]))


@handles("stablehlo.optimization_barrier")
def _barrier(em: Emitter, op: Op, vals: list) -> Any:
    return list(vals)


# ---- elementwise --------------------------------------------------------------------------------------------
_COMMUTATIVE = {"stablehlo.add": operator.add, "stablehlo.multiply": operator.mul}
_NUMPY_BINARY = {"stablehlo.add": np.add, "stablehlo.multiply": np.multiply, "stablehlo.subtract": np.subtract,
                 "stablehlo.maximum": np.maximum, "stablehlo.minimum": np.minimum}


def _binary_operands(op: Op, vals: list) -> tuple[Any, Any]:
    a, b = elementwise_operands(vals, _shape(op))
    return a, b


@handles("stablehlo.add", "stablehlo.multiply", "stablehlo.subtract", "stablehlo.divide", "stablehlo.maximum",
         "stablehlo.minimum", "stablehlo.power", "stablehlo.remainder", "stablehlo.atan2", "stablehlo.and",
         "stablehlo.or", "stablehlo.xor")
def _binary(em: Emitter, op: Op, vals: list) -> Any:
    name = op.name
    sa, sb = _splat(vals[0]), _splat(vals[1])
    if sa is not None and sb is not None and name in _NUMPY_BINARY:
        return _fold(op, _NUMPY_BINARY[name], sa, sb)
    if name == "stablehlo.divide":
        r = idioms.mean_of(op)
        if r is not None:
            return _mean(em, op, vals, r)
        sm = idioms.softmax_of(op)
        if sm is not None:
            return _softmax(em, op, sm)
        sm = idioms.rounded_softmax_of(op)
        if sm is not None:
            return _rounded_softmax(em, op, sm)
        x = idioms.sigmoid_of(op.result)
        if x is not None:  # 1 / (1 + exp(-x))
            return _fit(op, torch.sigmoid(materialize(_value_of(em, op, x))))
    if name == "stablehlo.add":
        found = layout_idioms.rope_of(op)
        if found is not None:
            out = _rope(em, op, *found)
            if out is not None:
                return out
    if name == "stablehlo.multiply":
        x = idioms.silu_of(op)
        if x is not None:
            return _fit(op, F.silu(materialize(_value_of(em, op, x))))
        if op.operands[0] is op.operands[1]:
            return _fit(op, elementwise_operand(vals[0], _rank(op)).pow(2))
    a, b = _binary_operands(op, vals)
    if name in _COMMUTATIVE:
        if not isinstance(a, torch.Tensor):
            a, b = b, a
        return _fit(op, _COMMUTATIVE[name](a, b))
    if name in ("stablehlo.maximum", "stablehlo.minimum"):
        if not isinstance(a, torch.Tensor):
            a, b = b, a
        if not isinstance(b, torch.Tensor):
            if name == "stablehlo.maximum" and b == 0 and not _is_int(op) and op.result.type.dtype != "i1":
                return _fit(op, torch.relu(a))
            return _fit(op, torch.clamp(a, min=b) if name == "stablehlo.maximum" else torch.clamp(a, max=b))
        return _fit(op, torch.maximum(a, b) if name == "stablehlo.maximum" else torch.minimum(a, b))
    if name in ("stablehlo.and", "stablehlo.or", "stablehlo.xor"):
        if not isinstance(a, torch.Tensor):
            a, b = b, a
        fn = {"stablehlo.and": operator.and_, "stablehlo.or": operator.or_, "stablehlo.xor": operator.xor}[name]
        return _fit(op, fn(a, b))
    if name in ("stablehlo.divide", "stablehlo.remainder") and _is_int(op):
        return _int_divide(em, op, a, b)
    if name == "stablehlo.power" and _is_int(op) and not (isinstance(b, int) and b >= 0):
        raise UnsupportedOp(name, "integer power with a negative or non-constant exponent")
    if not isinstance(a, torch.Tensor):  # scalar on the left of a non-commutative op: a 0-d tensor, exact
        a = _scalar_tensor(a, op)
    if name == "stablehlo.subtract":
        return _fit(op, a - b)
    if name == "stablehlo.divide":
        return _fit(op, a / b)
    if name == "stablehlo.power":
        return _fit(op, torch.pow(a, b))
    if name == "stablehlo.remainder":
        return _fit(op, torch.fmod(a, b))
    return _fit(op, torch.atan2(a, b if isinstance(b, torch.Tensor) else _scalar_tensor(b, op)))


def _int_divide(em: Emitter, op: Op, a: Any, b: Any) -> Any:
    """StableHLO's integer ``divide`` (rounds toward zero) and ``remainder`` (the dividend's sign) with XLA's
    results where PyTorch raises or crashes: ``x / 0`` is all ones (-1, or the unsigned maximum), ``x % 0`` is
    ``x``, ``MIN / -1`` is ``MIN`` and ``MIN % -1`` is 0 (an ``int64`` division of ``INT64_MIN`` by -1 is a
    ``SIGFPE`` in PyTorch). Guards are emitted only where the divisor's interval holds 0 (or -1 for ``i64``)."""
    dtype = op.result.type.dtype
    div = op.name == "stablehlo.divide"
    rb = em.ranges.get(op.operands[1])
    ra = em.ranges.get(op.operands[0])
    lo = intrange.limits(dtype)[0]
    if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):  # two constants: folded exactly
        q = intrange.xla_divide(int(a), int(b), dtype, div)
        return Splat(q, dtype, _shape(op))
    if not isinstance(b, torch.Tensor):
        if b == 0:
            return Splat(intrange.all_ones(dtype), dtype, _shape(op)) if div else _fit(
                op, a if isinstance(a, torch.Tensor) else _scalar_tensor(a, op))
        if b == -1:
            return _fit(op, -a) if div else Splat(0, dtype, _shape(op))
    if not isinstance(a, torch.Tensor):
        a = _scalar_tensor(a, op)
    if not isinstance(b, torch.Tensor):
        return _fit(op, torch.div(a, b, rounding_mode="trunc") if div else torch.fmod(a, b))
    zero = intrange.contains(rb, 0)
    minus_one = dtype == "i64" and intrange.contains(rb, -1) and intrange.contains(ra, lo)
    if not zero and not minus_one:
        return _fit(op, torch.div(a, b, rounding_mode="trunc") if div else torch.fmod(a, b))
    guard = (b == 0) | (b == -1) if minus_one else b == 0
    d = torch.where(guard, torch.ones((), dtype=b.dtype), b)
    out = torch.div(a, d, rounding_mode="trunc") if div else torch.fmod(a, d)
    if minus_one:  # x / -1 == -x (MIN wraps to MIN), x % -1 == 0
        out = torch.where(b == -1, -a if div else torch.zeros((), dtype=out.dtype), out)
    if zero:
        out = torch.where(b == 0, torch.full((), intrange.all_ones(dtype), dtype=out.dtype) if div else a, out)
    return _fit(op, out)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's ``rotate_half``, written as the rope pattern writes it."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


HF_HEADS = (0, 2, 1, 3)  # logical [B, T, H, D] (Keras) = storage [B, H, T, D] (HF) .permute(HF_HEADS)


def _heads_first(v: Any) -> torch.Tensor:
    """A ``[B, T, H, D]`` value as HF's ``[B, H, T, D]`` tensor (``x.transpose(1, 2)``, or the split value's
    storage when it already is that)."""
    if isinstance(v, Stacked) and not v.stack_dims and tuple(v.perm) == HF_HEADS:
        return v.parts[()]
    return materialize(v).transpose(1, 2)


def _per_token(v: Any) -> torch.Tensor | None:
    """A cos/sin table ``[B, T, 1 (broadcast over heads), D]`` as HF's ``[B, 1, T, D]``; ``None`` if it differs
    per head."""
    if _splat(v) is not None:
        return None
    keep = bcast_source(v) if isinstance(v, Bcast) else materialize(v)
    if keep.dim() != 4 or keep.shape[2] != 1:
        return None
    return keep.transpose(1, 2)


def _rope(em: Emitter, op: Op, x: Value, cos: Value, sin: Value) -> Stacked | None:
    """Keras's RoPE on ``[B, T, H, D]`` as HF's ``x * cos + rotate_half(x) * sin`` on ``[B, H, T, D]`` (the
    same elementwise arithmetic, per element, in another layout); the result stays in HF's layout."""
    env = em_values(em)
    c, s = _per_token(env[id(cos)]), _per_token(env[id(sin)])
    if c is None or s is None:
        return None
    xh = _heads_first(env[id(x)])
    b, _, t, d = xh.shape
    for table in (c, s):
        if table.shape[0] not in (1, b) or table.shape[2] not in (1, t) or table.shape[3] != d:
            return None
    if tuple(c.shape) != (b, 1, t, d):  # Keras's tables are shared by the batch ([1, 1, T, D]): HF's are per row
        c = c.expand(b, 1, t, d)
    if tuple(s.shape) != (b, 1, t, d):
        s = s.expand(b, 1, t, d)
    out = (xh * c) + (_rotate_half(xh) * s)
    return Stacked({(): out}, _shape(op), (), HF_HEADS)


def _split_rope(em: Emitter, op: Op, x: Value, cos: Value, sin: Value) -> Stacked | None:
    """JAX's split-half RoPE (:func:`.layout_idioms.split_rope_of`) on ``[B, T, H, D]`` as HF's ``x * cos +
    rotate_half(x) * sin`` on ``[B, H, T, D]`` with the full tables ``cat((c, c), -1)`` (``[B, 1, T, D]``, built
    once per half table): the same products and sums per element; the result stays in HF's layout."""
    env = em_values(em)
    tables = []
    for v in (cos, sin):
        half = _per_token(env[id(v)])
        if half is None:
            return None
        key = ("half-table", id(v))  # the StableHLO value: alive as long as the module
        full = em._table_casts.get(key)
        if full is None:
            full = em._table_casts[key] = torch.cat((half, half), dim=-1)
        tables.append(full)
    c, s = tables
    xh = _heads_first(env[id(x)])
    b, _, t, d = xh.shape
    for table in (c, s):
        if table.shape[0] not in (1, b) or table.shape[2] not in (1, t) or table.shape[3] != d or \
                table.dtype != xh.dtype:
            return None
    if tuple(c.shape) != (b, 1, t, d):
        c = c.expand(b, 1, t, d)
    if tuple(s.shape) != (b, 1, t, d):
        s = s.expand(b, 1, t, d)
    out = (xh * c) + (_rotate_half(xh) * s)
    return Stacked({(): out}, _shape(op), (), HF_HEADS)


def _arrange(v: Any, labels: list[str], wanted: list[str]) -> torch.Tensor | None:
    """A value whose dims carry ``labels`` as a tensor with the ``wanted`` dims in that order (size-1 ``U`` dims
    dropped); a split value's storage is used as is when it already has that order."""
    if isinstance(v, Stacked) and len(v.parts) == 1:
        if any(not labels[d].startswith("U") for d in v.stack_dims):
            return None
        (t,) = v.parts.values()
        plabels = [lab for d, lab in enumerate(labels) if d not in v.stack_dims]
        tl = [""] * len(plabels)
        for i, p in enumerate(v.perm):
            tl[p] = plabels[i]
    else:
        t = materialize(v)
        tl = list(labels)
    if any(lab not in wanted and not lab.startswith("U") for lab in tl):
        return None
    if any(lab.startswith("U") for lab in tl):
        if any(t.shape[i] != 1 for i, lab in enumerate(tl) if lab.startswith("U")):
            return None
        t = t.reshape([n for n, lab in zip(t.shape, tl) if not lab.startswith("U")])
        tl = [lab for lab in tl if not lab.startswith("U")]
    pos = layout_idioms.label_positions(tl, wanted)
    return None if pos is None else permuted(t, tuple(pos))


def _repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """HF's ``repeat_kv``, written as the decode_attention pattern writes it."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def _attention(em: Emitter, op: Op, a: layout_idioms.Attention) -> Stacked | None:
    """jax.nn.dot_product_attention (Keras's) as HF's eager decode attention: ``repeat_kv``, ``q @ k^T * scale +
    mask``, ``softmax(fp32)``, ``@ v``, in ``[B, H, T, D]``. The boolean mask becomes the additive ``where(mask,
    0, fill)``: the same scores where it attends; where it does not, ``s + fill`` and ``fill`` (-2.4e38 from
    JAX, -1e9 from ``keras.layers.Softmax``) both give ``exp(. - max) == 0`` exactly as long as |s| < 1e8 and one
    position attends (a decode step always attends to its own position), so the probabilities are the same
    (Keras's second ``where`` that zeroes masked probabilities changes nothing then). bf16/fp16 q/k whose scores
    JAX keeps in fp32 through the softmax (jax.nn.dot_product_attention) become HF's SDPA call instead, whose
    matched rounding is the same (decode_attention's ``sdpa`` variant: fp32 scores, probabilities rounded once).
    The result stays in HF's layout (a split value).

    Grouped einsums (``btkgd,bskd->bkgts``, queries ``[B, T, KV, G, D]``) are HF's grouped-query attention with
    ``KV * G`` heads (head ``kv * G + g``) and ``repeat_kv(k, G)``: the same products. A ``-inf`` fill is
    ``finfo.min`` in the additive mask (``exp(. - max)`` is 0 for both, under the same condition; with no position
    attending JAX's ``-inf`` gives NaN, this form the mean of the values); a scale written
    as a division by a power of two is the multiplication by its (exact) reciprocal; a mask that does not vary
    over the batch or the query (``jnp.arange(L) <= pos``) is expanded to HF's ``[B, 1, T, L]``."""
    env = em_values(em)
    kl = layout_idioms.KV_LABELS
    grouped = "G" in a.q_labels
    tokens = "T" in a.q_labels  # else one query per sequence, without a dim for it (vmap'ed): a size-1 T
    wanted = ["B", "T", "H", "G", "D"] if grouped else ["B", "H", "T", "D"]
    q = _arrange(env[id(a.q)], a.q_labels, wanted if tokens else [lab for lab in wanted if lab != "T"])
    if q is not None and not tokens:
        q = q.unsqueeze(wanted.index("T"))
    k = _arrange(env[id(a.k)], kl, ["B", "H", "L", "D"])
    v = _arrange(env[id(a.v)], kl, ["B", "H", "L", "D"])
    if q is None or k is None or v is None or q.dtype != _dtype(op) or k.dtype != q.dtype or v.dtype != q.dtype:
        return None
    if grouped:  # [B, T, KV, G, D] -> HF's [B, KV * G, T, D] (``q.view(B, T, heads, D).transpose(1, 2)``)
        b_, t_, kv_, g_, d_ = q.shape
        q = q.reshape(b_, t_, kv_ * g_, d_).transpose(1, 2)
    # HF's eager form computes the scores in q's dtype; jax.nn.dot_product_attention (keras Llama) keeps bf16/fp16
    # q/k's scores in fp32 up to the probabilities (rounded once to q's dtype): that is SDPA's ("fused") rounding
    fp32_scores = q.dtype != torch.float32 and a.score_dtype == "f32" and a.softmax_dtype == "f32" and \
        not a.scores_converted and a.probs_dtype != "f32" and torch_dtype(a.probs_dtype) == q.dtype
    if torch_dtype(a.score_dtype) != q.dtype and not fp32_scores:
        return None
    fill = torch.finfo(q.dtype).min if a.fill == -math.inf else a.fill
    if not math.isfinite(fill) or fill > -1e9 or id(a.pred) not in env:
        return None
    pv = env[id(a.pred)]
    if _splat(pv) is not None:
        return None
    keep = bcast_source(pv) if isinstance(pv, Bcast) else materialize(pv)
    if keep.dtype != torch.bool or keep.dim() != len(a.mask_labels) or \
            any(keep.shape[d] != 1 for d, lab in enumerate(a.mask_labels) if lab in ("H", "G") or lab.startswith("U")):
        return None
    labels = ["U" if lab in ("H", "G") else lab for lab in a.mask_labels]
    for lab in ("T", "B"):  # the same for every sequence / query: size-1 dims
        if lab not in labels:
            keep, labels = keep.unsqueeze(0), [lab] + labels
    m = _arrange(keep, labels, ["B", "T", "L"])
    if m is None or m.shape[2] != k.shape[2] or m.shape[0] not in (1, q.shape[0]) or m.shape[1] not in (1, q.shape[2]):
        return None
    if tuple(m.shape[:2]) != (q.shape[0], q.shape[2]):
        m = m.expand(q.shape[0], q.shape[2], m.shape[2])
    key_states = _repeat_kv(k, a.groups * a.q_groups)
    value_states = _repeat_kv(v, a.groups * a.q_groups)
    if fp32_scores:  # HF's SDPA call with its boolean mask (True = attend): -inf where JAX fills -2.4e38, both 0
        out = F.scaled_dot_product_attention(q, key_states, value_states, attn_mask=m[:, None], dropout_p=0.0,
                                             scale=a.scale, is_causal=False)
    else:
        mask = torch.where(m, torch.zeros((), dtype=q.dtype), torch.full((), fill, dtype=q.dtype))[:, None]
        attn_weights = torch.matmul(q, key_states.transpose(2, 3)) * a.scale
        attn_weights = attn_weights + mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(attn_weights, value_states)
    storage = ["B", "H", "T", "D"]
    if grouped:  # HF's ``attn_output.transpose(1, 2)``, its heads back into the einsum's (KV, G)
        out = out.transpose(1, 2).reshape(b_, t_, kv_, g_, d_)
        storage = ["B", "T", "H", "G", "D"]
    if not tokens:
        out = out.squeeze(storage.index("T"))
        storage = [lab for lab in storage if lab != "T"]
    sd = tuple(d for d, lab in enumerate(a.out_labels) if lab.startswith("U"))
    plabels = [lab for lab in a.out_labels if not lab.startswith("U")]
    perm = tuple(storage.index(lab) for lab in plabels)
    return Stacked({(0,) * len(sd): out}, _shape(op), sd, perm)


def _value_of(em: Emitter, op: Op, v: Value) -> torch.Tensor:
    """The tensor of a StableHLO value an idiom refers to (already emitted: it precedes ``op``)."""
    return em_values(em)[id(v)]


def em_values(em: Emitter) -> dict:
    return em._values  # type: ignore[attr-defined]


def _mean(em: Emitter, op: Op, vals: list, r: Op) -> Any:
    src = em_values(em)[id(r.result)]
    reduced = src.src if isinstance(src, Bcast) and isinstance(src.src, Reduced) else src
    if not isinstance(reduced, Reduced):  # the reshape form of keepdims: compute the mean and reshape
        red = Reduced("mean", materialize(em_values(em)[id(r.operands[0])]), tuple(r.attrs["dimensions"]), None,
                      r.result.type.shape)
        return materialize(red).reshape(_shape(op))
    mean = Reduced("mean", reduced.src, reduced.dims, None, reduced.shape)
    num = vals[0]
    if isinstance(num, Bcast) and num.src is reduced:
        return Bcast(mean, num.shape, num.dims)
    return mean


def _softmax(em: Emitter, op: Op, found: tuple[Value, int]) -> Any:
    x, dim = found
    t = materialize(em_values(em)[id(x)])
    return torch.softmax(t, dim - t.dim())


def _rounded_softmax(em: Emitter, op: Op, found: tuple[Value, int]) -> Any:
    """A bf16/fp16 softmax rounded after each op (:func:`.idioms.rounded_softmax_of`) in one canonical ATen
    spelling, the ``rounded`` variant of the ``moe_router`` pattern: ``amax`` with ``keepdim`` (exact, where the
    StableHLO has ``max(-inf, reduce_max)`` and a broadcast), then the same ops in the same dtypes."""
    x, dim = found
    t = materialize(em_values(em)[id(x)])
    d = dim - t.dim()
    e = torch.exp(t - t.amax(d, keepdim=True))
    return e / e.float().sum(d, keepdim=True).to(e.dtype)


_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "stablehlo.negate": operator.neg, "stablehlo.exponential": torch.exp, "stablehlo.exponential_minus_one": torch.expm1,
    "stablehlo.log": torch.log, "stablehlo.log_plus_one": torch.log1p, "stablehlo.sqrt": torch.sqrt,
    "stablehlo.rsqrt": torch.rsqrt, "stablehlo.cbrt": lambda x: torch.sign(x) * torch.abs(x).pow(1.0 / 3.0),
    "stablehlo.tanh": torch.tanh, "stablehlo.logistic": torch.sigmoid, "stablehlo.sine": torch.sin,
    "stablehlo.cosine": torch.cos, "stablehlo.tan": torch.tan, "chlo.tan": torch.tan, "stablehlo.abs": torch.abs,
    "stablehlo.sign": torch.sign, "stablehlo.floor": torch.floor, "stablehlo.ceil": torch.ceil,
    "stablehlo.round_nearest_even": torch.round,
    "stablehlo.round_nearest_afz": lambda x: torch.sign(x) * torch.floor(torch.abs(x) + 0.5),
    "stablehlo.is_finite": torch.isfinite, "chlo.erf": torch.erf, "chlo.erf_inv": torch.erfinv,
    "chlo.lgamma": torch.lgamma, "chlo.digamma": torch.digamma, "chlo.square": lambda x: x.pow(2),
}


def _rope_table(em: Emitter, op: Op) -> Any:
    """keras-hub's rotary table as HF's (the rope_tables pattern): ``freqs = pos[..., None].float() * inv_freq``
    with ``pos = arange(T) + start`` (Keras adds them in f32: the same values below 2**24), ``cat(freqs, freqs)``,
    ``cos``/``sin`` (``* 1.0``: HF's ``attention_scaling``). Tables with the same inputs are computed once."""
    key, table, inv_freq = em.tables[id(op)]
    memo = em._table_memo.get(key)
    if memo is None:
        start = em_values(em)[id(table.start)]
        s = _splat(start)
        start_t = int(s.value) if s is not None else materialize(start).to(torch.int64)
        position_ids = (torch.arange(table.tokens, dtype=torch.int64) + start_t).unsqueeze(0)
        freqs = position_ids[..., None].float() * inv_freq.to(dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * 1.0
        sin = emb.sin() * 1.0
        memo = em._table_memo[key] = (cos.to(dtype=torch.float32), sin.to(dtype=torch.float32))
    out = memo[0] if op.name == "stablehlo.cosine" else memo[1]
    return out if tuple(table.dims) == tuple(range(len(_shape(op)))) else Bcast(out, _shape(op), table.dims)


def _table_cast(em: Emitter, op: Op, src: Any) -> Any:
    """A rotary table cast to the activations' dtype (Keras under a bf16 policy): HF's ``cos.to(dtype=x.dtype)``
    on the table itself, before its broadcast (elementwise: the same values), once per table and dtype."""
    t = src.src if isinstance(src, Bcast) else src
    if not isinstance(t, torch.Tensor) or not any(t is m for memo in em._table_memo.values() for m in memo):
        return None
    dtype = _dtype(op)
    key = (id(t), dtype)
    cast = em._table_casts.get(key)
    if cast is None:
        cast = em._table_casts[key] = t.to(dtype=dtype)
    return Bcast(cast, src.shape, src.dims) if isinstance(src, Bcast) else cast


@handles(*_UNARY, "stablehlo.not")
def _unary(em: Emitter, op: Op, vals: list) -> Any:
    (src,) = vals
    if id(op) in em.tables:
        return _rope_table(em, op)
    s = _splat(src)
    if s is not None and op.name == "stablehlo.negate":
        return _fold(op, np.negative, s)
    x = elementwise_operand(src, _rank(op))
    if not isinstance(x, torch.Tensor):
        x = _scalar_tensor(x, op) if op.name != "stablehlo.is_finite" else torch.full((), x)
    if op.name == "stablehlo.not":
        return _fit(op, torch.logical_not(x) if x.dtype == torch.bool else torch.bitwise_not(x))
    return _fit(op, _UNARY[op.name](x))


_COMPARE = {"EQ": operator.eq, "NE": operator.ne, "LT": operator.lt, "LE": operator.le, "GT": operator.gt,
            "GE": operator.ge}
_MIRROR = {"EQ": "EQ", "NE": "NE", "LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE"}


@handles("stablehlo.compare")
def _compare(em: Emitter, op: Op, vals: list) -> Any:
    direction = op.attrs["comparison_direction"]
    a, b = _binary_operands(op, vals)
    if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        return Splat(bool(_COMPARE[direction](a, b)), "i1", _shape(op))
    if not isinstance(a, torch.Tensor):
        a, b, direction = b, a, _MIRROR[direction]
    return _fit(op, _COMPARE[direction](a, b))


@handles("stablehlo.select")
def _select(em: Emitter, op: Op, vals: list) -> Any:
    pred, on_true, on_false = vals
    sp = _splat(pred)
    if sp is not None:
        chosen = on_true if sp.value else on_false
        return Splat(chosen.value, chosen.dtype, _shape(op)) if _splat(chosen) is not None else _fit(
            op, elementwise_operand(chosen, _rank(op)))
    c, a, b = elementwise_operands([pred, on_true, on_false], _shape(op))
    if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        a = torch.zeros((), dtype=_dtype(op)) if a == 0 else _scalar_tensor(a, op)
    return _fit(op, torch.where(c, a, b))


@handles("stablehlo.clamp")
def _clamp(em: Emitter, op: Op, vals: list) -> Any:
    lo, t, hi = elementwise_operands(list(vals), _shape(op))
    if not isinstance(t, torch.Tensor):
        t = _scalar_tensor(t, op)
    if isinstance(lo, torch.Tensor) != isinstance(hi, torch.Tensor):  # torch.clamp takes two numbers or two tensors
        lo, hi = (b if isinstance(b, torch.Tensor) else torch.full((), b, dtype=t.dtype) for b in (lo, hi))
    return _fit(op, torch.clamp(t, lo, hi))


# ---- reductions and contractions ----------------------------------------------------------------------------
_IDENTITY = {"sum": 0, "prod": 1, "all": True, "any": False}


@handles("stablehlo.reduce")
def _reduce(em: Emitter, op: Op, vals: list) -> Any:
    kind = idioms.reduce_kind(op)
    if kind == "sum" and tuple(op.attrs["dimensions"]) == (0,):
        experts = layout_idioms.dense_experts_of(em.module, op)
        out = _dense_experts(em, op, experts) if experts is not None else None
        if out is not None:
            return out
    if kind is None:
        found = _argmax(em, op, vals)
        if found is not None:
            return found
        raise UnsupportedOp(op.name, "reduction body other than add/max/min/mul/and/or or arg-max/min")
    src, init = vals
    si = _splat(init)
    if si is None:
        raise UnsupportedOp(op.name, "non-constant initial value")
    dims = tuple(op.attrs["dimensions"])
    t = materialize(src)
    if not dims:
        return t
    init_value = si.value
    if kind in _IDENTITY and init_value == _IDENTITY[kind]:
        init_value = None
    elif kind in ("max", "min") and (math.isinf(init_value) if isinstance(init_value, float) else
                                     init_value in (torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max,
                                                    -2 ** 31, 2 ** 31 - 1)):
        init_value = None  # -inf / +inf (or the int extremes): the reduction's identity
    return Reduced(kind, t, dims, init_value, _shape(op))


def _dense_experts(em: Emitter, op: Op, e: layout_idioms.DenseExperts) -> torch.Tensor | None:
    """keras-hub's dense experts (every expert on every token, routing weights 0 for the others) as HF's top-k
    ``batched_mm`` experts: the chosen experts' ``down(silu(gate x) * up x)`` weighted by the top-k weights and
    summed. The same value: an expert that is not chosen adds ``0 * y`` (an exact zero for finite ``y``), and
    with top-2 the two remaining terms are summed once (in either order: exact). Only for top-k <= 2. In bf16
    ``op`` is the convert after the fp32 sum: HF's bf16 ``sum`` (fp32 accumulation, one rounding)."""
    env = em_values(em)
    gate, down = env.get(id(e.gate)), env.get(id(e.down))
    if not (isinstance(gate, ExpertWeight) and isinstance(down, ExpertWeight)) or gate.kind != "gate" or \
            down.kind != "down":
        return None
    x = materialize(env[id(e.x)])
    indices, weights = materialize(env[id(e.indices)]), materialize(env[id(e.weights)])
    if indices.shape[-1] > 2 or indices.dtype != torch.int64 or weights.dtype != x.dtype or \
            x.dtype != gate.t.dtype or x.dtype != _dtype(op):
        return None
    gate_up_proj, down_proj = gate.t, down.t
    num_top_k = indices.size(-1)
    num_tokens = x.size(0)
    hidden_dim = x.size(-1)
    selected_hidden_states = x.repeat_interleave(num_top_k, dim=0)
    sample_weights = weights.reshape(-1)
    expert_ids = indices.reshape(-1)
    proj_out = torch.bmm(gate_up_proj[expert_ids], selected_hidden_states.unsqueeze(-1)).squeeze(-1)
    g, up = proj_out.chunk(2, dim=-1)
    proj_out = F.silu(g) * up
    proj_out = torch.bmm(down_proj[expert_ids], proj_out.unsqueeze(-1)).squeeze(-1)
    weighted_out = proj_out * sample_weights.unsqueeze(-1)
    final = weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
    return final.to(x.dtype)


def _argmax(em: Emitter, op: Op, vals: list) -> list | None:
    """``jnp.argmax/argmin``: a 2-operand reduce of (x, iota along the reduced dim) whose body keeps the larger
    (smaller) value and, on ties, the lower index; returns (max values, indices)."""
    if len(op.operands) != 4 or len(op.attrs["dimensions"]) != 1 or not op.regions:
        return None
    dim = op.attrs["dimensions"][0]
    iota = idioms.producer(op.operands[1], "stablehlo.iota", through_broadcast=True)
    if iota is None:
        bc = op.operands[1].producer
        if bc is None or bc.name != "stablehlo.broadcast_in_dim":
            return None
    directions = [o.attrs.get("comparison_direction") for o in op.regions[0].ops if o.name == "stablehlo.compare"]
    if "GT" in directions:
        largest = True
    elif "LT" in directions:
        largest = False
    else:
        return None
    x = materialize(vals[0])
    d = dim - x.dim()
    idx = torch.argmax(x, d) if largest else torch.argmin(x, d)
    values = torch.amax(x, d) if largest else torch.amin(x, d)
    return [values, idx.to(torch_dtype(op.results[1].type))]


@handles("stablehlo.dot_general")
def _dot_general(em: Emitter, op: Op, vals: list) -> Any:
    att = layout_idioms.attention_of(em.module, op)
    if att is not None:
        out = _attention(em, op, att)
        if out is not None:
            return out
    dn = op.attrs["dot_dimension_numbers"]
    lb, rb = dn["lhs_batch"], dn["rhs_batch"]
    lc, rc = sorted_contraction(dn["lhs_contract"], dn["rhs_contract"])
    out_dtype = _dtype(op)
    lhs_v, rhs_v = vals
    lrank, rrank = len(op.operands[0].type.shape), len(op.operands[1].type.shape)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == out_dtype else t.to(out_dtype)

    if isinstance(rhs_v, Transposed) and not lb and rc == tuple(range(len(rc))) and \
            lc == tuple(range(lrank - len(lc), lrank)):
        # x[..., K...] @ W[K..., N...] with the program holding W as [N, K]: HF's linear (+ reshapes)
        x = cast(materialize(lhs_v))
        k = rhs_v.t.shape[1]
        lead = list(x.shape[:lrank - len(lc)])
        x2 = x if len(lc) == 1 else x.reshape(lead + [k])
        out = F.linear(x2, cast(rhs_v.t))
        return out if tuple(out.shape) == _shape(op) else out.reshape(_shape(op))
    if not lb and not rb and len(lc) == 1 and lc[0] == lrank - 1 and rrank == 2 and len(rc) == 1 and lrank >= 1:
        x = cast(materialize(lhs_v))
        w = cast(materialize(rhs_v))
        if rc[0] == 1:
            return F.linear(x, w)
        return torch.matmul(x, w)
    if not lb and not rb and lrank == 2 and lc == (1,) and len(rc) == 1 and rc[0] == rrank - 1 and \
            not isinstance(lhs_v, Transposed):
        # W[N, K] . x[..., K] (Equinox's ``weight @ x``: the weight on the left, HF's layout): ``linear(x, W)``,
        # its N dim moved to the front where x has more than one dim
        out = F.linear(cast(materialize(rhs_v)), cast(materialize(lhs_v)))
        return out if rrank == 1 else out.movedim(-1, 0)
    nb = len(lb)
    lhs = cast(materialize(lhs_v))
    rhs = cast(materialize(rhs_v))
    if lb == rb == tuple(range(nb)) and lrank == nb + 2 and rrank == nb + 2 and lc == (nb + 1,):
        if rc == (nb,):
            return torch.matmul(lhs, rhs)
        if rc == (nb + 1,):
            return torch.matmul(lhs, rhs.transpose(-1, -2))
    # general: [batch, free, contract] x [batch, contract, free] as one bmm
    lfree = [d for d in range(lrank) if d not in lb and d not in lc]
    rfree = [d for d in range(rrank) if d not in rb and d not in rc]
    bshape = [lhs.shape[d] for d in lb]
    m = math.prod(lhs.shape[d] for d in lfree)
    k = math.prod(lhs.shape[d] for d in lc)
    n = math.prod(rhs.shape[d] for d in rfree)
    b = math.prod(bshape)
    a3 = lhs.permute([*lb, *lfree, *lc]).reshape(b, m, k)
    b3 = rhs.permute([*rb, *rc, *rfree]).reshape(b, k, n)
    return torch.bmm(a3, b3).reshape(_shape(op))


def sorted_contraction(lc: Sequence[int], rc: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Contracting dim pairs ordered by the right operand's dims (``[3, 2] x [1, 0]`` is ``[2, 3] x [0, 1]``:
    the pairs, not their order, define the contraction)."""
    pairs = sorted(zip(rc, lc))
    return tuple(p[1] for p in pairs), tuple(p[0] for p in pairs)


# ---- indexing -----------------------------------------------------------------------------------------------
def _int_tensor(v: Any) -> torch.Tensor:
    if isinstance(v, (Splat,)) or _splat(v) is not None:
        return torch.full((), int(_splat(v).value), dtype=torch.int64)
    return materialize(v)


def _start(v: Any, limit: int) -> Any:
    """A dynamic start index clamped like StableHLO does (so the slice fits): an int for constants."""
    s = _splat(v)
    if s is not None:
        return min(max(int(s.value), 0), limit)
    t = materialize(v).to(torch.int64) if materialize(v).dtype != torch.int64 else materialize(v)
    return torch.clamp(t, 0, limit)


@handles("stablehlo.dynamic_slice")
def _dynamic_slice(em: Emitter, op: Op, vals: list) -> Any:
    src, *starts = vals
    sizes = op.attrs["slice_sizes"]
    if isinstance(src, torch.Tensor) and src.dim() == 2 and op.operands[0].producer is None and \
            tuple(sizes) == (1, src.shape[1]) and _splat(starts[1]) is not None:
        # one row of a [V, H] argument (Equinox's ``embedding.weight[token]``): the embedding lookup, as for a
        # gather of rows (the start clamped like XLA's; embedding's indices [1, 1])
        rows = _start(starts[0], src.shape[0] - 1)
        rows = torch.full((1, 1), rows, dtype=torch.int64) if isinstance(rows, int) else rows.reshape(1, 1)
        return F.embedding(rows, src).reshape(_shape(op))
    t = materialize(src)
    for d, (s, size) in enumerate(zip(starts, sizes)):
        full = t.shape[d]
        if size == full:
            continue
        st = _start(s, full - size)
        if isinstance(st, int):
            t = t.narrow(d, st, size)
        else:
            t = torch.index_select(t, d, st.reshape(1) + torch.arange(size))
    return t


@handles("stablehlo.dynamic_update_slice")
def _dynamic_update_slice(em: Emitter, op: Op, vals: list) -> Any:
    """A cache write ``dynamic_update_slice(cache, new, 0, 0, pos, 0)`` becomes ``index_copy(cache, 2, pos,
    new)``: the functional form of HF's ``cache.index_copy_`` that fusegraph turns into an in-place state write."""
    src, upd, *starts = vals
    if isinstance(src, Stacked) and not src.stack_dims:
        out = _stacked_update(src, upd, starts)
        if out is not None:
            return out
    t = materialize(src)
    u = materialize(upd)
    if u.dtype != t.dtype:
        u = u.to(t.dtype)
    moving = [d for d in range(t.dim()) if u.shape[d] != t.shape[d]]
    if not moving:
        return u.clone()
    index = []
    for d in moving:
        st = _start(starts[d], t.shape[d] - u.shape[d])
        n = u.shape[d]
        if isinstance(st, int):
            index.append(torch.arange(st, st + n))
        else:
            index.append(st.reshape(1) if n == 1 else st.reshape(1) + torch.arange(n))
    if len(moving) == 1:
        return torch.index_copy(t, moving[0], index[0], u)
    grids: list = [slice(None)] * t.dim()
    shape_all = [1] * t.dim()
    for j, d in enumerate(moving):
        shp = list(shape_all)
        shp[d] = u.shape[d]
        grids[d] = index[j].reshape(shp)
    full = [torch.arange(t.shape[d]).reshape([t.shape[d] if i == d else 1 for i in range(t.dim())])
            if d not in moving else grids[d] for d in range(t.dim())]
    return torch.index_put(t, tuple(full), u)


def _stacked_update(src: Stacked, upd: Any, starts: list) -> Stacked | None:
    """``slice_update`` of one row range of a split cache part: ``index_copy`` on the part's storage tensor, at
    the dim that holds the moving logical dim (``[B, L, KV, D]`` dim 1 -> ``[B, KV, L, D]`` dim 2)."""
    (part,) = src.parts.values()
    if isinstance(upd, Stacked) and not upd.stack_dims and upd.perm == src.perm:
        u_storage, u, ushape = upd.parts[()], None, tuple(upd.shape)  # already in the part's layout
    else:
        u_storage, u = None, materialize(upd)
        ushape = tuple(u.shape)
    moving = [d for d in range(len(src.shape)) if ushape[d] != src.shape[d]]
    if len(moving) != 1:
        return None
    d = moving[0]
    st = _start(starts[d], src.shape[d] - ushape[d])
    n = ushape[d]
    if isinstance(st, int):
        index = torch.arange(st, st + n)
    else:
        index = st.reshape(1) if n == 1 else st.reshape(1) + torch.arange(n)
    value = stacked.to_storage(src, u) if u_storage is None else u_storage
    new = torch.index_copy(part, stacked.storage_dim(src, d), index,
                           value if value.dtype == part.dtype else value.to(part.dtype))
    return Stacked({(): new}, src.shape, (), src.perm)


def _scatter_kind(op: Op) -> str | None:
    """``replace`` (the update computation returns the update: ``x.at[i].set(v)``) or ``add`` (``.at[i].add``)."""
    body = op.regions[0] if op.regions else None
    if body is None or len(body.args) != 2 or len(body.returns) != 1:
        return None
    if intrange._scatter_replaces(op):
        return "replace"
    if len(body.ops) == 1 and body.ops[0].name == "stablehlo.add" and body.returns[0] is body.ops[0].result and \
            {id(o) for o in body.ops[0].operands} == {id(a) for a in body.args}:
        return "add"
    return None


def _clamped_within(op: Op, limits: Sequence[int]) -> bool:
    """Are the scatter indices (operand 1) ``clamp(lo, x, hi)`` with constant bounds that keep every start index
    ``c`` (along the index vector dim) within ``[0, limits[c]]``? (How ``jax.vmap`` writes a batched
    ``dynamic_update_slice``: XLA clamps its starts, a scatter would drop the window instead, so the batching rule
    clamps them first.)"""
    clamp = idioms.producer(op.operands[1], "stablehlo.clamp")
    if clamp is None:
        return False
    lo, hi = idioms.static_array(clamp.operands[0]), idioms.static_array(clamp.operands[2])
    shape = tuple(op.operands[1].type.shape)
    if lo is None or hi is None:
        return False
    ivd = op.attrs["scatter_dimension_numbers"]["index_vector_dim"]
    lo, hi = np.broadcast_to(lo, shape), np.broadcast_to(hi, shape)
    if ivd == len(shape):
        lo, hi = lo[..., None], hi[..., None]
    else:
        lo, hi = np.moveaxis(lo, ivd, -1), np.moveaxis(hi, ivd, -1)
    if lo.size == 0:
        return True
    return all(int(lo[..., c].min()) >= 0 and int(hi[..., c].max()) <= limit for c, limit in enumerate(limits))


@handles("stablehlo.scatter")
def _scatter(em: Emitter, op: Op, vals: list) -> Any:
    """StableHLO's ``scatter`` with XLA's semantics: each update window is written (or added) whole when its start
    indices keep it inside the operand, and dropped otherwise (``jnp``'s ``x.at[i].set(v)`` and ``.add``, and a
    ``dynamic_update_slice`` under ``jax.vmap``). One row written at one position (``cache.at[pos].set(k)``)
    becomes ``index_copy`` at the clamped position of ``where(in bounds, new, old row)`` (the functional form of a
    cache write, see ``_dynamic_update_slice``); any other scatter ``index_put`` over index grids (the dropped
    windows sent to one extra element past the end, cut off again), or straight when the starts are clamped into
    range (``jax.vmap``'s form)."""
    kind = _scatter_kind(op)
    if len(op.operands) != 3 or kind is None:
        raise UnsupportedOp(op.name, "scatter other than one operand replaced or added to")
    dn = op.attrs["scatter_dimension_numbers"]
    oshape, ishape, ushape = (tuple(o.type.shape) for o in op.operands)
    uwd, iwd, ibd = dn["update_window_dims"], dn["inserted_window_dims"], dn["input_batching_dims"]
    sibd, sd2od, ivd = dn["scatter_indices_batching_dims"], dn["scatter_dims_to_operand_dims"], dn["index_vector_dim"]
    if isinstance(vals[0], Stacked) and not vals[0].stack_dims and stacked._row_write_dim(op, op.operands[0]) \
            is not None and kind == "replace":  # one position of a cache kept in HF's layout
        return _stacked_row_write(op, vals[0], vals[1], vals[2])
    if isinstance(vals[0], Stacked) and not vals[0].stack_dims and kind == "replace":
        out = _stacked_batched_write(op, vals[0], vals[1], vals[2])  # vmap's write of a cache in HF's layout
        if out is not None:
            return out
    t = materialize(vals[0])
    u = materialize(vals[2])
    if u.dtype != t.dtype:
        u = u.to(t.dtype)
    window_dims = [d for d in range(len(oshape)) if d not in iwd and d not in ibd]  # operand dims of uwd, in order
    wsize = {d: (1 if d in iwd or d in ibd else ushape[uwd[window_dims.index(d)]]) for d in range(len(oshape))}
    limits = [oshape[d] - wsize[d] for d in sd2od]  # the largest start that keeps the window inside
    scatter_dims = [d for d in range(len(ushape)) if d not in uwd]  # update dims that index the scatter indices
    si = _splat(vals[1])
    idx = torch.full(ishape, int(si.value), dtype=torch.int64) if si is not None else materialize(vals[1])
    if idx.dtype != torch.int64:
        idx = idx.to(torch.int64)
    idx = idx.unsqueeze(-1) if ivd == len(ishape) else idx if ivd == len(ishape) - 1 else idx.movedim(ivd, -1)
    batch_shape = tuple(idx.shape[:-1])
    if kind == "replace" and not ibd and len(sd2od) == 1 and math.prod(batch_shape) == 1 and \
            all(wsize[d] == oshape[d] for d in range(len(oshape)) if d != sd2od[0]):
        start = Splat(si.value, "i64", ()) if si is not None else idx.reshape(())
        return _row_write(t, u.reshape([wsize[d] for d in range(len(oshape))]), sd2od[0], start, limits[0])

    def place(x: torch.Tensor, positions: list[int]) -> torch.Tensor:
        shape = [1] * len(ushape)
        for p, s in zip(positions, x.shape):
            shape[p] = s
        return x.reshape(shape)

    idx_dims = [d for d in range(len(ishape)) if d != ivd]
    grids = []
    for d in range(len(oshape)):
        g: Any = None
        if d in sd2od:
            g = place(idx[..., sd2od.index(d)], scatter_dims)
        if d in ibd:
            pos = idx_dims.index(sibd[ibd.index(d)])
            g = place(torch.arange(batch_shape[pos]), [scatter_dims[pos]])
        if d in window_dims:
            w = place(torch.arange(wsize[d]), [uwd[window_dims.index(d)]])
            g = w if g is None else g + w
        grids.append(g if g is not None else torch.zeros((), dtype=torch.int64))
    accumulate = kind == "add"
    if _clamped_within(op, limits):
        return torch.index_put(t, tuple(grids), u, accumulate=accumulate)
    valid = None
    for c, limit in enumerate(limits):
        s = idx[..., c]
        ok = (s >= 0) & (s <= limit)
        valid = ok if valid is None else valid & ok
    linear = grids[-1]
    stride = 1
    for d in range(len(oshape) - 2, -1, -1):
        stride *= oshape[d + 1]
        linear = linear + grids[d] * stride
    n = math.prod(oshape)
    if valid is not None:
        linear = torch.where(place(valid, scatter_dims), linear, n)  # a dropped window: the element past the end
    flat = torch.cat((t.reshape(-1), t.new_zeros(1)))
    flat = torch.index_put(flat, (linear,), u, accumulate=accumulate)
    return flat[:n].reshape(oshape)


def _stacked_batched_write(op: Op, src: Stacked, index: Any, upd: Any) -> Stacked | None:
    """A ``jax.vmap``'ed ``dynamic_update_slice`` (each sequence's rows at its own position, the starts clamped
    into range) on the storage of a split cache: ``index_put`` at (sequence, position) over the storage dims."""
    d = stacked.batched_row_write_dim(op, op.operands[0])
    dn = op.attrs["scatter_dimension_numbers"]
    if d is None or dn["index_vector_dim"] != len(op.operands[1].type.shape) - 1 or \
            len(op.operands[1].type.shape) != 2:
        return None
    ushape = op.operands[2].type.shape
    limits = [src.shape[x] - (ushape[dn["update_window_dims"][x - 1]]) for x in dn["scatter_dims_to_operand_dims"]]
    if not _clamped_within(op, limits):
        return None
    (part,) = src.parts.values()
    u = stacked.to_storage(src, materialize(upd))  # [B, n, KV, D] -> the storage's [B, KV, n, D]
    starts = materialize(index).to(torch.int64)
    pos = starts[:, dn["scatter_dims_to_operand_dims"].index(d)]
    n = ushape[dn["update_window_dims"][d - 1]]
    sd = stacked.storage_dim(src, d)
    grids = []
    for k in range(part.dim()):
        shape = [1] * part.dim()
        shape[k] = u.shape[k]
        if k == 0:
            grids.append(torch.arange(part.shape[0]).reshape(shape))
        elif k == sd:
            grids.append((pos.reshape([-1] + [1] * (part.dim() - 1)) + torch.arange(n).reshape(shape)))
        else:
            grids.append(torch.arange(part.shape[k]).reshape(shape))
    new = torch.index_put(part, tuple(grids), u if u.dtype == part.dtype else u.to(part.dtype))
    return Stacked({(): new}, src.shape, (), src.perm)


def _stacked_row_write(op: Op, src: Stacked, index: Any, upd: Any) -> Stacked:
    """:func:`_row_write` on the storage of a split cache (``[B, L, KV, D]`` held as ``[B, KV, L, D]``)."""
    d = stacked._row_write_dim(op, op.operands[0])
    (part,) = src.parts.values()
    dn = op.attrs["scatter_dimension_numbers"]
    window = [w for w in range(len(src.shape)) if w not in dn["inserted_window_dims"]]
    shape = list(src.shape)
    shape[d] = 1 if d not in window else op.operands[2].type.shape[dn["update_window_dims"][window.index(d)]]
    u = materialize(upd).reshape(shape)
    u = stacked.to_storage(src, u)
    si = _splat(index)
    start = Splat(si.value, "i64", ()) if si is not None else materialize(index).reshape(()).to(torch.int64)
    new = _row_write(part, u if u.dtype == part.dtype else u.to(part.dtype), stacked.storage_dim(src, d), start,
                     src.shape[d] - shape[d])
    return Stacked({(): new}, src.shape, (), src.perm)


def _row_write(t: torch.Tensor, u: torch.Tensor, d: int, start: torch.Tensor, limit: int) -> torch.Tensor:
    """``t.at[.., start, ..].set(u)`` (``u`` spans dim ``d`` with ``n`` rows, every other dim whole): the rows at the
    clamped start, with the old rows written back when ``start`` is outside ``[0, limit]`` (XLA drops the window)."""
    n = u.shape[d]
    sp = _splat(start)
    if sp is not None:  # a constant position: written, or dropped when outside
        s0 = int(sp.value)
        return torch.index_copy(t, d, torch.arange(s0, s0 + n), u) if 0 <= s0 <= limit else t.clone()
    st = _start(start, limit)
    index = st.reshape(1) if n == 1 else st.reshape(1) + torch.arange(n)
    s = materialize(start)
    valid = (s >= 0) & (s <= limit)
    u = torch.where(valid, u, torch.index_select(t, d, index))
    return torch.index_copy(t, d, index, u)


@handles("stablehlo.gather")
def _gather(em: Emitter, op: Op, vals: list) -> Any:
    operand_v, indices_v = vals
    dn = op.attrs["dimension_numbers"]
    sizes = tuple(op.attrs["slice_sizes"])
    oshape = op.operands[0].type.shape
    ishape = op.operands[1].type.shape
    ivd = dn["index_vector_dim"]
    out_shape = _shape(op)
    idx = _int_tensor(indices_v)
    if idx.dtype != torch.int64:
        idx = idx.to(torch.int64)
    if ivd == len(ishape):
        idx = idx.unsqueeze(-1)
    elif ivd != len(ishape) - 1:
        idx = idx.movedim(ivd, -1)
    batch_shape = tuple(idx.shape[:-1])
    # the embedding lookup: rows of a [V, H] table (also a vmap'ed ``table[token]``, whose gather keeps the row dim
    # and starts the column at 0: a whole row's start is clamped to 0 by the gather itself)
    collapsed = dn["collapsed_slice_dims"]
    if (len(oshape) == 2 and collapsed in ((0,), ()) and dn["start_index_map"] in ((0,), (0, 1))
            and sizes == (1, oshape[1]) and not dn["operand_batching_dims"]
            and dn["offset_dims"] == tuple(range(len(batch_shape), len(batch_shape) + 2 - len(collapsed)))):
        rows = torch.clamp(idx[..., dn["start_index_map"].index(0)], 0, oshape[0] - 1)
        if len(batch_shape) < 2:  # one token, or one per sequence: embedding's [B, S] indices
            rows = rows.reshape(-1, 1)
            return F.embedding(rows, materialize(operand_v)).reshape(out_shape)
        out = F.embedding(rows, materialize(operand_v))
        return out if tuple(out.shape) == out_shape else out.reshape(out_shape)
    operand = materialize(operand_v)
    out_rank = len(out_shape)
    offset_dims = dn["offset_dims"]
    batch_out = [d for d in range(out_rank) if d not in offset_dims]
    window = [d for d in range(len(oshape)) if d not in dn["collapsed_slice_dims"] and d not in dn["operand_batching_dims"]]
    idx_dims = [d for d in range(len(ishape)) if d != ivd]  # indices dims in batch order

    def place(t: torch.Tensor, positions: list[int]) -> torch.Tensor:
        shape = [1] * out_rank
        for p, s in zip(positions, t.shape):
            shape[p] = s
        return t.reshape(shape)

    grids = []
    for d in range(len(oshape)):
        g: Any = None
        if d in dn["start_index_map"]:
            p = dn["start_index_map"].index(d)
            g = place(torch.clamp(idx[..., p], 0, oshape[d] - sizes[d]), batch_out)
        if d in dn["operand_batching_dims"]:
            k = dn["operand_batching_dims"].index(d)
            pos = idx_dims.index(dn["start_indices_batching_dims"][k])
            g = place(torch.arange(batch_shape[pos]), [batch_out[pos]])
        if d in window:
            w = place(torch.arange(sizes[d]), [offset_dims[window.index(d)]])
            g = w if g is None else g + w
        grids.append(g if g is not None else torch.zeros((), dtype=torch.int64))
    out = operand[tuple(grids)]
    return out.reshape(out_shape) if tuple(out.shape) != out_shape and out.numel() == math.prod(out_shape) else \
        out.expand(out_shape)


# ---- sorting ------------------------------------------------------------------------------------------------
@handles("chlo.top_k")
def _top_k(em: Emitter, op: Op, vals: list) -> Any:
    k = op.attrs["k"]
    values, indices = torch.topk(materialize(vals[0]), k, dim=-1, largest=True, sorted=True)
    return [values, indices.to(torch_dtype(op.results[1].type))]


def _comparator_arg(v: Value, body: Any) -> int | None:
    """Which comparator argument a compared value is, through JAX's float canonicalization (``-0 -> 0`` and
    NaN selects, ``select(cond, constant, x)``) that makes its sort a total order."""
    while v.producer is not None and v.producer.name == "stablehlo.select":
        v = v.producer.operands[2]
    for i, arg in enumerate(body.args):
        if v is arg:
            return i
    return None


@handles("stablehlo.sort")
def _sort(em: Emitter, op: Op, vals: list) -> Any:
    """``lax.sort`` with a comparator on the first operand only (``<`` or ``>``); the other operands follow it."""
    body = op.regions[0] if op.regions else None
    c = body.returns[0].producer if body and len(body.returns) == 1 else None
    if c is None or c.name != "stablehlo.compare" or c.attrs["comparison_direction"] not in ("LT", "GT"):
        raise UnsupportedOp(op.name, "comparator other than one < or > on the first operand")
    a, b = (_comparator_arg(v, body) for v in c.operands)
    direction = c.attrs["comparison_direction"]
    if (a, b) == (1, 0):  # written as b < a
        direction = _MIRROR[direction]
    elif (a, b) != (0, 1):
        raise UnsupportedOp(op.name, "comparator other than one < or > on the first operand")
    dim = op.attrs["dimension"]
    keys = materialize(vals[0])
    d = dim - keys.dim()
    sorted_keys, order = torch.sort(keys, dim=d, descending=direction == "GT", stable=True)
    out = [sorted_keys]
    for v in vals[1:]:
        out.append(torch.gather(materialize(v), d, order))
    return out
