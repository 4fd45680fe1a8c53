"""The grouped-expert ops of HF's ``grouped_mm`` MoE path on the tensor path: the grouped matmul
(``transformers.grouped_mm_fallback``, ``aten._grouped_mm``) and ``histc`` (tokens per expert).

Why here and not only as a pattern: HF runs every MoE family's experts through one function
(``grouped_mm_experts_forward``) with per-family hooks -- biases, a custom gate (GPT-OSS's clamped, interleaved
SwiGLU), weights stored ``[E, in, out]`` or ``[E, out, in]``, a post-expert norm. The ``moe_experts`` pattern is the
fast path for the common form; any other form still runs in the kernel through these ops and the generic ones
around them (sort, gathers, pointwise, cumsum).

``grouped_mm(x [S, K], W [E, K, N], offs [E])``: row ``s`` of the output is ``x[s] @ W[e(s)]`` with ``e(s)`` the
group holding ``s`` (``offs`` are the groups' cumulative ends: ``e(s) = #{i : offs[i] <= s}``); rows past
``offs[-1]`` are zero (the fallback op's value; ``aten._grouped_mm`` leaves them unwritten). On chip, per row:
``e(s)`` is counted from ``offs`` broadcast to every partition (a compare and a free-axis sum), each K tile of
``W[e(s)]`` is read by an indirect DMA whose per-partition row offsets are ``e(s) * stride_E + k`` (so only the
chosen expert's weights are read: ``S x K x N`` elements, the bytes a per-slot expert kernel reads), and the
Tensor engine contracts ``x[s]`` (``[k, 1]``, contraction on partitions) against it into PSUM, accumulated over
K tiles. Decode has few rows (tokens x top-k), so the rows are a trace-time loop.

``histc(x, bins, min, max)``: bins on partitions, ``x`` broadcast along the free axis; bin ``floor((x - min) *
bins / (max - min))`` (``max`` itself in the last bin, values outside ``[min, max]`` or NaN ignored), counted by a
compare with each partition's bin index and a free-axis sum. The bin is computed in fp32 as ``(x - min) * (bins /
(max - min))``: a value within an ulp of a bin edge may fall in the neighbouring bin where eager's
``(x - min) * bins / (max - min)`` does not (expert ids, integers from 0 to bins - 1, never are). Integer ids (HF
histograms int ids on accelerators, float ids on CPU) are counted alike; the reference VM counts them as floats
(CPU PyTorch has no integer ``histc``) in the ids' own type.
"""
from __future__ import annotations

import math

import torch

from ..emitters import Context, MOVING_MAX
from ..errors import CodegenError
from ..layout import PMAX
from .instruction import TensorOp, register_emitter, register_reference, tile_alloc, tile_bytes
from .matmul import tiled
from .pointwise import emit_floor
from .tiles import FREE_MAX, Code
from .view import TRef

#: rows (tokens x top-k) a grouped matmul takes: each is a trace-time iteration
ROWS_MAX = 512
#: weight rows the indirect DMA addresses exactly (fp32 integer arithmetic on chip)
INDEX_MAX = 1 << 24


def _elem(ref: TRef, *terms: str | int) -> str:
    """``ref``'s element offset plus ``terms`` (ints or kernel expressions) as kernel source."""
    parts = [str(ref.offset)] if ref.offset else []
    parts += [str(t) for t in terms if t not in (0, "0", "")]
    return " + ".join(parts) or "0"


def _row_vector(ctx: Context, ref: TRef, partitions: int) -> str:
    """A 1-D ``ref`` of ``n`` elements read onto ``partitions`` partitions, each the whole vector (stride 0)."""
    (n,), (st,) = ref.shape, ref.strides
    return f"{ctx.var(ref.value)}.ap(pattern=[[0, {partitions}], [{st}, {n}]], offset={_elem(ref)})"


