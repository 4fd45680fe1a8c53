"""One emitter per instruction kind: compute tile sizes and names, render the template, declare weight chunks.

An emitter returns :class:`Emitted`: code pieces (strings and :class:`~.stream.ChunkUse` markers) plus the SBUF
scratch it needs per partition and the PSUM banks it holds at once, which the budget check adds up.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from . import ir
from . import weights as W
from .errors import CodegenError
from .layout import PMAX, Layout
from .render import ACTIVATIONS, nl_dtype, render
from .stream import Chunk, ChunkUse

IND = 4  # kernel body indentation
PSUM_FREE_FP32 = 512  # one 2 KiB PSUM bank of fp32 per partition
MOVING_MAX = 512


@dataclass
class Emitted:
    pieces: list = field(default_factory=list)
    sbuf: int = 0  # scratch bytes per partition
    psum_banks: int = 0

    def code(self, template: str, **ctx) -> None:
        self.pieces.append(render(template, indent=IND, **ctx))


@dataclass
class Context:
    tokens: int
    layouts: dict[str, Layout]
    target: str
    chunk_bytes: int
    consts: dict[str, str]  # constant role -> SBUF variable
    inputs: dict[str, str]  # per-step input role -> SBUF variable (ids, kv index, cos/sin, mask)
    specs: dict = field(default_factory=dict)  # kernel argument name -> bind.ArgSpec (kernel shapes/dtypes)
    lnc: int = 1  # 2: the two cores of a logical core split the work (program id `pid`)
    store_only: set = field(default_factory=set)  # values read only by Store instructions (no exchange needed)

    def split(self, n: int) -> int:
        """Items per core when ``n`` items are split between the LNC=2 cores (0: not split)."""
        return n // 2 if self.lnc == 2 and n >= 2 and n % 2 == 0 else 0

    def shape(self, v: ir.Value) -> tuple[int, ...]:
        return tuple(self.specs[v.name].shape) if v.name in self.specs else tuple(v.shape)

    def kdtype(self, v: ir.Value) -> torch.dtype:
        return self.specs[v.name].dtype if v.name in self.specs else v.dtype

    def var(self, v: ir.Value) -> str:
        return f"x_{v.name}" if v.kind in (ir.ValueKind.ACT, ir.ValueKind.ROUTING) else v.name

    def layout(self, v: ir.Value) -> Layout:
        return self.layouts[v.name]


_NAMES: dict[int, str] = {}  # id(instruction) -> its unique name in the kernel being generated


def _inst_name(ins: ir.Instruction) -> str:
    """``L<layer>.<module>.<op>``, unique per instruction in the kernel (see :func:`assign_names`)."""
    return _NAMES.get(id(ins)) or _base_name(ins)


def _base_name(ins: ir.Instruction) -> str:
    parts = [p for p in (ins.module or ins.opcode).split(".") if not p.isdigit()]
    tail = parts[-1] if parts else ins.opcode
    prefix = f"L{ins.layer}" if ins.layer is not None else "top"
    return f"{prefix}.{tail}.{ins.opcode}"


def assign_names(instructions: list[ir.Instruction]) -> None:
    """Give every instruction a unique name: the two RoPEs of a layer become ``...rope`` and ``...rope2``."""
    _NAMES.clear()
    seen: dict[str, int] = {}
    for ins in instructions:
        base = _base_name(ins)
        seen[base] = seen.get(base, 0) + 1
        _NAMES[id(ins)] = base if seen[base] == 1 else f"{base}{seen[base]}"


def _aten(ins: ir.Instruction) -> str:
    return ins.pattern or ins.opcode


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


EMITTERS: dict[type, Callable[[ir.Instruction, Context, int], Emitted]] = {}


def emitter(cls: type) -> Callable:
    def deco(fn: Callable) -> Callable:
        EMITTERS[cls] = fn
        return fn

    return deco


def emit(ins: ir.Instruction, ctx: Context, index: int) -> Emitted:
    fn = EMITTERS.get(type(ins))
    if fn is None:
        raise CodegenError(f"no NKI template for instruction {ins.opcode}")
    return fn(ins, ctx, index)


# ---------------------------------------------------------------------------------------------------------------
@emitter(ir.Embed)
def _embed(ins: ir.Embed, ctx: Context, i: int) -> Emitted:
    lay = ctx.layout(ins.out)
    H = ins.table.shape[1]
    pattern = lay.row_pattern()
    e = Emitted(sbuf=lay.FT * ctx.tokens * _bytes(ins.out.dtype) + 4 * ctx.tokens)
    assert lay.features == H
    e.code("embed.j2", module=ins.module or "embed_tokens", aten=_aten(ins), name=_inst_name(ins), T=ctx.tokens,
           ids=f"ids_{ins.out.name}", ids_hbm=ctx.var(ins.ids), out=ctx.var(ins.out), P=lay.P, FT=lay.FT,
           dtype=nl_dtype(ins.out.dtype), table=ctx.var(ins.table), pattern=pattern,
           scale=ctx.var(ins.scale) if ins.scale is not None else None)
    return e


@emitter(ir.ScalarGate)
def _sigmoid_gate(ins: ir.ScalarGate, ctx: Context, i: int) -> Emitted:
    lay = ctx.layout(ins.x)
    T = ctx.tokens
    v = ctx.var(ins.out)
    e = Emitted(sbuf=lay.FT * T * _bytes(ins.out.dtype) + 3 * 4 * T, psum_banks=1)
    e.code("sigmoid_gate.j2", module=ins.module or "", aten=_aten(ins), name=_inst_name(ins), P=lay.P, FT=lay.FT, T=T,
           gate=ctx.var(ins.gate), x=ctx.var(ins.x), out=v, g32=f"{v}_g32", gps=f"{v}_gps", sg=f"{v}_sg",
           sg32=f"{v}_sg32", ones=ctx.consts["ones"], gdtype=nl_dtype(ins.gate.dtype), dtype=nl_dtype(ins.out.dtype))
    return e


@emitter(ir.Load)
def _load(ins: ir.Load, ctx: Context, i: int) -> Emitted:
    lay = ctx.layout(ins.out)
    F, T = ins.out.features, ctx.tokens
    pattern = lay.row_pattern() + [[F, T]]
    e = Emitted()
    e.code("load.j2", what=ins.src.name, T=T, F=F, P=lay.P, FT=lay.FT, out=ctx.var(ins.out), src=ctx.var(ins.src),
           pattern=pattern, dtype=nl_dtype(ins.out.dtype), name=_inst_name(ins))
    return e


@emitter(ir.RMSNorm)
def _rmsnorm(ins: ir.RMSNorm, ctx: Context, i: int) -> Emitted:
    lay = ctx.layout(ins.x)
    T = ctx.tokens
    per_head = ins.group != ins.x.features
    if per_head and lay.P * lay.split != ins.group:
        raise CodegenError(f"per-head norm over {ins.group} features needs them on partitions (layout has {lay.P})")
    if per_head and lay.heads * T > PSUM_FREE_FP32:
        raise CodegenError(f"per-head norm of {lay.heads} heads x {T} tokens exceeds one PSUM bank")
    if ins.center and per_head:
        raise CodegenError("per-head LayerNorm has no template")
    v = ctx.var(ins.out)
    scratch = lay.FT * T * (4 + 2 * _bytes(ins.x.dtype)) + 4 * T * (lay.FT if per_head else 1)
    if ins.center:  # fp32 copy, centered values, fp32 product before the bias
        scratch += lay.FT * T * 12 + 4 * T
    e = Emitted(sbuf=scratch, psum_banks=2 if ins.center else 1)
    weight = _norm_param_chunk(e, ins.weight, ctx, f"{_inst_name(ins)}.w", i)
    xw = f"{v}_xw" if ins.bias is not None else ""
    e.code("rmsnorm.j2", module=ins.module or "", aten=_aten(ins), name=_inst_name(ins), per_head=per_head,
           P=lay.P, FT=lay.FT, T=T, x=ctx.var(ins.x), out=v, sq=f"{v}_sq", ss=f"{v}_ss", rstd=f"{v}_rstd",
           xn=f"{v}_xn", ones=ctx.consts["ones"], eps=repr(float(ins.eps)), inv_n=repr(1.0 / ins.group),
           weight=weight, center=ins.center, xf=f"{v}_xf", ms=f"{v}_ms", nmean=f"{v}_nmean", xc=f"{v}_xc",
           neg_inv_n=repr(-1.0 / ins.group), xw=xw, split=lay.split if per_head else 1, H=lay.heads,
           xdtype=nl_dtype(ins.x.dtype), dtype=nl_dtype(ins.out.dtype))
    if ins.bias is not None:  # its chunk is used after the weight's, so a ring of one buffer still works
        bias = _norm_param_chunk(e, ins.bias, ctx, f"{_inst_name(ins)}.b", i)
        e.code("norm_bias.j2", module=ins.module or "", name=_inst_name(ins), T=T, out=v, xw=xw, bias=bias)
    return e


def _norm_param_chunk(e: Emitted, w: ir.Value | None, ctx: Context, name: str, i: int) -> str | None:
    """Stream a norm's per-feature parameter: per-head norms get a per-partition fp32 scalar ([D, 1]; a head split
    over S partition tiles: [P, S], one column per tile), hidden norms a [P, FT] tile."""
    if w is None:
        return None
    shape, dt = ctx.shape(w), ctx.kdtype(w)
    chunk = Chunk(shape=shape, dtype=nl_dtype(dt), src=ctx.var(w), name=name, earliest=0,
                  nbytes_per_partition=shape[-1] * _bytes(dt))
    e.pieces.append(ChunkUse(chunk, i))
    return chunk.token


def _linear_chunks(n_total: int, per_nt_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    per = max(1, chunk_bytes // max(1, per_nt_bytes))
    return [(n0, min(n_total, n0 + per)) for n0 in range(0, n_total, per)]


def linear_pieces(e: Emitted, *, name: str, x: str, tok: str, out: str, w_hbm: str, w_src: Callable[[int, int], str],
                  Pk: int, KT: int, Pn: int, NT: int, T: int, wdtype: torch.dtype, chunk_bytes: int, earliest: int,
                  index: int, bias: str | None = None, out_tok: str = ":", base: str = "",
                  stream: str = "static") -> None:
    """Chunked weight-stationary matmuls: out[:, nt, tok] = sum_kt W[:, nt, kt, :]^T x[:, kt, tok].

    ``base``: an expression added to every output chunk index (this core's first chunk under LNC=2)."""
    if Pn > PMAX or Pk > PMAX:
        raise CodegenError(f"linear tile {Pk}x{Pn} exceeds {PMAX} partitions")
    if T > PSUM_FREE_FP32:
        raise CodegenError(f"{T} tokens exceed one PSUM bank per output chunk")
    per_nt = KT * Pn * _bytes(wdtype)
    # a chunk's outputs share one PSUM tile (one eviction per chunk): at most one bank of fp32
    chunk_bytes = min(chunk_bytes, max(per_nt, (PSUM_FREE_FP32 // max(1, T)) * per_nt))
    for n0, n1 in _linear_chunks(NT, per_nt, chunk_bytes):
        chunk = Chunk(shape=(Pk, n1 - n0, KT, Pn), dtype=nl_dtype(wdtype), src=w_src(n0, n1), name=f"{name}.w{n0}",
                      earliest=earliest, nbytes_per_partition=(n1 - n0) * per_nt, stream=stream)
        e.pieces.append(ChunkUse(chunk, index))
        e.code("linear_chunk.j2", n=n1 - n0, n0=f"{base}{n0}", ps=f"{out}_ps", Pn=Pn, T=T, KT=KT, w=chunk.token, x=x,
               tok=tok, out=out, name=name, bias=bias, out_tok=out_tok)
    e.psum_banks = max(e.psum_banks, 1)


@emitter(ir.Linear)
def _linear(ins: ir.Linear, ctx: Context, i: int) -> Emitted:
    li, lo = ctx.layout(ins.x), ctx.layout(ins.out)
    T = ctx.tokens
    N, K = ins.out.features, ins.x.features
    e = Emitted(sbuf=lo.FT * T * _bytes(ins.out.dtype))
    name = _inst_name(ins)
    out = ctx.var(ins.out)
    half = ctx.split(lo.FT)
    nt_here = half or lo.FT
    base = f"pid * {half} + " if half else ""
    e.code("linear_open.j2", module=ins.module or "", aten=_aten(ins), N=N, K=K, out=out, Pn=lo.P, NT=lo.FT, T=T,
           dtype=nl_dtype(ins.out.dtype), name=name,
           nchunks=len(_linear_chunks(nt_here, li.FT * lo.P * _bytes(ins.weight.dtype), ctx.chunk_bytes))
           * (2 if half else 1))
    w = ctx.var(ins.weight)
    bias = None
    if ins.bias is not None:
        # not a ring chunk: every weight chunk of this linear reads it, while the ring moves on
        shape, dt = ctx.shape(ins.bias), ctx.kdtype(ins.bias)
        bias = f"{out}_bias"
        e.code("dma_chunk.j2", var=bias, shape=shape, dtype=nl_dtype(dt), src=ctx.var(ins.bias), name=f"{name}.b")
        e.sbuf += shape[-1] * _bytes(dt)

    def src(n0: int, n1: int) -> str:
        return f"{w}[:, nl.ds({base}{n0}, {n1 - n0}), :, :]" if half else f"{w}[:, {n0}:{n1}, :, :]"

    linear_pieces(e, name=name, x=ctx.var(ins.x), tok=":", out=out, w_hbm=w, w_src=src, Pk=li.P, KT=li.FT,
                  Pn=lo.P, NT=nt_here, T=T, wdtype=ins.weight.dtype, chunk_bytes=ctx.chunk_bytes, earliest=0,
                  index=i, bias=bias, base=base)
    if half and ins.out.name not in ctx.store_only:
        e.code("lnc_exchange.j2", what=f"{ins.module or 'linear'} output chunks", x=out, half=half, name=name)
    return e


@emitter(ir.Rope)
def _rope(ins: ir.Rope, ctx: Context, i: int) -> Emitted:
    lay = ctx.layout(ins.x)
    T = ctx.tokens
    if lay.FT * T > PSUM_FREE_FP32:
        raise CodegenError(f"RoPE over {lay.FT} heads x {T} tokens exceeds one PSUM bank")
    v = ctx.var(ins.out)
    e = Emitted(sbuf=3 * lay.FT * T * _bytes(ins.out.dtype), psum_banks=1)
    if lay.split != 1:
        return _rope_split(ins, ctx, lay, e)
    e.code("rope.j2", module=ins.module or "", aten=_aten(ins), name=_inst_name(ins), P=lay.P, FT=lay.FT, T=T,
           rot=f"{v}_rot", rotation=ctx.consts[f"rotation:{lay.P}:{rotary_key(ins)}:{ins.x.dtype}"],
           x=ctx.var(ins.x), split=1,
           a=f"{v}_a", b=f"{v}_b", out=v, dtype=nl_dtype(ins.out.dtype),
           cos=ctx.inputs[rope_table_key("cos", lay)], sin=ctx.inputs[rope_table_key("sin", lay)])
    return e


def _rope_split(ins: ir.Rope, ctx: Context, lay: Layout, e: Emitted) -> Emitted:
    """RoPE on heads split over partition tiles (head_dim > 128): rotate_half maps tile j to tile j +- S/2, so
    when every block of the rotation is a signed identity it is a signed copy per tile (out_j = x_j cos_j +- x_i
    sin_j, no matmul, exact like the eager negation); other rotations (partial, interleaved) contract over the
    tiles with one [P, P] block matmul each, accumulated in PSUM."""
    matrix = W.rotate_half_matrix(ins.head_dim, ins.x.dtype, ins.rotary_dim, ins.interleaved)
    blocks = W.rotation_blocks(matrix, lay.P)
    swap = W.rotation_is_tile_swap(blocks)
    v = ctx.var(ins.out)
    rotation = "" if swap else ctx.consts[f"rotation:{ins.head_dim}:{rotary_key(ins)}:{ins.x.dtype}"]
    e.code("rope.j2", module=ins.module or "", aten=_aten(ins), name=_inst_name(ins), P=lay.P, FT=lay.FT, T=ctx.tokens,
           split=lay.split, H=lay.heads, D=ins.head_dim, blocks=blocks, swap=swap, rot=f"{v}_rot",
           rotation=rotation, x=ctx.var(ins.x), a=f"{v}_a", b=f"{v}_b", out=v, dtype=nl_dtype(ins.out.dtype),
           cos=ctx.inputs[rope_table_key("cos", lay)], sin=ctx.inputs[rope_table_key("sin", lay)])
    return e


def rope_table_key(which: str, lay: Layout) -> str:
    """The per-step cos/sin table (``which``) a RoPE on values of layout ``lay`` reads: one per layout, loaded
    once per step and shared by every layer."""
    return f"{which}:{lay.FT}" if lay.split == 1 else f"{which}:{lay.heads}x{lay.split}:{lay.P}"


def rotary_key(ins: ir.Rope) -> str:
    """Which rotation matrix a RoPE uses: rotary dim, ``i`` for the interleaved (pair) rotation."""
    return f"{ins.rotary_dim or ins.head_dim}{'i' if ins.interleaved else ''}"


@emitter(ir.KVWrite)
def _kv_write(ins: ir.KVWrite, ctx: Context, i: int) -> Emitted:
    B, H, L, D = ins.cache.shape
    if B != ctx.tokens:
        raise CodegenError(f"KV cache batch {B} != {ctx.tokens} decode tokens (multi-token steps are not supported)")
    lay = ctx.layout(ins.value)
    if lay.P * lay.split != D or lay.heads != H:
        raise CodegenError(f"KV write of {lay.heads} heads of {lay.P * lay.split} features into a cache of {H} x {D}")
    e = Emitted()
    # a head split over partition tiles (D > 128) is written from its tiles: P features per tile, tile stride P
    e.code("kv_write.j2", module=ins.module or "", aten=_aten(ins), name=_inst_name(ins), T=ctx.tokens, D=D, H=H, L=L,
           cache=ctx.var(ins.cache), index=ctx.inputs["kv_index"], value=ctx.var(ins.value), half=ctx.split(H),
           split=lay.split, P=lay.P)
    return e


def _tiles(n: int, size: int) -> list[tuple[int, int, bool]]:
    return [(s, min(size, n - s), s == 0) for s in range(0, n, size)]


@emitter(ir.Attention)
def _attention(ins: ir.Attention, ctx: Context, i: int) -> Emitted:
    B, Hkv, L, D = ins.k_cache.shape
    Hq = ins.q.features // D
    G = ins.groups
    T = ctx.tokens
    if Hq != Hkv * G:
        raise CodegenError(f"{Hq} query heads are not {Hkv} kv heads x {G}")
    lay = ctx.layout(ins.q)
    S = lay.split  # partition tiles per head (D > 128): q.k^T accumulates over them, P.V yields one per tile
    if ctx.layout(ins.out) != lay or lay.P * S != D:
        raise CodegenError(f"attention over heads of {D} features needs q and out split alike ({lay}, {ctx.layout(ins.out)})")
    if G > PMAX or lay.P > PMAX or S * G > PSUM_FREE_FP32:
        raise CodegenError(f"attention group {G} or head size {D} exceeds {PMAX} partitions")
    v = ctx.var(ins.out)
    kvb = _bytes(ins.k_cache.dtype)
    qb = _bytes(ins.q.dtype)
    e = Emitted(sbuf=S * L * kvb + L * (4 + 4 + qb) + (L * _bytes(ins.mask.dtype)) + 2 * D * kvb * max(1, L // PMAX)
                + Hq * T * qb,
                psum_banks=3)
    # bf16 eager attention rounds after the matmul, the scale and the mask add; SDPA keeps scores in fp32
    exact = ins.q.dtype != torch.float32 and ins.rounding == "eager"
    e.code("attention.j2", module=ins.module or "", aten=_aten(ins), name=_inst_name(ins), D=D, Hq=Hq, Hkv=Hkv, G=G,
           L=L, T=T, out=v, dtype=nl_dtype(ins.out.dtype), kv_dtype=nl_dtype(ins.k_cache.dtype),
           mask=f"{v}_mask", mask_hbm=ctx.var(ins.mask), mask_dtype=nl_dtype(ins.mask.dtype),
           kT=f"{v}_kT", kn=f"{v}_kn", kps=f"{v}_kps", s=f"{v}_s", sps=f"{v}_sps", negmax=f"{v}_negmax",
           e=f"{v}_e", ssum=f"{v}_ssum", rsum=f"{v}_rsum", p=f"{v}_p", ops=f"{v}_ops", pTps=f"{v}_pTps",
           pT=f"{v}_pT", vn=f"{v}_vn", q=ctx.var(ins.q), k_cache=ctx.var(ins.k_cache), v_cache=ctx.var(ins.v_cache),
           tiles=_tiles(L, PMAX), chunks=[(c, s) for c, s, _ in _tiles(L, MOVING_MAX)], scale=repr(float(ins.scale)),
           exact_rounding=exact, score_dtype=nl_dtype(ins.q.dtype if exact else torch.float32),
           softcap=repr(float(ins.softcap)) if ins.softcap else "", inv_softcap=repr(1.0 / ins.softcap) if ins.softcap else "",
           scale_over_cap=repr(float(ins.scale) / ins.softcap) if ins.softcap else "",
           g_range=f"pid * {ctx.split(Hkv)}, pid * {ctx.split(Hkv)} + {ctx.split(Hkv)}" if ctx.split(Hkv) else str(Hkv),
           half=ctx.split(Hkv) * G if ctx.split(Hkv) else 0, whole=L > PMAX and L % PMAX == 0, split=S, P=lay.P)
    return e


@emitter(ir.Add)
def _add(ins: ir.Add, ctx: Context, i: int) -> Emitted:
    lay = ctx.layout(ins.out)
    e = Emitted(sbuf=lay.FT * ctx.tokens * _bytes(ins.out.dtype))
    e.code("add.j2", module=ins.module or "", aten=_aten(ins), name=_inst_name(ins), P=lay.P, FT=lay.FT, T=ctx.tokens,
           out=ctx.var(ins.out), a=ctx.var(ins.a), b=ctx.var(ins.b), dtype=nl_dtype(ins.out.dtype))
    return e


def act_op(act: str) -> str:
    try:
        return ACTIVATIONS[act]
    except KeyError:
        raise CodegenError(f"activation {act!r} has no NKI template") from None


@emitter(ir.GatedAct)
def _gated(ins: ir.GatedAct, ctx: Context, i: int) -> Emitted:
    lay = ctx.layout(ins.out)
    v = ctx.var(ins.out)
    e = Emitted(sbuf=2 * lay.FT * ctx.tokens * _bytes(ins.out.dtype))
    e.code("gated_act.j2", module=ins.module or "", aten=_aten(ins), name=_inst_name(ins), P=lay.P, FT=lay.FT,
           T=ctx.tokens, g=f"{v}_g", out=v, gate=ctx.var(ins.gate), up=ctx.var(ins.up), act=ins.act,
           act_op=act_op(ins.act), dtype=nl_dtype(ins.out.dtype))
    return e


@emitter(ir.Router)
def _router(ins: ir.Router, ctx: Context, i: int) -> Emitted:
    lay = ctx.layout(ins.x)
    T = ctx.tokens
    E = ins.weight.shape[0]
    if not 8 <= E <= MOVING_MAX:
        raise CodegenError(f"router over {E} experts: the max8 top-k template needs 8..{MOVING_MAX} experts")
    if ins.top_k > 8:
        raise CodegenError(f"top-{ins.top_k} routing: the template handles k <= 8 (one max8)")
    v = ctx.var(ins.weights)
    e = Emitted(sbuf=E * 4 * 4 + E * _bytes(ins.weights.dtype) + 128, psum_banks=1)
    w = ctx.var(ins.weight)
    chunk = Chunk(shape=ctx.shape(ins.weight), dtype=nl_dtype(ins.weight.dtype), src=w, name=f"{_inst_name(ins)}.w",
                  earliest=0, nbytes_per_partition=lay.FT * E * _bytes(ins.weight.dtype))
    e.pieces.append(ChunkUse(chunk, i))
    e.code("router.j2", module=ins.module or "", aten=_aten(ins), name=_inst_name(ins), T=T, E=E, KT=lay.FT,
           K=ins.top_k, normalize=ins.normalize, x=ctx.var(ins.x), w=chunk.token, dtype=nl_dtype(ins.weights.dtype),
           lps=f"{v}_lps", logits=f"{v}_logits", negmax=f"{v}_negmax", e=f"{v}_e", ssum=f"{v}_ssum",
           rsum=f"{v}_rsum", probs=f"{v}_probs", top8=f"{v}_top8", indices=ctx.var(ins.indices), weights=v,
           ksum=f"{v}_ksum", krs=f"{v}_krs", rest=f"{v}_rest", next8=f"{v}_next8", tie_t=f"{v}_tie",
           tie=ctx.var(ins.tie) if ins.tie is not None else None, tie_first=ins.tie_first)
    return e


@emitter(ir.Guard)
def _guard(ins: ir.Guard, ctx: Context, i: int) -> Emitted:
    e = Emitted()
    e.code("guard.j2", reason=ins.reason, T=ctx.tokens, dst=ctx.var(ins.dst), x=ctx.var(ins.x), name=_inst_name(ins),
           only_core0=ctx.lnc == 2)
    return e


@emitter(ir.Experts)
def _experts(ins: ir.Experts, ctx: Context, i: int) -> Emitted:
    lx = ctx.layout(ins.x)
    T = ctx.tokens
    K = ins.weights.shape[-1]
    E = ins.gate_up.shape[0]
    gu_shape = ctx.shape(ins.gate_up)  # [E, Pk, NTg, KT, Pg]
    dn_shape = ctx.shape(ins.down)  # [E, Pi, NTh_out, KTi, Ph]
    _, Pk, NTg, KT, Pg = gu_shape
    _, Pi, NTo, KTi, Ph = dn_shape
    if NTg % 2 or NTg // 2 != KTi or Pg != Pi:
        raise CodegenError("experts gate/up output layout must split evenly into gate and up halves")
    name = _inst_name(ins)
    out = ctx.var(ins.out)
    wb = f"{out}_wb"
    dt = ins.out.dtype
    e = Emitted(sbuf=lx.FT * T * (4 + _bytes(dt)) + T * K * 4 + (NTg + 2 * KTi) * _bytes(dt) + NTo * 2 * _bytes(dt),
                psum_banks=2)
    e.code("experts_open.j2", module=ins.module or "", aten=_aten(ins), name=name, K=K, E=E, T=T, Ph=Ph, FTh=NTo,
           acc=f"{out}_acc", wb=wb, wbps=f"{out}_wbps", sel=ctx.consts["selectors"], weights=ctx.var(ins.weights))
    gu, dn = ctx.var(ins.gate_up), ctx.var(ins.down)
    idx = ctx.var(ins.indices)
    kh = ctx.split(K)
    for t in range(T):
        for kk in range(kh or K):
            k = f"pid * {kh} + {kk}" if kh else str(kk)
            sel = f"{idx}[{t}:{t + 1}, nl.ds({k}, 1)]"
            sub = f"{name}.t{t}k{kk}"
            gu_tile = f"{out}_gu"
            e.code("linear_open.j2", module=f"{ins.module or 'experts'} gate/up of expert idx[{t},{k}]", aten="bmm",
                   N=NTg * Pg, K=KT * Pk, out=gu_tile, Pn=Pg, NT=NTg, T=1, dtype=nl_dtype(dt), name=sub,
                   nchunks="streamed")

            def gu_src(n0: int, n1: int, sel: str = sel) -> str:
                return (f"{gu}.ap(pattern=[[{NTg * KT * Pg}, {Pk}], [{KT * Pg}, {n1 - n0}], [{Pg}, {KT}], [1, {Pg}]], "
                        f"offset={n0 * KT * Pg}, scalar_offset={sel}, indirect_dim=0)")

            linear_pieces(e, name=f"{sub}.gu", x=ctx.var(ins.x), tok=f"{t}:{t + 1}", out=gu_tile, w_hbm=gu,
                          w_src=gu_src, Pk=Pk, KT=KT, Pn=Pg, NT=NTg, T=1, wdtype=ins.gate_up.dtype,
                          chunk_bytes=ctx.chunk_bytes, earliest=i, index=i, stream="dynamic")
            e.code("experts_combine.j2", name=sub, hact=f"{out}_ga", h=f"{out}_h", gu=gu_tile, Pg=Pg, NTh=KTi,
                   act_op=act_op(ins.act), dtype=nl_dtype(dt))
            y = f"{out}_y"
            e.code("linear_open.j2", module=f"{ins.module or 'experts'} down of expert idx[{t},{k}]", aten="bmm",
                   N=NTo * Ph, K=KTi * Pi, out=y, Pn=Ph, NT=NTo, T=1, dtype=nl_dtype(dt), name=sub, nchunks="streamed")

            def dn_src(n0: int, n1: int, sel: str = sel) -> str:
                return (f"{dn}.ap(pattern=[[{NTo * KTi * Ph}, {Pi}], [{KTi * Ph}, {n1 - n0}], [{Ph}, {KTi}], [1, {Ph}]], "
                        f"offset={n0 * KTi * Ph}, scalar_offset={sel}, indirect_dim=0)")

            linear_pieces(e, name=f"{sub}.down", x=f"{out}_h", tok="0:1", out=y, w_hbm=dn, w_src=dn_src, Pk=Pi,
                          KT=KTi, Pn=Ph, NT=NTo, T=1, wdtype=ins.down.dtype, chunk_bytes=ctx.chunk_bytes,
                          earliest=i, index=i, stream="dynamic")
            e.code("experts_accumulate.j2", name=sub, yw=f"{out}_yw", y=y, wb=wb, t=t, k=k, acc=f"{out}_acc",
                   Ph=Ph, FTh=NTo, dtype=nl_dtype(dt))
    e.code("experts_close.j2", out=out, acc=f"{out}_acc", Ph=Ph, FTh=NTo, T=T, dtype=nl_dtype(dt), name=name,
           lnc=bool(kh))
    return e


@emitter(ir.Elementwise)
def _generic(ins: ir.Elementwise, ctx: Context, i: int) -> Emitted:
    """One NKI instruction per op of the piece; full values are [P, FT, T] tiles, per-token scalars fp32 [P, T]
    tiles (identical on every partition, so they broadcast over features as per-partition operands)."""
    T = ctx.tokens
    full = [v for v, c in zip(ins.inputs + ins.outputs, ins.input_classes + ("full",) * len(ins.outputs)) if c == "full"]
    if not full:
        raise CodegenError("generic lowering needs at least one full activation")
    lay = ctx.layout(full[0])
    P, FT = lay.P, lay.FT
    base = ctx.var(ins.outputs[0]) if ins.outputs else f"g{i}"
    e = Emitted(psum_banks=1)
    tiles: dict[str, tuple[str, str]] = {}  # local name -> (expression, class)
    lines: list[str] = []
    counter = [0]

    def fresh(cls: str, dtype: torch.dtype) -> str:
        counter[0] += 1
        var = f"{base}_t{counter[0]}"
        shape = {"full": f"({P}, {FT}, {T})", "token": f"({P}, {T})", "feature": f"({P}, {FT})"}[cls]
        lines.append(f'{var} = nl.ndarray(shape={shape}, dtype={nl_dtype(dtype)}, buffer=nl.sbuf, name="{_inst_name(ins)}.t{counter[0]}")')
        e.sbuf += {"full": FT * T, "token": T, "feature": FT}[cls] * _bytes(dtype)
        return var

    for v, name, cls in zip(ins.inputs, ins.input_names, ins.input_classes):
        if cls == "full":
            tiles[name] = (ctx.var(v), "full")
        elif cls == "feature":
            shape, dt = ctx.shape(v), ctx.kdtype(v)
            chunk = Chunk(shape=shape, dtype=nl_dtype(dt), src=ctx.var(v), name=f"{_inst_name(ins)}.{v.name}",
                          earliest=0, nbytes_per_partition=shape[-1] * _bytes(dt))
            e.pieces.append(ChunkUse(chunk, i))
            tiles[name] = (chunk.token, "feature")
        else:
            raise CodegenError(f"generic lowering: a per-{cls} input from outside the piece is not supported")
    n = 0
    for op in ins.ops:
        kind, _, fn = op.op.partition(":")
        if kind == "copy":
            tiles[op.dst] = tiles[op.srcs[0]]
            continue
        src = [tiles[s] if isinstance(s, str) else (repr(float(s)), "const") for s in op.srcs]
        out_dtype = torch.float32 if op.cls == "token" else op.dtype
        dst = fresh(op.cls, out_dtype)
        nm = f'name="{_inst_name(ins)}.op{n}"'
        n += 1
        if kind == "act":
            lines.append(f"nisa.activation(dst={dst}, op={act_op(fn) if fn in ACTIVATIONS else 'nl.' + fn}, data={src[0][0]}, {nm})")
        elif kind == "recip":
            lines.append(f"nisa.reciprocal(dst={dst}, data={src[0][0]}, {nm})")
        elif kind == "cast":
            lines.append(f"nisa.tensor_copy(dst={dst}, src={src[0][0]}, {nm})")
        elif kind == "scalar":
            lines.append(f"nisa.tensor_scalar(dst={dst}, data={src[0][0]}, op0=nl.{fn}, operand0={src[1][0]}, {nm})")
        elif kind == "sum":
            ps = f"{dst}_ps"
            lines.append(f'{ps} = nl.ndarray(shape=({P}, {T}), dtype=nl.float32, buffer=nl.psum, name="{_inst_name(ins)}.ps")')
            x, _ = src[0]
            sq = fresh("full", torch.float32)  # matmul operands must pair fp32 with fp32
            lines.append(f"nisa.tensor_copy(dst={sq}, src={x}, {nm})")
            lines.append(f"for ft in range({FT}):")
            lines.append(f"    nisa.nc_matmul(dst={ps}, stationary={ctx.consts['ones']}[0:{P}, 0:{P}], moving={sq}[:, ft, :], "
                         f"accumulate=(ft != 0), {nm})")
            lines.append(f"nisa.tensor_scalar(dst={dst}, data={ps}, op0=nl.multiply, operand0={float(op.scale)!r}, {nm})")
        elif kind == "alu":
            (a, ca), (b, cb) = src
            if ca == cb:
                lines.append(f"nisa.tensor_tensor(dst={dst}, data1={a}, data2={b}, op=nl.{fn}, {nm})")
            elif ca == "full" and cb == "token":
                lines.append(f"for t in range({T}):")
                lines.append(f"    nisa.tensor_scalar(dst={dst}[:, :, t], data={a}[:, :, t], op0=nl.{fn}, operand0={b}[:, t:t + 1], {nm})")
            elif ca == "full" and cb == "feature":
                lines.append(f"for t in range({T}):")
                lines.append(f"    nisa.tensor_tensor(dst={dst}[:, :, t], data1={a}[:, :, t], data2={b}, op=nl.{fn}, {nm})")
            elif ca == "feature" and cb == "token":
                lines.append(f"for t in range({T}):")
                lines.append(f"    nisa.tensor_scalar(dst={dst}[:, :, t], data={a}, op0=nl.{fn}, operand0={b}[:, t:t + 1], {nm})")
            else:
                raise CodegenError(f"generic lowering: {fn} of a {ca} and a {cb} value")
        else:
            raise CodegenError(f"generic lowering: unknown op {op.op}")
        if op.cls == "token" and op.dtype != torch.float32:  # round like the eager op, keep fp32 for operands
            r = fresh("token", op.dtype)
            lines.append(f"nisa.tensor_copy(dst={r}, src={dst}, {nm})")
            lines.append(f"nisa.tensor_copy(dst={dst}, src={r}, {nm})")
        tiles[op.dst] = (dst, op.cls)
    for v, name in zip(ins.outputs, ins.output_names):
        expr, cls = tiles[name]
        if cls != "full":
            raise CodegenError(f"generic lowering: output {name} is not a per-token, per-feature value")
        lines.append(f"{ctx.var(v)} = {expr}")
    e.code("generic.j2", ops=", ".join(sorted({o.op for o in ins.ops})), module=ins.module, lines=lines)
    if any(o.op == "sum" for o in ins.ops) and "ones" not in ctx.consts:
        raise CodegenError("generic lowering: the ones constant is missing")
    return e


@emitter(ir.Store)
def _store(ins: ir.Store, ctx: Context, i: int) -> Emitted:
    lay = ctx.layout(ins.x)
    F = ins.x.features
    # partition-major: FT contiguous features per partition; chunk-major: one element per descriptor (slow)
    half = ctx.split(lay.FT) if ins.x.name in ctx.store_only and lay.split == 1 else 0
    n = half or lay.FT
    pattern = [[lay.FT, lay.P], [1, n], [F, ctx.tokens]] if lay.pmajor else [[1, lay.P], [lay.P, n], [F, ctx.tokens]]
    if lay.split != 1:  # a head-split value (heads > 128 partitions): whole, from both tile dims
        pattern = lay.row_pattern() + [[F, ctx.tokens]]
    offset = (f"pid * {half}" if lay.pmajor else f"pid * {half * lay.P}") if half else "0"
    src = f"{ctx.var(ins.x)}[:, nl.ds(pid * {half}, {half}), :]" if half else ctx.var(ins.x)
    e = Emitted()
    e.code("store.j2", what=ins.dst.name, T=ctx.tokens, F=F, P=lay.P, FT=lay.FT, dst=ctx.var(ins.dst),
           x=src, name=_inst_name(ins), pattern=pattern, contiguous=lay.pmajor, offset=offset,
           only_core0=ctx.lnc == 2 and not half)
    return e
