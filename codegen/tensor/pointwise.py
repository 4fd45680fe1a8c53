"""Elementwise ops on the tensor path: any arity, any broadcasting, any rank.

Every operand is a strided view broadcast to the output's shape (stride 0 along broadcast dims), so one DMA per
operand and tile loads exactly the elements that tile needs; the op is one or a few engine instructions on the
tiles (Scalar-engine activations, Vector-engine ALU ops, predicated copies for ``where``), and one DMA writes the
result. The engines compute in fp32 and round to the destination's type, as eager PyTorch does per op. Division
is a reciprocal and a multiply (the ALU has no divide): within an ulp of eager's quotient.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ..emitters import Context
from ..errors import CodegenError
from .instruction import TensorOp, kernel_dtype, literal, register_emitter, tile_alloc, tile_bytes
from .tiles import Code, Tile, plan, walk
from .view import TRef, broadcast_to

#: ATen unary op -> the Scalar engine's activation function (nl.<name>)
ACTIVATIONS = {
    "aten.exp.default": "exp", "aten.log.default": "log", "aten.sqrt.default": "sqrt", "aten.rsqrt.default": "rsqrt",
    "aten.sigmoid.default": "sigmoid", "aten.tanh.default": "tanh", "aten.silu.default": "silu",
    "aten.relu.default": "relu", "aten.abs.default": "abs", "aten.erf.default": "erf", "aten.sign.default": "sign",
    "aten.mish.default": "mish", "aten.square.default": "square", "aten.softplus.default": "softplus",
}
#: ATen binary op -> ALU op (nl.<name>); ``div`` is handled apart (reciprocal, multiply)
ALU = {
    "add": "add", "sub": "subtract", "mul": "multiply", "maximum": "maximum", "minimum": "minimum",
    "eq": "equal", "ne": "not_equal", "lt": "less", "le": "less_equal", "gt": "greater", "ge": "greater_equal",
    "logical_and": "logical_and", "logical_or": "logical_or", "bitwise_and": "logical_and",
    "bitwise_or": "logical_or", "pow": "power",
}
_POW_ACT = {2: "square", 0.5: "sqrt", -0.5: "rsqrt"}


class Body:
    """What one tile of an elementwise op does: load the operands, compute into ``out``, store. Subclasses of
    nothing: each op gives a ``compute(code, out, tiles, ins)`` callable."""

    def __init__(self, ins: TensorOp, ctx: Context, code: Code, operands: list[TRef],
                 compute: Callable[[Code, str, list[str], Tile], None]) -> None:
        self.ins, self.ctx, self.code, self.operands, self.compute = ins, ctx, code, operands, compute
        self.name = ins.name_stem()
        self.scratch = 0

    def __call__(self, tile: Tile) -> None:
        code, out = self.code, self.ins.outs[0]
        shape = tile.shape()
        tiles = []
        for k, ref in enumerate(self.operands):
            t = tile_alloc(code, shape, ref.dtype, self.name, f"in{k}_")
            code(f"nisa.dma_copy(dst={t}, src={tile.ap(self.ctx.var(ref.value), ref)}, name=\"{self.name}.load\")")
            tiles.append(t)
        o = tile_alloc(code, shape, out.dtype, self.name, "out")
        self.compute(code, o, tiles, tile)
        code(f"nisa.dma_copy(dst={tile.ap(self.ctx.var(out.value), out)}, src={o}, name=\"{self.name}.store\")")
        self.scratch = max(self.scratch, sum(tile_bytes(shape, r.dtype) for r in self.operands)
                           + tile_bytes(shape, out.dtype) * 4)


def elementwise(ins: TensorOp, ctx: Context, code: Code, operands: list[TRef],
                compute: Callable[[Code, str, list[str], Tile], None]) -> int:
    """Emit ``compute`` over the output's iteration space; returns the SBUF scratch per partition."""
    out = ins.outs[0]
    refs = [broadcast_to(r, out.shape) for r in operands]
    body = Body(ins, ctx, code, refs, compute)
    walk(code, plan(out.shape), body)
    return body.scratch


def _label(ins: TensorOp) -> str:
    return ins.name_stem()


def _scalar(x: Any) -> str:
    if isinstance(x, bool):
        return "1.0" if x else "0.0"
    return literal(x)


