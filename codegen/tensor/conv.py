"""1-D convolutions on the tensor path: the short causal convolutions of hybrid decoders (LFM2, Mamba-style
mixers), whose decode step convolves a rolling window of the last ``K`` inputs.

Depthwise (``groups == channels``): channels on partitions, output positions on the free axis; each of the ``K``
taps is one strided read of the (padded) input and one multiply-accumulate by a per-partition weight scalar on
the Vector engine, in fp32. Dense (``groups == 1``): each tap is a matmul over input channels accumulated in PSUM
(``out[co, l] += W[co, ci, k] * x[ci, l*stride + k*dilation]``). Padding is a zero-filled copy in scratch.
"""
from __future__ import annotations

import torch

from ..emitters import Context, MOVING_MAX
from ..errors import CodegenError
from ..layout import PMAX
from .instruction import TensorOp, kdt, register_emitter, tile_alloc, tile_bytes
from .matmul import tiled
from .move import copy_view, fill
from .tiles import Code
from .view import TRef, slice_, whole
from .. import ir


def _params(ins: TensorOp) -> tuple[TRef, TRef, TRef | None, int, int, int, int]:
    x, w, bias = ins.args[0], ins.args[1], ins.args[2]
    stride, padding, dilation, transposed, _, groups = ins.args[3:9]
    if transposed or len(x.shape) != 3 or len(stride) != 1:
        raise CodegenError("only 1-D, non-transposed convolutions are on the tensor path")
    return x, w, bias, int(stride[0]), int(padding[0]), int(dilation[0]), int(groups)


def _padded(ins: TensorOp, ctx: Context, code: Code, x: TRef, pad: int) -> tuple[TRef, int]:
    """``x`` with ``pad`` zeros on both ends of its last dim, in a scratch buffer; returns it and its scratch."""
    if pad == 0:
        return x, 0
    shape = x.shape[:-1] + (x.shape[-1] + 2 * pad,)
    name = f"{ins.name_stem()}_pad"
    buf = ir.Value(name.replace(".", "_"), ir.ValueKind.TENSOR, shape, x.dtype)
    code(f"{buf.name} = nl.ndarray(shape={shape}, dtype={kdt(x.dtype)}, buffer=nl.hbm, name=\"{name}\")")
    ref = whole(buf)
    scratch = fill(code, ctx, ref, 0, f"{ins.name_stem()}.pad")
    copy_view(code, ctx, slice_(ref, 2, pad, pad + x.shape[-1]), x, f"{ins.name_stem()}.pad_in")
    return ref, scratch


def _window(x: TRef, b: str, c0: str, k: int, dilation: int, stride: int, length: int) -> tuple[list, str]:
    """Access pattern (channels on partitions, output positions on the free axis) of tap ``k``."""
    off = [str(x.offset + k * dilation * x.strides[2])] + ([f"{b} * {x.strides[0]}"] if b != "0" else []) + \
        ([f"{c0} * {x.strides[1]}"] if c0 != "0" else [])
    return [[x.strides[2] * stride, length]], " + ".join(off)


@register_emitter("aten.convolution.default")
def _conv(ins: TensorOp, ctx: Context, code: Code) -> int:
    x, w, bias, stride, pad, dilation, groups = _params(ins)
    B, C, _ = x.shape
    Co, Cg, K = w.shape
    out = ins.outs[0]
    Lout = out.shape[2]
    if Lout > MOVING_MAX:
        raise CodegenError(f"a convolution over {Lout} output positions (more than one tile)")
    x, scratch = _padded(ins, ctx, code, x, pad)
    if groups == C and Cg == 1 and Co == C:
        return scratch + _depthwise(ins, ctx, code, x, w, bias, stride, dilation, Lout)
    if groups == 1:
        return scratch + _dense(ins, ctx, code, x, w, bias, stride, dilation, Lout)
    raise CodegenError(f"a convolution with {groups} groups of {Cg} channels")


def _depthwise(ins: TensorOp, ctx: Context, code: Code, x: TRef, w: TRef, bias: TRef | None, stride: int,
               dilation: int, Lout: int) -> int:
    B, C, _ = x.shape
    K = w.shape[2]
    out, name = ins.outs[0], ins.name_stem()
    xv, wv, ov = ctx.var(x.value), ctx.var(w.value), ctx.var(out.value)
    scratch = [0]

    def channels(b: str) -> None:
        def tile(c0: str, cs: int, _first: str) -> None:
            acc = tile_alloc(code, (cs, Lout), torch.float32, name, "acc")
            wt = tile_alloc(code, (cs, K), w.dtype, name, "w")
            code(f"nisa.dma_copy(dst={wt}, src={wv}.ap(pattern={[[w.strides[0], cs], [w.strides[2], K]]}, "
                 f"offset={w.offset}{f' + {c0} * {w.strides[0]}' if c0 != '0' else ''}), name=\"{name}.w\")")
            wf = tile_alloc(code, (cs, K), torch.float32, name, "wf")
            code(f"nisa.tensor_copy(dst={wf}, src={wt}, name=\"{name}.wf\")")
            for k in range(K):
                pat, off = _window(x, b, c0, k, dilation, stride, Lout)
                xt = tile_alloc(code, (cs, Lout), x.dtype, name, "x")
                code(f"nisa.dma_copy(dst={xt}, src={xv}.ap(pattern={[[x.strides[1], cs]] + pat}, offset={off}), "
                     f"name=\"{name}.tap{k}\")")
                if k == 0:
                    code(f"nisa.tensor_scalar(dst={acc}, data={xt}, op0=nl.multiply, operand0={wf}[:, 0:1], "
                         f"name=\"{name}.mac\")")
                else:
                    code(f"nisa.scalar_tensor_tensor(dst={acc}, data={xt}, op0=nl.multiply, operand0={wf}[:, {k}:{k + 1}], "
                         f"op1=nl.add, operand1={acc}, name=\"{name}.mac\")")
            res = _bias_and_cast(code, ctx, name, acc, bias, c0, cs, Lout, out.dtype)
            code(f"nisa.dma_copy(dst={ov}.ap(pattern={[[out.strides[1], cs], [out.strides[2], Lout]]}, "
                 f"offset={_off(out, b, c0)}), src={res}, name=\"{name}.store\")")
            scratch[0] = 3 * tile_bytes((cs, Lout), torch.float32) + 2 * tile_bytes((cs, K), torch.float32)
        tiled(code, C, PMAX, tile)
    _batches(code, B, channels)
    return scratch[0]