@register_emitter("transformers.grouped_mm_fallback.default", "aten._grouped_mm.default")
def _grouped_mm(ins: TensorOp, ctx: Context, code: Code) -> int:
    x, w = ins.args[0], ins.args[1]
    offs = ins.args[2] if len(ins.args) > 2 else ins.kwargs.get("offs")
    bias = ins.args[3] if len(ins.args) > 3 else ins.kwargs.get("bias")
    out_dtype = ins.args[4] if len(ins.args) > 4 else ins.kwargs.get("out_dtype")
    if not all(isinstance(r, TRef) for r in (x, w, offs)) or bias is not None or out_dtype not in (None, x.dtype):
        raise CodegenError(f"{ins.op} other than (x [S, K], W [E, K, N], offs [E]) without bias or out_dtype")
    if len(x.shape) != 2 or len(w.shape) != 3 or len(offs.shape) != 1 or offs.shape[0] != w.shape[0] \
            or x.shape[1] != w.shape[1]:
        raise CodegenError(f"{ins.op} of {x.shape} x {w.shape} with offsets {offs.shape}")
    if not x.dtype.is_floating_point or x.dtype != w.dtype:
        raise CodegenError(f"{ins.op} of {x.dtype} and {w.dtype}")
    S, K = x.shape
    E, _, N = w.shape
    if S > ROWS_MAX:
        raise CodegenError(f"{ins.op} of {S} rows (at most {ROWS_MAX}: one trace-time iteration each)")
    if E > FREE_MAX:
        raise CodegenError(f"{ins.op} over {E} groups")
    return _GroupedMatmul(ins, ctx, code, x, w, offs).emit()


