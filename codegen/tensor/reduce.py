"""Reductions on the tensor path, over any dims, and the softmax family.

The reduced dims go on the free axis of every tile (the engines reduce only along the free axis; nki_api.md,
"Layout rule"), one kept dim on partitions, every other kept dim a Python loop: each tile's result is one value
per partition, which broadcasts as a per-partition scalar operand, so softmax is the classic four instructions
(max, ``exp(x - max)`` with its sum in the same Scalar-engine instruction, reciprocal, scale). A reduced dim
longer than a tile is walked in chunks into an fp32 accumulator. Results are accumulated in fp32 and rounded to
the output's type when stored, as eager PyTorch accumulates a reduced-precision sum.
"""
from __future__ import annotations

import torch

from ..emitters import Context
from ..errors import CodegenError
from .instruction import TensorOp, literal, register_emitter, tile_alloc, tile_bytes
from .tiles import Code, Tile, plan, walk
from .view import TRef, contiguous_strides

_OPS = {"aten.sum.dim_IntList": "add", "aten.sum.default": "add", "aten.mean.dim": "add", "aten.mean.default": "add",
        "aten.amax.default": "maximum", "aten.amin.default": "minimum", "aten.max.default": "maximum",
        "aten.min.default": "minimum"}
#: the largest finite fp32 (selections pad with its negative: codegen/tensor/select.py)
FLT_MAX = 3.4028234663852886e38
#: the accumulator's start value
_IDENTITY = {"add": 0.0, "maximum": float("-inf"), "minimum": float("inf")}


def reduced_dims(ins: TensorOp) -> tuple[tuple[int, ...], bool]:
    """The dims ``ins`` reduces (normalized) and its ``keepdim``."""
    x: TRef = ins.args[0]
    rank = len(x.shape)
    if ins.op in ("aten.sum.default", "aten.mean.default", "aten.max.default", "aten.min.default"):
        return tuple(range(rank)), False
    dims = ins.args[1] if len(ins.args) > 1 else ins.kwargs.get("dim")
    keep = bool(ins.args[2] if len(ins.args) > 2 else ins.kwargs.get("keepdim", False))
    if dims is None or dims == []:
        return tuple(range(rank)), keep
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted(d % rank for d in dims)) if rank else (), keep


def out_aligned(out: TRef, shape: tuple[int, ...], dims: tuple[int, ...]) -> TRef:
    """The output buffer as a view over the input's iteration space: stride 0 along the reduced dims."""
    keep_shape = tuple(1 if d in dims else n for d, n in enumerate(shape))
    strides = tuple(0 if d in dims else s for d, s in enumerate(contiguous_strides(keep_shape)))
    return TRef(out.value, shape, strides, out.offset)


def _load(code: Code, ctx: Context, tile: Tile, x: TRef, name: str) -> tuple[str, tuple[int, ...]]:
    """One tile of ``x`` loaded into SBUF, and the free axes a reduction over it reduces (all but the partitions)."""
    t = tile_alloc(code, tile.shape(), x.dtype, name, "x")
    code(f"nisa.dma_copy(dst={t}, src={tile.ap(ctx.var(x.value), x)}, name=\"{name}.load\")")
    return t, tuple(range(1, len(tile.shape())))


class _Reduction:
    """One reduction's tiles: accumulator set before the chunks of a row tile, one reduce per chunk, the scaled
    result stored after the last chunk."""

    def __init__(self, ins: TensorOp, ctx: Context, code: Code, x: TRef, dims: tuple[int, ...], alu: str,
                 scale: float) -> None:
        self.ins, self.ctx, self.code, self.alu, self.scale = ins, ctx, code, alu, scale
        self.x, self.dims = x, dims
        self.out = out_aligned(ins.outs[0], x.shape, dims)
        self.name = ins.name_stem()
        self.acc = ""
        self.scratch = 0

    def before(self, tile: Tile) -> None:
        self.acc = tile_alloc(self.code, (tile.p, 1), torch.float32, self.name, "acc")
        self.code(f"nisa.memset(dst={self.acc}, value={literal(_IDENTITY[self.alu])}, name=\"{self.name}.init\")")

    def body(self, tile: Tile) -> None:
        code, shape = self.code, tile.shape()
        t, axes = _load(code, self.ctx, tile, self.x, self.name)
        part = tile_alloc(code, (tile.p, 1), torch.float32, self.name, "part")
        code(f"nisa.tensor_reduce(dst={part}, op=nl.{self.alu}, data={t}, axis={axes}, name=\"{self.name}\")")
        code(f"nisa.tensor_tensor(dst={self.acc}, data1={self.acc}, data2={part}, op=nl.{self.alu}, "
             f"name=\"{self.name}.acc\")")
        self.scratch = max(self.scratch, tile_bytes(shape, self.x.dtype) + 16)

    def after(self, tile: Tile) -> None:
        code, res = self.code, self.acc
        if self.scale != 1.0:
            res = tile_alloc(code, (tile.p, 1), torch.float32, self.name, "scaled")
            code(f"nisa.tensor_scalar(dst={res}, data={self.acc}, op0=nl.multiply, operand0={self.scale!r}, "
                 f"name=\"{self.name}.scale\")")
        code(f"nisa.dma_copy(dst={tile.ap(self.ctx.var(self.out.value), self.out, dims=())}, src={res}, "
             f"name=\"{self.name}.store\")")