@register_emitter(*ACTIVATIONS)
def _activation(ins: TensorOp, ctx: Context, code: Code) -> int:
    fn = ACTIVATIONS[ins.op]
    if ins.op == "aten.softplus.default" and (ins.args[1:] not in ((), (1,), (1, 20), (1.0, 20.0))):
        raise CodegenError(f"softplus with beta/threshold {ins.args[1:]}")

    def compute(code: Code, o: str, t: list[str], tile: Tile) -> None:
        code(f"nisa.activation(dst={o}, op=nl.{fn}, data={t[0]}, name=\"{_label(ins)}\")")
    return elementwise(ins, ctx, code, [ins.args[0]], compute)


@register_emitter("aten.expm1.default", "aten.log1p.default")
def _expm1_log1p(ins: TensorOp, ctx: Context, code: Code) -> int:
    """``expm1(x)`` as ``exp(x) - 1`` and ``log1p(x)`` as ``log(1 + x)`` (Apertus' xIELU activation): the Scalar
    engine has no fused form (neither is in the NKI activation tables). Near 0 the result loses eager's relative
    precision but keeps its absolute precision (within 1e-7 of fp32's 1), which is what a sum with other terms of
    order 1 (xIELU: ``(expm1(min(x, eps)) - x) * a + b * x``) sees."""
    x = ins.args[0]
    if not x.dtype.is_floating_point:
        raise CodegenError(f"{ins.op} of {x.dtype}")
    expm1 = ins.op == "aten.expm1.default"

    def compute(code: Code, o: str, t: list[str], tile: Tile) -> None:
        lab = _label(ins)
        z = tile_alloc(code, tile.shape(), torch.float32, lab, "z")
        if expm1:
            code(f"nisa.activation(dst={z}, op=nl.exp, data={t[0]}, name=\"{lab}.exp\")")
            code(f"nisa.tensor_scalar(dst={o}, data={z}, op0=nl.subtract, operand0=1.0, name=\"{lab}\")")
        else:
            code(f"nisa.tensor_scalar(dst={z}, data={t[0]}, op0=nl.add, operand0=1.0, name=\"{lab}.onep\")")
            code(f"nisa.activation(dst={o}, op=nl.log, data={z}, name=\"{lab}\")")
    return elementwise(ins, ctx, code, [x], compute)


@register_emitter("aten.gelu.default")
def _gelu(ins: TensorOp, ctx: Context, code: Code) -> int:
    fn = "gelu_apprx_tanh" if ins.kwargs.get("approximate", "none") == "tanh" else "gelu"

    def compute(code: Code, o: str, t: list[str], tile: Tile) -> None:
        code(f"nisa.activation(dst={o}, op=nl.{fn}, data={t[0]}, name=\"{_label(ins)}\")")
    return elementwise(ins, ctx, code, [ins.args[0]], compute)


def _scalar_op(ins: TensorOp, ctx: Context, code: Code, x: TRef, op0: str, operand0: Any, reverse: bool = False,
               op1: str | None = None, operand1: Any = None) -> int:
    extra = f", op1=nl.{op1}, operand1={_scalar(operand1)}" if op1 else ""
    rev = ", reverse0=True" if reverse else ""

    def compute(code: Code, o: str, t: list[str], tile: Tile) -> None:
        code(f"nisa.tensor_scalar(dst={o}, data={t[0]}, op0=nl.{op0}, operand0={_scalar(operand0)}{rev}{extra}, "
             f"name=\"{_label(ins)}\")")
    return elementwise(ins, ctx, code, [x], compute)


@register_emitter("aten.neg.default")
def _neg(ins: TensorOp, ctx: Context, code: Code) -> int:
    return _scalar_op(ins, ctx, code, ins.args[0], "multiply", -1.0)


@register_emitter("aten.reciprocal.default")
def _reciprocal(ins: TensorOp, ctx: Context, code: Code) -> int:
    def compute(code: Code, o: str, t: list[str], tile: Tile) -> None:
        code(f"nisa.reciprocal(dst={o}, data={t[0]}, name=\"{_label(ins)}\")")
    return elementwise(ins, ctx, code, [ins.args[0]], compute)


@register_emitter("aten.logical_not.default", "aten.bitwise_not.default")
def _logical_not(ins: TensorOp, ctx: Context, code: Code) -> int:
    if ins.op == "aten.bitwise_not.default" and ins.args[0].dtype != torch.bool:
        raise CodegenError("bitwise_not of a non-boolean value")
    return _scalar_op(ins, ctx, code, ins.args[0], "equal", 0.0)