def _dense(ins: TensorOp, ctx: Context, code: Code, x: TRef, w: TRef, bias: TRef | None, stride: int,
           dilation: int, Lout: int) -> int:
    B, C, _ = x.shape
    Co, _, K = w.shape
    out, name = ins.outs[0], ins.name_stem()
    xv, wv, ov = ctx.var(x.value), ctx.var(w.value), ctx.var(out.value)
    if x.dtype != w.dtype:
        raise CodegenError(f"a convolution of {x.dtype} by {w.dtype}")

    def outputs(b: str) -> None:
        def co_tile(o0: str, os_: int, _f: str) -> None:
            ps = tile_alloc(code, (os_, Lout), torch.float32, name, "ps", buffer="psum")

            def ci_tile(c0: str, cs: int, first_c: str) -> None:
                for k in range(K):
                    wt = tile_alloc(code, (cs, os_), w.dtype, name, "wT")
                    code(f"nisa.dma_copy(dst={wt}, src={wv}.ap(pattern={[[w.strides[1], cs], [w.strides[0], os_]]}, "
                         f"offset={w.offset + k * w.strides[2]} + {o0} * {w.strides[0]} + {c0} * {w.strides[1]}), "
                         f"name=\"{name}.w\")")
                    pat, off = _window(x, b, c0, k, dilation, stride, Lout)
                    xt = tile_alloc(code, (cs, Lout), x.dtype, name, "x")
                    code(f"nisa.dma_copy(dst={xt}, src={xv}.ap(pattern={[[x.strides[1], cs]] + pat}, offset={off}), "
                         f"name=\"{name}.tap{k}\")")
                    first = f"({first_c}) and {k == 0}"
                    code(f"nisa.nc_matmul(dst={ps}, stationary={wt}, moving={xt}, accumulate=not ({first}), "
                         f"name=\"{name}.mm\")")
            tiled(code, C, PMAX, ci_tile)
            res = _bias_and_cast(code, ctx, name, ps, bias, o0, os_, Lout, out.dtype)
            code(f"nisa.dma_copy(dst={ov}.ap(pattern={[[out.strides[1], os_], [out.strides[2], Lout]]}, "
                 f"offset={_off(out, b, o0)}), src={res}, name=\"{name}.store\")")
        tiled(code, Co, PMAX, co_tile)
    _batches(code, B, outputs)
    return 2 * tile_bytes((PMAX, Lout), torch.float32) + tile_bytes((PMAX, PMAX), w.dtype)


def _bias_and_cast(code: Code, ctx: Context, name: str, acc: str, bias: TRef | None, c0: str, cs: int, L: int,
                   dtype: torch.dtype) -> str:
    res = tile_alloc(code, (cs, L), dtype, name, "o")
    if bias is None:
        code(f"nisa.tensor_copy(dst={res}, src={acc}, name=\"{name}.evict\")")
        return res
    bt = tile_alloc(code, (cs, 1), bias.dtype, name, "bias")
    code(f"nisa.dma_copy(dst={bt}, src={ctx.var(bias.value)}.ap(pattern={[[bias.strides[0], cs], [1, 1]]}, "
         f"offset={bias.offset}{f' + {c0} * {bias.strides[0]}' if c0 != '0' else ''}), name=\"{name}.bias\")")
    bf = tile_alloc(code, (cs, 1), torch.float32, name, "biasf")
    code(f"nisa.tensor_copy(dst={bf}, src={bt}, name=\"{name}.biasf\")")
    code(f"nisa.tensor_scalar(dst={res}, data={acc}, op0=nl.add, operand0={bf}, name=\"{name}.addbias\")")
    return res


def _off(out: TRef, b: str, c0: str) -> str:
    terms = [str(out.offset)] + ([f"{b} * {out.strides[0]}"] if b != "0" else []) + \
        ([f"{c0} * {out.strides[1]}"] if c0 != "0" else [])
    return " + ".join(terms)


def _batches(code: Code, B: int, body) -> None:
    if B == 1:
        body("0")
        return
    var = code.fresh("b")
    with code.block(f"for {var} in range({B}):"):
        body(var)


__all__: list[str] = []
