"""Matmuls of any two operands on the tensor path: activation x activation (MLA's absorbed attention, a linear
attention's state update, an attention variant's scores), batched, any strides.

The Tensor engine contracts over partitions: ``out[m, n] = sum_k stationary[k, m] * moving[k, n]`` into PSUM
(``m <= 128``, ``n <= 512`` fp32 per bank, ``k <= 128`` per instruction, accumulated over k tiles). Both operands
are read from HBM with the contraction dim on partitions: for a row-major left operand that is a transposing
access pattern (an element per descriptor, priced as such by the cost model). The fp32 result is evicted to
SBUF in the output's type, a bias (``addmm``/``baddbmm``) added on the way, and stored.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..emitters import Context, MOVING_MAX
from ..errors import CodegenError
from ..layout import PMAX
from .instruction import TensorOp, register_emitter, tile_alloc, tile_bytes
from .tiles import Code, MAX_TILES
from .view import TRef, broadcast_to


def tiled(code: Code, n: int, size: int, emit: Callable[[str, int, str], None]) -> None:
    """Call ``emit(start, extent, first)`` for every tile of ``n`` items: full tiles in one loop, the remainder
    apart (tile shapes are static); ``first`` is a Python expression true for the first tile only."""
    full, rem = divmod(n, size)
    if full == 1:
        emit("0", size, "True")
    elif full:
        var = code.fresh("k")
        with code.block(f"for {var} in range({full}):"):
            emit(f"{var} * {size}", size, f"{var} == 0")
    if rem:
        emit(str(full * size), rem, "True" if not full else "False")


def _ap(ctx: Context, ref: TRef, dims: tuple[int, int], starts: dict[int, str], sizes: tuple[int, int]) -> str:
    """Access pattern of a 2-D tile of ``ref``: ``dims[0]`` on partitions, ``dims[1]`` on the free axis."""
    terms = [str(ref.offset)] if ref.offset else []
    for d, s in starts.items():
        if ref.strides[d] and s != "0":
            terms.append(f"{s} * {ref.strides[d]}")
    pattern = [[ref.strides[dims[0]], sizes[0]], [ref.strides[dims[1]], sizes[1]]]
    return f"{ctx.var(ref.value)}.ap(pattern={pattern}, offset={' + '.join(terms) or '0'})"


@register_emitter("aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.baddbmm.default")
def _matmul(ins: TensorOp, ctx: Context, code: Code) -> int:
    bias, alpha, beta = None, 1.0, 1.0
    if ins.op in ("aten.addmm.default", "aten.baddbmm.default"):
        bias, a, b = ins.args[0], ins.args[1], ins.args[2]
        beta, alpha = float(ins.kwargs.get("beta", 1)), float(ins.kwargs.get("alpha", 1))
        if not isinstance(bias, TRef):
            raise CodegenError(f"{ins.op} of a non-tensor input")
        if beta == 0:  # PyTorch ignores the input then (even its NaN and inf)
            bias = None
    else:
        a, b = ins.args[0], ins.args[1]
    if not (isinstance(a, TRef) and isinstance(b, TRef)):
        raise CodegenError(f"{ins.op} of a non-tensor operand")
    if a.dtype != b.dtype or not a.dtype.is_floating_point:
        raise CodegenError(f"{ins.op} of {a.dtype} and {b.dtype}")
    out = ins.outs[0]
    if bias is not None:
        bias = broadcast_to(bias, out.shape)
    if len(a.shape) == 2:  # one batch: add a unit batch dim so mm and bmm share the loops
        a, b, out = _batched(a), _batched(b), _batched(out)
        bias = _batched(bias) if bias is not None else None
    B, M, K = a.shape
    N = b.shape[2]
    tiles = B * -(-M // PMAX) * -(-N // MOVING_MAX)
    if tiles > MAX_TILES:
        raise CodegenError(f"{ins.op} of {a.shape} x {b.shape} needs {tiles} output tiles")
    mm = _Matmul(ins, ctx, code, a, b, out, bias, K, alpha, beta)

    def batches(bstart: str) -> None:
        tiled(code, M, PMAX, lambda m0, ms, _f: tiled(code, N, MOVING_MAX,
                                                     lambda n0, ns, _g: mm.tile(bstart, m0, ms, n0, ns)))
    if B == 1:
        batches("0")
    else:
        var = code.fresh("b")
        with code.block(f"for {var} in range({B}):"):
            batches(var)
    return mm.scratch


def _batched(ref: TRef) -> TRef:
    return TRef(ref.value, (1,) + ref.shape, (0,) + ref.strides, ref.offset)


class _Matmul:
    """One output tile ``[m, n]`` of one batch: k tiles accumulated in PSUM, evicted, biased, stored."""

    def __init__(self, ins: TensorOp, ctx: Context, code: Code, a: TRef, b: TRef, out: TRef, bias: TRef | None,
                 K: int, alpha: float = 1.0, beta: float = 1.0) -> None:
        self.ins, self.ctx, self.code, self.a, self.b, self.out, self.bias, self.K = ins, ctx, code, a, b, out, bias, K
        self.alpha, self.beta = alpha, beta  # addmm/baddbmm: beta * input + alpha * (a @ b)
        self.name = ins.name_stem()
        self.scratch = 0

    def tile(self, b0: str, m0: str, ms: int, n0: str, ns: int) -> None:
        code, name = self.code, self.name
        ps = tile_alloc(code, (ms, ns), torch.float32, name, "ps", buffer="psum")

        def k_tile(k0: str, ks: int, first: str) -> None:
            st = tile_alloc(code, (ks, ms), self.a.dtype, name, "aT")
            mv = tile_alloc(code, (ks, ns), self.b.dtype, name, "b")
            code(f"nisa.dma_copy(dst={st}, src={_ap(self.ctx, self.a, (2, 1), {0: b0, 1: m0, 2: k0}, (ks, ms))}, "
                 f"name=\"{name}.loadA\")")
            code(f"nisa.dma_copy(dst={mv}, src={_ap(self.ctx, self.b, (1, 2), {0: b0, 1: k0, 2: n0}, (ks, ns))}, "
                 f"name=\"{name}.loadB\")")
            code(f"nisa.nc_matmul(dst={ps}, stationary={st}, moving={mv}, accumulate=not ({first}), "
                 f"name=\"{name}.mm\")")
            self.scratch = max(self.scratch, tile_bytes((ks, ms), self.a.dtype) + tile_bytes((ks, ns), self.b.dtype))
        tiled(code, self.K, PMAX, k_tile)
        o = tile_alloc(code, (ms, ns), self.out.dtype, name, "o")
        if self.bias is not None:
            bt = tile_alloc(code, (ms, ns), self.bias.dtype, name, "bias")
            code(f"nisa.dma_copy(dst={bt}, src={_ap(self.ctx, self.bias, (1, 2), {0: b0, 1: m0, 2: n0}, (ms, ns))}, "
                 f"name=\"{name}.loadbias\")")
            if self.beta != 1.0:
                code(f"nisa.tensor_scalar(dst={bt}, data={bt}, op0=nl.multiply, operand0={self.beta!r}, "
                     f"name=\"{name}.beta\")")
            if self.alpha != 1.0:
                code(f"nisa.scalar_tensor_tensor(dst={o}, data={ps}, op0=nl.multiply, operand0={self.alpha!r}, "
                     f"op1=nl.add, operand1={bt}, name=\"{name}.bias\")")
            else:
                code(f"nisa.tensor_tensor(dst={o}, data1={ps}, data2={bt}, op=nl.add, name=\"{name}.bias\")")
        elif self.alpha != 1.0:
            code(f"nisa.tensor_scalar(dst={o}, data={ps}, op0=nl.multiply, operand0={self.alpha!r}, "
                 f"name=\"{name}.alpha\")")
        else:
            code(f"nisa.tensor_copy(dst={o}, src={ps}, name=\"{name}.evict\")")
        code(f"nisa.dma_copy(dst={_ap(self.ctx, self.out, (1, 2), {0: b0, 1: m0, 2: n0}, (ms, ns))}, src={o}, "
             f"name=\"{name}.store\")")
        self.scratch += 2 * tile_bytes((ms, ns), torch.float32)


__all__ = ["tiled"]