@register_emitter("aten.pow.Tensor_Scalar")
def _pow(ins: TensorOp, ctx: Context, code: Code) -> int:
    x, e = ins.args[0], ins.args[1]
    if e in _POW_ACT:
        fn = _POW_ACT[e]

        def compute(code: Code, o: str, t: list[str], tile: Tile) -> None:
            code(f"nisa.activation(dst={o}, op=nl.{fn}, data={t[0]}, name=\"{_label(ins)}\")")
        return elementwise(ins, ctx, code, [x], compute)
    if e == -1:
        def compute(code: Code, o: str, t: list[str], tile: Tile) -> None:
            code(f"nisa.reciprocal(dst={o}, data={t[0]}, name=\"{_label(ins)}\")")
        return elementwise(ins, ctx, code, [x], compute)
    if e == 1:
        return _scalar_op(ins, ctx, code, x, "multiply", 1.0)
    return _scalar_op(ins, ctx, code, x, "power", e)


@register_emitter("aten.clamp.default", "aten.clamp_min.default", "aten.clamp_max.default")
def _clamp(ins: TensorOp, ctx: Context, code: Code) -> int:
    x = ins.args[0]
    lo = ins.args[1] if len(ins.args) > 1 else ins.kwargs.get("min")
    hi = ins.args[2] if len(ins.args) > 2 else ins.kwargs.get("max")
    if ins.op == "aten.clamp_max.default":
        lo, hi = None, ins.args[1]
    if lo is not None and hi is not None:
        return _scalar_op(ins, ctx, code, x, "maximum", lo, op1="minimum", operand1=hi)
    if lo is not None:
        return _scalar_op(ins, ctx, code, x, "maximum", lo)
    if hi is not None:
        return _scalar_op(ins, ctx, code, x, "minimum", hi)
    return _scalar_op(ins, ctx, code, x, "multiply", 1.0)


def _binary_name(op: str) -> str:
    return op.split(".")[1].rstrip("_")  # ``add_`` (in place into state: the lowering makes outs[0] the state)


@register_emitter(*(f"aten.{n}.{form}" for n in ("add", "sub", "mul", "eq", "ne", "lt", "le", "gt", "ge")
                    for form in ("Tensor", "Scalar")),
                  *(f"aten.{n}_.{form}" for n in ("add", "sub", "mul") for form in ("Tensor", "Scalar")),
                  "aten.maximum.default", "aten.minimum.default", "aten.logical_and.default",
                  "aten.logical_or.default", "aten.bitwise_and.Tensor", "aten.bitwise_or.Tensor",
                  "aten.pow.Tensor_Tensor", "aten.rsub.Scalar", "aten.rsub.Tensor")
def _binary(ins: TensorOp, ctx: Context, code: Code) -> int:
    name = _binary_name(ins.op)
    reverse = name == "rsub"
    alu = ALU["sub" if reverse else name]
    a, b = ins.args[0], ins.args[1]
    alpha = ins.kwargs.get("alpha", ins.args[2] if len(ins.args) > 2 else 1)
    if name in ("bitwise_and", "bitwise_or"):
        both = {a.dtype, getattr(b, "dtype", None)}
        if both == {torch.bool}:
            pass  # logical on 0/1 values
        elif all(t is not None and not t.is_floating_point and t != torch.bool for t in both):
            alu = name  # bit operations on integers (the ALU's bitvec operators)
        else:
            raise CodegenError(f"{ins.op} of {sorted(map(str, both))}")
    if not isinstance(b, TRef):  # x <op> scalar
        if alpha != 1:
            b = b * alpha
        return _scalar_op(ins, ctx, code, a, alu, b, reverse=reverse)
    if not isinstance(a, TRef):
        raise CodegenError(f"{ins.op} with a scalar first operand")
    if alpha != 1:
        def scaled(code: Code, o: str, t: list[str], tile: Tile) -> None:
            tmp = tile_alloc(code, tile.shape(), torch.float32, _label(ins), "alpha")
            code(f"nisa.tensor_scalar(dst={tmp}, data={t[1]}, op0=nl.multiply, operand0={_scalar(alpha)}, "
                 f"name=\"{_label(ins)}.alpha\")")
            first, second = (tmp, t[0]) if reverse else (t[0], tmp)
            code(f"nisa.tensor_tensor(dst={o}, data1={first}, data2={second}, op=nl.{alu}, name=\"{_label(ins)}\")")
        return elementwise(ins, ctx, code, [a, b], scaled)

    def compute(code: Code, o: str, t: list[str], tile: Tile) -> None:
        first, second = (t[1], t[0]) if reverse else (t[0], t[1])
        code(f"nisa.tensor_tensor(dst={o}, data1={first}, data2={second}, op=nl.{alu}, name=\"{_label(ins)}\")")
    return elementwise(ins, ctx, code, [a, b], compute)