@register_emitter(*_OPS)
def _reduce(ins: TensorOp, ctx: Context, code: Code) -> int:
    x: TRef = ins.args[0]
    dims, _ = reduced_dims(ins)
    if not x.shape:  # a 0-d value: the reduction is the value (one element)
        x, dims = TRef(x.value, (1,), (1,), x.offset), (0,)
    n = 1
    for d in dims:
        n *= x.shape[d]
    scale = 1.0 / n if ins.op.startswith("aten.mean") else 1.0
    r = _Reduction(ins, ctx, code, x, dims, _OPS[ins.op], scale)
    walk(code, plan(x.shape, inner=dims, loops_outer=True), r.body, before=r.before, after=r.after)
    return r.scratch


@register_emitter("aten._softmax.default", "aten._log_softmax.default", "aten.logsumexp.default")
def _softmax(ins: TensorOp, ctx: Context, code: Code) -> int:
    x: TRef = ins.args[0]
    dims = ins.args[1] if len(ins.args) > 1 else ins.kwargs.get("dim")
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    dims = tuple(sorted(d % len(x.shape) for d in dims))
    p = plan(x.shape, inner=dims, loops_outer=True)
    if p.chunk:
        raise CodegenError(f"{ins.op} over {x.shape[dims[-1]]} elements (longer than one tile)")
    name = ins.name_stem()
    logsumexp = ins.op == "aten.logsumexp.default"
    out = out_aligned(ins.outs[0], x.shape, dims) if logsumexp else _same(ins.outs[0], x.shape)
    scratch = [0]

    def body(tile: Tile) -> None:
        shape = tile.shape()
        t, axes = _load(code, ctx, tile, x, name)
        m, negm, s = (tile_alloc(code, (tile.p, 1), torch.float32, name, w) for w in ("max", "negmax", "sum"))
        code(f"nisa.tensor_reduce(dst={m}, op=nl.maximum, data={t}, axis={axes}, name=\"{name}.max\")")
        code(f"nisa.tensor_scalar(dst={negm}, data={m}, op0=nl.multiply, operand0=-1.0, name=\"{name}.negmax\")")
        e = tile_alloc(code, shape, torch.float32, name, "exp")
        code(f"nisa.activation(dst={e}, op=nl.exp, data={t}, bias={negm}, scale=1.0, reduce_op=nl.add, "
             f"reduce_res={s}, reduce_cmd=nisa.reduce_cmd.reset_reduce, name=\"{name}.exp\")")
        res = _finish(code, ins.op, name, tile, e, m, negm, s, t)
        scratch[0] = max(scratch[0], tile_bytes(shape, x.dtype) + 2 * tile_bytes(shape, torch.float32) + 16)
        dims_out = () if logsumexp else None
        code(f"nisa.dma_copy(dst={tile.ap(ctx.var(out.value), out, dims=dims_out)}, src={res}, "
             f"name=\"{name}.store\")")
    walk(code, p, body)
    return scratch[0]


class _SquareSum(_Reduction):
    """``linalg_vector_norm(x, 2, dims)``: the sum of squares accumulated like a sum, its square root stored."""

    def body(self, tile: Tile) -> None:
        code, shape = self.code, tile.shape()
        t, axes = _load(code, self.ctx, tile, self.x, self.name)
        sq = tile_alloc(code, shape, torch.float32, self.name, "sq")
        code(f"nisa.tensor_tensor(dst={sq}, data1={t}, data2={t}, op=nl.multiply, name=\"{self.name}.sq\")")
        part = tile_alloc(code, (tile.p, 1), torch.float32, self.name, "part")
        code(f"nisa.tensor_reduce(dst={part}, op=nl.add, data={sq}, axis={axes}, name=\"{self.name}\")")
        code(f"nisa.tensor_tensor(dst={self.acc}, data1={self.acc}, data2={part}, op=nl.add, name=\"{self.name}.acc\")")
        self.scratch = max(self.scratch, tile_bytes(shape, self.x.dtype) + tile_bytes(shape, torch.float32) + 16)

    def after(self, tile: Tile) -> None:
        code = self.code
        res = tile_alloc(code, (tile.p, 1), torch.float32, self.name, "norm")
        code(f"nisa.activation(dst={res}, op=nl.sqrt, data={self.acc}, name=\"{self.name}.sqrt\")")
        code(f"nisa.dma_copy(dst={tile.ap(self.ctx.var(self.out.value), self.out, dims=())}, src={res}, "
             f"name=\"{self.name}.store\")")