class _GroupedMatmul:
    """One grouped matmul: the group of each row from the offsets, then the row against its group's weights."""

    def __init__(self, ins: TensorOp, ctx: Context, code: Code, x: TRef, w: TRef, offs: TRef) -> None:
        self.ins, self.ctx, self.code, self.x, self.w, self.offs = ins, ctx, code, x, w, offs
        self.name = ins.name_stem()
        self.out = ins.outs[0]
        sE, sK, _ = w.strides
        numel = math.prod(w.value.shape) or 1
        self.m = math.gcd(math.gcd(abs(sE), abs(sK)) or 1, numel)  # the indirect DMA's row: m elements
        self.rows = numel // self.m
        if self.rows >= INDEX_MAX:
            raise CodegenError(f"{ins.op}: {self.rows} weight rows are beyond the exact on-chip index arithmetic")
        self.scratch = 0

    def emit(self) -> int:
        code, name, ctx = self.code, self.name, self.ctx
        S, K = self.x.shape
        E = self.w.shape[0]
        raw = tile_alloc(code, (PMAX, E), self.offs.dtype, name, "offs_raw")
        code(f"nisa.dma_copy(dst={raw}, src={_row_vector(ctx, self.offs, PMAX)}, name=\"{name}.offs\")")
        offs = tile_alloc(code, (PMAX, E), torch.float32, name, "offs")
        code(f"nisa.tensor_copy(dst={offs}, src={raw}, name=\"{name}.offsf\")")
        self.scratch = tile_bytes((PMAX, E), torch.float32) + tile_bytes((PMAX, E), self.offs.dtype)
        s = code.fresh("s")
        with code.block(f"for {s} in range({S}):"):
            self._row(s, offs, E, K)
        return self.scratch

    def _row(self, s: str, offs: str, E: int, K: int) -> None:
        code, name = self.code, self.name
        le = tile_alloc(code, (PMAX, E), torch.float32, name, "le")
        code(f"nisa.tensor_scalar(dst={le}, data={offs}, op0=nl.less_equal, operand0=float({s}), name=\"{name}.le\")")
        grp = tile_alloc(code, (PMAX, 1), torch.float32, name, "grp")
        code(f"nisa.tensor_reduce(dst={grp}, op=nl.add, data={le}, axis=(1,), name=\"{name}.group\")")
        valid = tile_alloc(code, (PMAX, 1), torch.float32, name, "valid")
        code(f"nisa.tensor_scalar(dst={valid}, data={grp}, op0=nl.less, operand0={float(E)!r}, name=\"{name}.valid\")")
        code(f"nisa.tensor_scalar(dst={grp}, data={grp}, op0=nl.minimum, operand0={float(E - 1)!r}, "
             f"name=\"{name}.clamp\")")
        self.scratch += tile_bytes((PMAX, E), torch.float32) + 3 * 4
        N = self.w.shape[2]
        tiled(code, N, MOVING_MAX, lambda n0, ns, _f: self._tile(s, grp, valid, K, n0, ns))

    def _tile(self, s: str, grp: str, valid: str, K: int, n0: str, ns: int) -> None:
        code, name, ctx, x, w = self.code, self.name, self.ctx, self.x, self.w
        sE, sK, sN = w.strides
        ps = tile_alloc(code, (1, ns), torch.float32, name, "ps", buffer="psum")

        def k_tile(k0: str, ks: int, first: str) -> None:
            xs = tile_alloc(code, (ks, 1), x.dtype, name, "x")
            code(f"nisa.dma_copy(dst={xs}, src={ctx.var(x.value)}.ap(pattern=[[{x.strides[1]}, {ks}], [1, 1]], "
                 f"offset={_elem(x, f'{s} * {x.strides[0]}', f'{k0} * {x.strides[1]}')}), name=\"{name}.loadx\")")
            rowf = tile_alloc(code, (ks, 1), torch.float32, name, "rowf")
            code(f"nisa.iota(dst={rowf}, pattern=[[0, 1]], offset={k0} * {sK // self.m}, "
                 f"channel_multiplier={sK // self.m}, name=\"{name}.krow\")")
            code(f"nisa.scalar_tensor_tensor(dst={rowf}, data={grp}[0:{ks}, :], op0=nl.multiply, "
                 f"operand0={float(sE // self.m)!r}, op1=nl.add, operand1={rowf}, name=\"{name}.erow\")")
            rows = tile_alloc(code, (ks, 1), torch.int32, name, "rows")
            code(f"nisa.tensor_copy(dst={rows}, src={rowf}, name=\"{name}.rows\")")
            wt = tile_alloc(code, (ks, ns), w.dtype, name, "w")
            code(f"nisa.dma_copy(dst={wt}, src={ctx.var(w.value)}.reshape(({self.rows}, {self.m})).ap("
                 f"pattern=[[{self.m}, {ks}], [{sN}, {ns}]], offset={_elem(w, f'{n0} * {sN}')}, "
                 f"vector_offset={rows}, indirect_dim=0), name=\"{name}.loadw\")")
            code(f"nisa.nc_matmul(dst={ps}, stationary={xs}, moving={wt}, accumulate=not ({first}), "
                 f"name=\"{name}.mm\")")
            self.scratch = max(self.scratch, tile_bytes((ks, ns), w.dtype) + 16)
        tiled(code, K, PMAX, k_tile)
        o = tile_alloc(code, (1, ns), self.out.dtype, name, "o")
        code(f"nisa.tensor_scalar(dst={o}, data={ps}, op0=nl.multiply, operand0={valid}[0:1, :], "
             f"name=\"{name}.evict\")")
        out = self.out
        code(f"nisa.dma_copy(dst={ctx.var(out.value)}.ap(pattern=[[0, 1], [{out.strides[1]}, {ns}]], "
             f"offset={_elem(out, f'{s} * {out.strides[0]}', f'{n0} * {out.strides[1]}')}), src={o}, "
             f"name=\"{name}.store\")")
        self.scratch += tile_bytes((1, ns), torch.float32)