@register_emitter("aten.div.Tensor", "aten.div.Scalar")
def _div(ins: TensorOp, ctx: Context, code: Code) -> int:
    a, b = ins.args[0], ins.args[1]
    if not isinstance(b, TRef):
        return _scalar_op(ins, ctx, code, a, "multiply", 1.0 / float(b))

    def compute(code: Code, o: str, t: list[str], tile: Tile) -> None:
        r = tile_alloc(code, tile.shape(), torch.float32, _label(ins), "recip")
        code(f"nisa.reciprocal(dst={r}, data={t[1]}, name=\"{_label(ins)}.recip\")")
        code(f"nisa.tensor_tensor(dst={o}, data1={t[0]}, data2={r}, op=nl.multiply, name=\"{_label(ins)}\")")
    return elementwise(ins, ctx, code, [a, b], compute)


@register_emitter("aten.floor_divide.default", "aten.floor_divide.Scalar")
def _floor_divide(ins: TensorOp, ctx: Context, code: Code) -> int:
    """``a // b`` for a number ``b`` known when the kernel is built (HF's ``perm // top_k``): the quotient through
    the reciprocal, floored, then corrected by the remainder so an integer quotient is exact (``9 * (1/3)`` is
    2.9999998 in fp32). Integers compute in fp32 on the engines: exact for magnitudes below 2^24, like every
    integer the tensor path computes (row indices, positions)."""
    a, b = ins.args[0], ins.args[1]
    if isinstance(b, TRef) or not b:
        raise CodegenError(f"{ins.op} by {'a tensor' if isinstance(b, TRef) else 'zero'}")
    if a.dtype.is_floating_point:
        raise CodegenError(f"{ins.op} of {a.dtype} (floats: not on the tensor path)")
    b = float(b)

    def compute(code: Code, o: str, t: list[str], tile: Tile) -> None:
        lab = _label(ins)
        x, f, rf, tmp = (tile_alloc(code, tile.shape(), torch.float32, lab, w) for w in ("x", "q", "qf", "tmp"))
        code(f"nisa.tensor_copy(dst={x}, src={t[0]}, name=\"{lab}.x\")")
        code(f"nisa.tensor_scalar(dst={f}, data={x}, op0=nl.multiply, operand0={1.0 / b!r}, name=\"{lab}.q\")")
        emit_floor(code, rf, f, tile.shape(), lab)
        # remainder x - q * b, in [0, |b|) (b > 0) or (-|b|, 0] (b < 0) when q is right; one step either way else
        code(f"nisa.scalar_tensor_tensor(dst={tmp}, data={rf}, op0=nl.multiply, operand0={-b!r}, op1=nl.add, "
             f"operand1={x}, name=\"{lab}.rem\")")
        up, down = ("greater_equal", "less") if b > 0 else ("less_equal", "greater")
        code(f"nisa.tensor_scalar(dst={f}, data={tmp}, op0=nl.{up}, operand0={b!r}, name=\"{lab}.up\")")
        code(f"nisa.tensor_tensor(dst={rf}, data1={rf}, data2={f}, op=nl.add, name=\"{lab}.inc\")")
        code(f"nisa.tensor_scalar(dst={f}, data={tmp}, op0=nl.{down}, operand0=0.0, name=\"{lab}.down\")")
        code(f"nisa.tensor_tensor(dst={rf}, data1={rf}, data2={f}, op=nl.subtract, name=\"{lab}.dec\")")
        code(f"nisa.tensor_copy(dst={o}, src={rf}, name=\"{lab}\")")
    return elementwise(ins, ctx, code, [a], compute)