@register_emitter("aten.linalg_vector_norm.default")
def _vector_norm(ins: TensorOp, ctx: Context, code: Code) -> int:
    """The L2 norm over ``dims`` (Inkling-2's q/k norms and their clips); other orders are refused."""
    x: TRef = ins.args[0]
    order = ins.args[1] if len(ins.args) > 1 else ins.kwargs.get("ord", 2)
    if float(order) != 2.0 or ins.kwargs.get("dtype") is not None:
        raise CodegenError(f"{ins.op} of order {order}" + (" with a dtype" if ins.kwargs.get("dtype") else ""))
    rank = len(x.shape)
    dims = ins.args[2] if len(ins.args) > 2 else ins.kwargs.get("dim")
    if dims is None or dims == []:
        dims = list(range(rank))
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    dims = tuple(sorted(d % rank for d in dims))
    r = _SquareSum(ins, ctx, code, x, dims, "add", 1.0)
    walk(code, plan(x.shape, inner=dims, loops_outer=True), r.body, before=r.before, after=r.after)
    return r.scratch


@register_emitter("aten.var.correction")
def _var(ins: TensorOp, ctx: Context, code: Code) -> int:
    """``x.var(dims, correction=c)`` (xLSTM's multi-head norm): two passes over one tile of the reduced dims, the
    mean first, then the sum of squared deviations from it (not ``E[x^2] - E[x]^2``, which cancels), in fp32,
    scaled by ``1 / (n - c)``."""
    x: TRef = ins.args[0]
    dims, _ = reduced_dims(ins)
    c = ins.kwargs.get("correction")
    c = 1.0 if c is None else float(c)
    n = 1
    for d in dims:
        n *= x.shape[d]
    if n - c <= 0:
        raise CodegenError(f"variance of {n} elements with correction {c}")
    p = plan(x.shape, inner=dims, loops_outer=True)
    if p.chunk:
        raise CodegenError(f"{ins.op} over {n} elements (longer than one tile)")
    name = ins.name_stem()
    out = out_aligned(ins.outs[0], x.shape, dims)
    scratch = [0]

    def body(tile: Tile) -> None:
        shape = tile.shape()
        t, axes = _load(code, ctx, tile, x, name)
        s, negm, ss = (tile_alloc(code, (tile.p, 1), torch.float32, name, w) for w in ("sum", "negmean", "sumsq"))
        code(f"nisa.tensor_reduce(dst={s}, op=nl.add, data={t}, axis={axes}, name=\"{name}.sum\")")
        code(f"nisa.tensor_scalar(dst={negm}, data={s}, op0=nl.multiply, operand0={-1.0 / n!r}, "
             f"name=\"{name}.negmean\")")
        dev, sq = (tile_alloc(code, shape, torch.float32, name, w) for w in ("dev", "sq"))
        code(f"nisa.tensor_scalar(dst={dev}, data={t}, op0=nl.add, operand0={negm}, name=\"{name}.dev\")")
        code(f"nisa.tensor_tensor(dst={sq}, data1={dev}, data2={dev}, op=nl.multiply, name=\"{name}.sq\")")
        code(f"nisa.tensor_reduce(dst={ss}, op=nl.add, data={sq}, axis={axes}, name=\"{name}.sumsq\")")
        code(f"nisa.tensor_scalar(dst={ss}, data={ss}, op0=nl.multiply, operand0={1.0 / (n - c)!r}, "
             f"name=\"{name}\")")
        code(f"nisa.dma_copy(dst={tile.ap(ctx.var(out.value), out, dims=())}, src={ss}, name=\"{name}.store\")")
        scratch[0] = max(scratch[0], tile_bytes(shape, x.dtype) + 2 * tile_bytes(shape, torch.float32) + 24)
    walk(code, p, body)
    return scratch[0]


def _finish(code: Code, op: str, name: str, tile: Tile, e: str, m: str, negm: str, s: str, t: str) -> str:
    """softmax: ``e / sum``; log_softmax: ``x - max - log(sum)``; logsumexp: ``max + log(sum)``."""
    if op == "aten._softmax.default":
        r = tile_alloc(code, (tile.p, 1), torch.float32, name, "rsum")
        code(f"nisa.reciprocal(dst={r}, data={s}, name=\"{name}.rsum\")")
        code(f"nisa.tensor_scalar(dst={e}, data={e}, op0=nl.multiply, operand0={r}, name=\"{name}.norm\")")
        return e
    ls = tile_alloc(code, (tile.p, 1), torch.float32, name, "logsum")
    code(f"nisa.activation(dst={ls}, op=nl.log, data={s}, name=\"{name}.log\")")
    if op == "aten.logsumexp.default":
        code(f"nisa.tensor_tensor(dst={ls}, data1={ls}, data2={m}, op=nl.add, name=\"{name}.lse\")")
        return ls
    code(f"nisa.tensor_tensor(dst={ls}, data1={ls}, data2={m}, op=nl.add, name=\"{name}.lse\")")
    code(f"nisa.tensor_scalar(dst={e}, data={t}, op0=nl.subtract, operand0={ls}, name=\"{name}.sub\")")
    return e


def _same(out: TRef, shape: tuple[int, ...]) -> TRef:
    return TRef(out.value, shape, contiguous_strides(shape), out.offset)


__all__ = ["out_aligned", "reduced_dims"]