@register_emitter("aten.histc.default")
def _histc(ins: TensorOp, ctx: Context, code: Code) -> int:
    x = ins.args[0]
    bins = int(ins.args[1]) if len(ins.args) > 1 else int(ins.kwargs.get("bins", 100))
    lo = float(ins.args[2]) if len(ins.args) > 2 else float(ins.kwargs.get("min", 0))
    hi = float(ins.args[3]) if len(ins.args) > 3 else float(ins.kwargs.get("max", 0))
    if not isinstance(x, TRef) or len(x.shape) != 1:
        raise CodegenError("histc of other than a 1-D tensor")
    if not hi > lo:  # min == max: eager takes the data's own range
        raise CodegenError("histc without a static range (min >= max)")
    n = x.shape[0]
    if n > FREE_MAX:
        raise CodegenError(f"histc of {n} values")
    name, out = ins.name_stem(), ins.outs[0]
    scale = bins / (hi - lo)
    scratch = 0

    def body(b0: str, bs: int, _first: str) -> None:
        nonlocal scratch
        t = tile_alloc(code, (bs, n), x.dtype, name, "x")
        code(f"nisa.dma_copy(dst={t}, src={_row_vector(ctx, x, bs)}, name=\"{name}.load\")")
        inr, top, v = (tile_alloc(code, (bs, n), torch.float32, name, w) for w in ("in", "hi", "bin"))
        code(f"nisa.tensor_scalar(dst={inr}, data={t}, op0=nl.greater_equal, operand0={lo!r}, name=\"{name}.lo\")")
        code(f"nisa.tensor_scalar(dst={top}, data={t}, op0=nl.less_equal, operand0={hi!r}, name=\"{name}.hi\")")
        code(f"nisa.tensor_tensor(dst={inr}, data1={inr}, data2={top}, op=nl.multiply, name=\"{name}.inrange\")")
        code(f"nisa.tensor_scalar(dst={v}, data={t}, op0=nl.subtract, operand0={lo!r}, op1=nl.multiply, "
             f"operand1={scale!r}, name=\"{name}.pos\")")
        code(f"nisa.tensor_scalar(dst={v}, data={v}, op0=nl.maximum, operand0=0.0, op1=nl.minimum, "
             f"operand1={float(bins - 1)!r}, name=\"{name}.clamp\")")  # x == max: the last bin
        emit_floor(code, v, v, (bs, n), name)
        idx = tile_alloc(code, (bs, 1), torch.float32, name, "bin_of_p")
        code(f"nisa.iota(dst={idx}, pattern=[[0, 1]], offset={b0}, channel_multiplier=1, name=\"{name}.bins\")")
        code(f"nisa.tensor_scalar(dst={v}, data={v}, op0=nl.equal, operand0={idx}, name=\"{name}.hit\")")
        code(f"nisa.tensor_tensor(dst={v}, data1={v}, data2={inr}, op=nl.multiply, name=\"{name}.count\")")
        cnt = tile_alloc(code, (bs, 1), torch.float32, name, "cnt")
        code(f"nisa.tensor_reduce(dst={cnt}, op=nl.add, data={v}, axis=(1,), name=\"{name}.sum\")")
        o = tile_alloc(code, (bs, 1), out.dtype, name, "o")
        code(f"nisa.tensor_copy(dst={o}, src={cnt}, name=\"{name}.cast\")")
        code(f"nisa.dma_copy(dst={ctx.var(out.value)}.ap(pattern=[[{out.strides[0]}, {bs}], [1, 1]], "
             f"offset={_elem(out, f'{b0} * {out.strides[0]}')}), src={o}, name=\"{name}.store\")")
        scratch = max(scratch, tile_bytes((bs, n), x.dtype) + 5 * tile_bytes((bs, n), torch.float32) + 12)
    tiled(code, bins, PMAX, body)
    return scratch


@register_reference("aten.histc.default")
def _histc_reference(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    if x.dtype.is_floating_point:
        return torch.ops.aten.histc.default(x, *args, **kwargs)
    return torch.ops.aten.histc.default(x.float(), *args, **kwargs).to(x.dtype)


__all__ = ["ROWS_MAX"]