@register_emitter("aten.log_sigmoid_forward.default")
def _log_sigmoid_forward(ins: TensorOp, ctx: Context, code: Code) -> int:
    """``F.logsigmoid`` (a router's gate, Inkling): ``min(x, 0) - log(1 + exp(-|x|))`` and the op's second output,
    its buffer ``exp(-|x|)`` (PyTorch's CPU kernel keeps it for the backward; nothing reads it in a decode step,
    but it is computed as eager computes it). ``log(1 + z)`` for eager's ``log1p(z)``: the same but for the
    rounding of ``1 + z`` (within 1e-6 absolute)."""
    x = ins.args[0]
    if not x.dtype.is_floating_point:
        raise CodegenError(f"{ins.op} of {x.dtype}")

    def neg_abs_exp(code: Code, t: str, tile: Tile, lab: str) -> str:
        z = tile_alloc(code, tile.shape(), torch.float32, lab, "z")
        code(f"nisa.activation(dst={z}, op=nl.abs, data={t}, name=\"{lab}.abs\")")
        code(f"nisa.activation(dst={z}, op=nl.exp, data={z}, scale=-1.0, name=\"{lab}.exp\")")
        return z

    def out(code: Code, o: str, t: list[str], tile: Tile) -> None:
        lab = _label(ins)
        z = neg_abs_exp(code, t[0], tile, lab)
        code(f"nisa.tensor_scalar(dst={z}, data={z}, op0=nl.add, operand0=1.0, name=\"{lab}.onep\")")
        code(f"nisa.activation(dst={z}, op=nl.log, data={z}, name=\"{lab}.log\")")
        m = tile_alloc(code, tile.shape(), torch.float32, lab, "min0")
        code(f"nisa.tensor_scalar(dst={m}, data={t[0]}, op0=nl.minimum, operand0=0.0, name=\"{lab}.min0\")")
        code(f"nisa.tensor_tensor(dst={o}, data1={m}, data2={z}, op=nl.subtract, name=\"{lab}\")")

    def buffer(code: Code, o: str, t: list[str], tile: Tile) -> None:
        z = neg_abs_exp(code, t[0], tile, _label(ins) + "_buf")
        code(f"nisa.tensor_copy(dst={o}, src={z}, name=\"{_label(ins)}.buffer\")")
    scratch = elementwise(ins, ctx, code, [x], out)
    if len(ins.outs) > 1:
        scratch = max(scratch, elementwise(dataclasses.replace(ins, outs=(ins.outs[1],)), ctx, code, [x], buffer))
    return scratch


@register_emitter("aten.where.self")
def _where(ins: TensorOp, ctx: Context, code: Code) -> int:
    return _select(ins, ctx, code, cond=ins.args[0], on_true=ins.args[1], on_false=ins.args[2])


@register_emitter("aten.masked_fill.Scalar", "aten.masked_fill.Tensor")
def _masked_fill(ins: TensorOp, ctx: Context, code: Code) -> int:
    return _select(ins, ctx, code, cond=ins.args[1], on_true=ins.args[2], on_false=ins.args[0])


def _select(ins: TensorOp, ctx: Context, code: Code, *, cond: TRef, on_true: Any, on_false: Any) -> int:
    """``where(cond, on_true, on_false)`` (and ``masked_fill``, the same select): ``on_false`` copied (or filled),
    then ``on_true`` copied where the predicate is set -- a predicated copy, never an arithmetic blend (``0 * inf``
    would make NaN)."""
    refs = [r for r in (cond, on_true, on_false) if isinstance(r, TRef)]
    out_dt = kernel_dtype(ins.outs[0].dtype)

    def compute(code: Code, o: str, t: list[str], tile: Tile) -> None:
        tiles = dict(zip([id(r) for r in refs], t))
        c = _as_predicate(code, ins, tiles[id(cond)], cond, tile)
        code(_fill(o, on_false, tiles, ins, out_dt, tile, code))
        src = _src(on_true, tiles, ins, out_dt, tile, code)
        code(f"nisa.tensor_copy_predicated(dst={o}, src={src}, predicate={c}, name=\"{_label(ins)}\")")
    return elementwise(ins, ctx, code, refs, compute)


def _as_predicate(code: Code, ins: TensorOp, t: str, ref: TRef, tile: Tile) -> str:
    """A uint8 0/1 tile of a condition (bool values are uint8 already)."""
    if kernel_dtype(ref.dtype) == torch.uint8:
        return t
    p = tile_alloc(code, tile.shape(), torch.uint8, _label(ins), "pred")
    code(f"nisa.tensor_scalar(dst={p}, data={t}, op0=nl.not_equal, operand0=0.0, name=\"{_label(ins)}.pred\")")
    return p


def _src(x: Any, tiles: dict, ins: TensorOp, out_dt: torch.dtype, tile: Tile, code: Code) -> str:
    """A tile (of the output's dtype) or a scalar literal of ``x``."""
    if not isinstance(x, TRef):
        return literal(x, out_dt)
    t = tiles[id(x)]
    if kernel_dtype(x.dtype) == out_dt:
        return t
    c = tile_alloc(code, tile.shape(), out_dt, _label(ins), "cast")
    code(f"nisa.tensor_copy(dst={c}, src={t}, name=\"{_label(ins)}.cast\")")
    return c


def _fill(o: str, x: Any, tiles: dict, ins: TensorOp, out_dt: torch.dtype, tile: Tile, code: Code) -> str:
    if not isinstance(x, TRef):
        v = literal(x, out_dt)
        return f"nisa.memset(dst={o}, value={v}, name=\"{_label(ins)}.fill\")"
    return f"nisa.tensor_copy(dst={o}, src={_src(x, tiles, ins, out_dt, tile, code)}, name=\"{_label(ins)}.fill\")"


@register_emitter("aten._to_copy.default")
def _to_copy(ins: TensorOp, ctx: Context, code: Code) -> int:
    x = ins.args[0]
    out_dt = kernel_dtype(ins.outs[0].dtype)
    if ins.outs[0].dtype == torch.bool:
        return _scalar_op(ins, ctx, code, x, "not_equal", 0.0)
    if x.dtype.is_floating_point and not out_dt.is_floating_point:
        return _truncate(ins, ctx, code, x)

    def compute(code: Code, o: str, t: list[str], tile: Tile) -> None:
        code(f"nisa.tensor_copy(dst={o}, src={t[0]}, name=\"{_label(ins)}\")")
    return elementwise(ins, ctx, code, [x], compute)


def emit_floor(code: Code, dst: str, src: str, shape: tuple[int, ...], lab: str) -> None:
    """``dst = floor(src)`` for fp32 tiles (``dst`` may be ``src``): the engines' float -> int conversion rounds to
    nearest even, so round, then subtract 1 where that went above."""
    ri = tile_alloc(code, shape, torch.int32, lab, "rint")
    rf, over = (tile_alloc(code, shape, torch.float32, lab, w) for w in ("rintf", "over"))
    code(f"nisa.tensor_copy(dst={ri}, src={src}, name=\"{lab}.rint\")")
    code(f"nisa.tensor_copy(dst={rf}, src={ri}, name=\"{lab}.rintf\")")
    code(f"nisa.tensor_tensor(dst={over}, data1={rf}, data2={src}, op=nl.greater, name=\"{lab}.over\")")
    code(f"nisa.tensor_tensor(dst={dst}, data1={rf}, data2={over}, op=nl.subtract, name=\"{lab}.floor\")")


def _truncate(ins: TensorOp, ctx: Context, code: Code, x: TRef) -> int:
    """float -> integer as PyTorch casts: toward zero (the engines' conversion rounds to nearest even), as
    ``sign(x) * (r - (r > |x|))`` with ``r`` = |x| rounded."""
    def compute(code: Code, o: str, t: list[str], tile: Tile) -> None:
        lab = _label(ins)
        a, s = (tile_alloc(code, tile.shape(), torch.float32, lab, w) for w in ("abs", "sign"))
        code(f"nisa.activation(dst={a}, op=nl.abs, data={t[0]}, name=\"{lab}.abs\")")
        emit_floor(code, a, a, tile.shape(), lab)
        code(f"nisa.activation(dst={s}, op=nl.sign, data={t[0]}, name=\"{lab}.sign\")")
        code(f"nisa.tensor_tensor(dst={o}, data1={a}, data2={s}, op=nl.multiply, name=\"{lab}\")")
    return elementwise(ins, ctx, code, [x], compute)


__all__ = ["ACTIVATIONS", "ALU", "elementwise", "emit_floor"]

