"""MoE experts: only the chosen experts' weights are read, by expert-id-indexed DMA on the dynamic weight stream.

* One token (batch 1): per chosen expert ``idx[0, k]``, its gate/up and down weights and a GEMV; routing weights
  broadcast by a selector matmul.
* ``T > 1`` tokens: grouped by expert. One-hot rows over the experts built on chip from the router's indices give
  each expert's token count; the chosen experts are compacted in expert order (``max8`` / ``nc_match_replace8``)
  into ``S = min(E, T * k)`` *slots*. Slot ``s`` streams the ``s``-th chosen expert's weights once and applies them
  to all ``T`` tokens (tokens moving), weighting each token by its routing weight for that expert (0 when it did
  not choose it). A slot with no expert (fewer than ``S`` chosen) skips its DMAs and compute at run time
  (``nl.dynamic_range`` over registers loaded from the slot's flag): an expert chosen by several tokens is read
  once per step, an expert nobody chose not at all (fewer than 8 experts, an expert-parallel rank's share: the
  ranking row is padded to ``max8``'s 8 with "not chosen"). Accumulation is in expert order (fp32, each term rounded to
  the model dtype), not in top-k rank order: see docs/serving.md "Batches".
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from fusegraph.matching.activations import activation

from fusegraph.codegen.api import (act_op, aten, ChunkUse, code, CodegenError, Context, Emitted,
                                    experts_intermediate_layout, expr, IND, inst_name, ir, largest_divisor, Layout,
                                    linear_pieces, Lowerer, nbytes, nl_dtype, PMAX, register_lowering,
                                    sb2sb_dma_engine, weights as W)
from .moe_experts import moe_experts


@dataclass
class Experts(ir.Instruction):
    """out = sum_k w[t,k] * down[e](act(gate[e] x_t) * up[e] x_t), e = idx[t,k]; only chosen experts are read."""

    opcode: ClassVar[str] = "experts"
    x: ir.Value
    weights: ir.Value
    indices: ir.Value
    gate_up: ir.Value  # WEIGHT [E, ...] laid out per expert
    down: ir.Value
    out: ir.Value
    intermediate: int
    act: str = "silu"
    #: each routed term ``w * y`` rounded to the model dtype before the fp32 sum (HF's bf16 routing weights, or its
    #: eager loop's ``.to(dtype)``); False for the ``*fp32_weights`` variants (HF Mixtral's fp32 routing weights:
    #: fp32 products summed in fp32, rounded once at the end)
    round_terms: bool = True
    #: expert parallelism (``lowering_ep.py``): ``[T, K]`` fp32, 1 where the choice is one of this
    #: rank's experts; the one-token path then runs (DMAs, matmuls, accumulation) only those choices (None: all)
    mine: ir.Value | None = None

    def constrain(self, c: ir.Constraints) -> None:
        c.same(self.x, self.out)

    def arg_specs(self, layouts: dict[str, Layout], add: ir.AddSpec) -> None:
        lx, lo = layouts[self.x.name], layouts[self.out.name]
        mid = experts_intermediate_layout(self.intermediate)
        gu_out = Layout(mid.P, 2 * mid.FT)
        add(self.gate_up, f"experts_gate_up:{lx}:{gu_out}", lambda t, a=lx, b=gu_out: W.experts(t, a, b))
        add(self.down, f"experts_down:{mid}:{lo}", lambda t, a=mid, b=lo: W.experts(t, a, b))

    def slots(self, tokens: int) -> int:
        """Expert slots of the grouped path: at most every expert, at most one per (token, choice)."""
        return min(self.gate_up.shape[0], tokens * self.weights.shape[-1])

    def _tiles(self) -> tuple[int, int]:
        """Experts on partitions (``EP``) x tiles (``ET``) for the per-expert affinity rows."""
        E = self.gate_up.shape[0]
        EP = largest_divisor(E)
        return EP, E // EP

    def constants(self, ctx: Context) -> dict[str, ir.Constant]:
        if ctx.tokens > 1:
            return {"c_ones": ir.Constant(W.ones(PMAX), "ones")}
        dt = str(self.weights.dtype).split(".")[-1]
        return {f"c_sel_{dt}": ir.Constant(W.token_selectors(ctx.tokens, PMAX, self.weights.dtype), "selectors")}

    def setup(self, ctx: Context) -> list[str]:
        """Grouped path: the iota tables the grouping compares against, shared by every layer."""
        T = ctx.tokens
        if T == 1:
            return []
        E, S = self.gate_up.shape[0], self.slots(T)
        EP, ET = self._tiles()
        names = {"iota": (f"moe_iota:{T}:{E}", f"moe_iota_{T}x{E}"), "rev": (f"moe_rev:{E}", f"moe_rev_{E}"),
                 "eidx": (f"moe_eidx:{EP}:{ET}:{S}", f"moe_eidx_{EP}x{ET}x{S}")}
        new = {k: var for k, (key, var) in names.items() if key not in ctx.inputs}
        for k, (key, var) in names.items():
            ctx.inputs.setdefault(key, var)
        if not new:
            return []
        return [code("experts_group_tables.j2", T=T, E=E, EP=EP, ET=ET, S=S, iota=new.get("iota"),
                     rev=new.get("rev"), eidx=new.get("eidx"))]

    def emit(self, ctx: Context, i: int) -> Emitted:
        if ctx.tokens > 1:
            return self._emit_grouped(ctx, i)
        lx = ctx.layout(self.x)
        T = ctx.tokens
        K = self.weights.shape[-1]
        E = self.gate_up.shape[0]
        gu_shape = ctx.shape(self.gate_up)  # [E, Pk, NTg, KT, Pg]
        dn_shape = ctx.shape(self.down)  # [E, Pi, NTh_out, KTi, Ph]
        _, Pk, NTg, KT, Pg = gu_shape
        _, Pi, NTo, KTi, Ph = dn_shape
        if NTg % 2 or NTg // 2 != KTi or Pg != Pi:
            raise CodegenError("experts gate/up output layout must split evenly into gate and up halves")
        name = inst_name(self)
        out = ctx.var(self.out)
        wb = f"{out}_wb"
        dt = self.out.dtype
        e = Emitted(sbuf=lx.FT * T * (4 + nbytes(dt)) + T * K * 4 + (NTg + 2 * KTi) * nbytes(dt) + NTo * 2 * nbytes(dt),
                    psum_banks=2)
        e.code("experts_open.j2", module=self.module or "", aten=aten(self), name=name, K=K, E=E, T=T, Ph=Ph, FTh=NTo,
               acc=f"{out}_acc", wb=wb, wbps=f"{out}_wbps", sel=ctx.consts["selectors"], weights=ctx.var(self.weights))
        gu, dn = ctx.var(self.gate_up), ctx.var(self.down)
        idx = ctx.var(self.indices)
        kh = ctx.split(K)
        bounds = f"{out}_bounds" if self.mine is not None else None
        if bounds:  # every choice's registers before any weight DMA (the stream may issue them early)
            e.code("experts_ep_bounds.j2", name=name, K=K, bounds=bounds, mine=ctx.var(self.mine))
            e.sbuf += 8 * K
            for kk in range(kh or K):
                e.code("experts_ep_register.j2", lo=f"{out}_lo{kk}", hi=f"{out}_hi{kk}", bounds=bounds,
                       k=expr("exprs.j2", "core_index", per_core=kh, i=kk))
        for t in range(T):
            for kk in range(kh or K):
                k = expr("exprs.j2", "core_index", per_core=kh, i=kk)
                sel = expr("exprs.j2", "expert_id", idx=idx, t=t, k=k)
                sub = f"{name}.t{t}k{kk}"
                guard = (f"{out}_lo{kk}", f"{out}_hi{kk}") if bounds else None
                lin = partial(_guarded_linear, e, guard) if guard else partial(linear_pieces, e)
                gu_tile = f"{out}_gu"
                e.code("linear_open.j2", module=f"{self.module or 'experts'} gate/up of expert idx[{t},{k}]", aten="bmm",
                       N=NTg * Pg, K=KT * Pk, out=gu_tile, Pn=Pg, NT=NTg, T=1, dtype=nl_dtype(dt), name=sub,
                       nchunks="streamed")

                def gu_src(n0: int, n1: int, sel: str = sel) -> str:
                    return expr("exprs.j2", "expert_weight", w=gu, P=Pg, NT=NTg, KT=KT, Pk=Pk, n0=n0, n1=n1, sel=sel)

                lin(name=f"{sub}.gu", x=ctx.var(self.x), tok=f"{t}:{t + 1}", out=gu_tile, w_hbm=gu,
                    w_src=gu_src, Pk=Pk, KT=KT, Pn=Pg, NT=NTg, T=1, wdtype=self.gate_up.dtype,
                    chunk_bytes=ctx.chunk_bytes, earliest=i, index=i, stream="dynamic")
                e.code("experts_ep_combine.j2" if guard else "experts_combine.j2", name=sub, hact=f"{out}_ga",
                       h=f"{out}_h", gu=gu_tile, Pg=Pg, NTh=KTi, act_op=act_op(self.act), dtype=nl_dtype(dt),
                       **(dict(lo=guard[0], hi=guard[1]) if guard else {}))
                y = f"{out}_y"
                e.code("linear_open.j2", module=f"{self.module or 'experts'} down of expert idx[{t},{k}]", aten="bmm",
                       N=NTo * Ph, K=KTi * Pi, out=y, Pn=Ph, NT=NTo, T=1, dtype=nl_dtype(dt), name=sub,
                       nchunks="streamed")

                def dn_src(n0: int, n1: int, sel: str = sel) -> str:
                    return expr("exprs.j2", "expert_weight", w=dn, P=Ph, NT=NTo, KT=KTi, Pk=Pi, n0=n0, n1=n1, sel=sel)

                lin(name=f"{sub}.down", x=f"{out}_h", tok="0:1", out=y, w_hbm=dn, w_src=dn_src, Pk=Pi,
                    KT=KTi, Pn=Ph, NT=NTo, T=1, wdtype=self.down.dtype, chunk_bytes=ctx.chunk_bytes,
                    earliest=i, index=i, stream="dynamic")
                e.code("experts_ep_accumulate.j2" if guard else "experts_accumulate.j2", name=sub, yw=f"{out}_yw",
                       y=y, wb=wb, t=t, k=k, acc=f"{out}_acc", Ph=Ph, FTh=NTo,
                       dtype=nl_dtype(dt) if self.round_terms else "nl.float32",
                       **(dict(lo=guard[0], hi=guard[1]) if guard else {}))
        e.code("experts_close.j2", out=out, acc=f"{out}_acc", Ph=Ph, FTh=NTo, T=T, dtype=nl_dtype(dt), name=name,
               lnc=bool(kh), engine=sb2sb_dma_engine(Ph, NTo * T, 4))
        return e

    def _emit_grouped(self, ctx: Context, i: int) -> Emitted:
        """T > 1 tokens: grouped by expert (see the module docstring)."""
        T = ctx.tokens
        if T > PMAX:
            raise CodegenError(f"MoE experts over {T} tokens: the routing tiles hold at most {PMAX} tokens")
        K = self.weights.shape[-1]
        E = self.gate_up.shape[0]
        S = self.slots(T)
        R = -(-S // 8)
        EP, ET = self._tiles()
        _, Pk, NTg, KT, Pg = ctx.shape(self.gate_up)
        _, Pi, NTo, KTi, Ph = ctx.shape(self.down)
        if NTg % 2 or NTg // 2 != KTi or Pg != Pi:
            raise CodegenError("experts gate/up output layout must split evenly into gate and up halves")
        name = inst_name(self)
        out = ctx.var(self.out)
        dt = self.out.dtype
        db = nbytes(dt)
        half = ctx.split(S)  # LNC=2: core pid runs slots pid, pid + 2, ... (the used slots are a prefix)
        mine = [(f"pid + {2 * j}" if half else str(j), j) for j in range(half or S)]
        sbuf = (NTo * T * (4 + db) + 12 * E + 4 * max(0, 8 - E) + 8 * K + 4 * E + 16 * R + 8 * S + 4 * ET * (T + 2 * S)
                + 4 * T + T * db * (NTg + 2 * KTi + 2 * NTo))
        e = Emitted(sbuf=sbuf, psum_banks=3)
        v = f"{out}_"
        regs = [(f"{v}lo{j}", f"{v}hi{j}", s) for s, j in mine]
        e.code("experts_group_open.j2", module=self.module or "", aten=aten(self), name=name, K=K, E=E, T=T, S=S, R=R,
               EP=EP, ET=ET, Ph=Ph, FTh=NTo, acc=f"{v}acc", idxf=f"{v}idxf", wf=f"{v}wf", oh=f"{v}onehot",
               mask=f"{v}mask", aff=f"{v}aff", cnt=f"{v}count", rank=f"{v}rank", top=f"{v}top", slot=f"{v}slot",
               bounds=f"{v}bounds", regs=regs, afft=f"{v}affT", atps=f"{v}affT_ps", slotf=f"{v}slotf",
               sbc=f"{v}slot_bcast", sel=f"{v}sel", indices=ctx.var(self.indices), weights=ctx.var(self.weights),
               ones=ctx.consts["ones"], iota=ctx.inputs[f"moe_iota:{T}:{E}"], rev=ctx.inputs[f"moe_rev:{E}"],
               eidx=ctx.inputs[f"moe_eidx:{EP}:{ET}:{S}"])
        gu, dn = ctx.var(self.gate_up), ctx.var(self.down)
        for (lo, hi, s), (_, j) in zip(regs, mine):
            sub = f"{name}.s{j}"
            sel = f"{v}slot[0:1, nl.ds({s}, 1)]"
            e.code("experts_group_slot.j2", name=sub, s=s, lo=lo, hi=hi, ws=f"{v}w", wps=f"{v}w_ps", Ph=Ph, T=T,
                   EP=EP, ET=ET, S=S, sel=f"{v}sel", afft=f"{v}affT")
            gu_tile = f"{out}_gu"
            e.code("linear_open.j2", module=f"{self.module or 'experts'} gate/up of expert slot[0, {s}]", aten="bmm",
                   N=NTg * Pg, K=KT * Pk, out=gu_tile, Pn=Pg, NT=NTg, T=T, dtype=nl_dtype(dt), name=sub,
                   nchunks="streamed")

            def gu_src(n0: int, n1: int, sel: str = sel) -> str:
                return expr("exprs.j2", "expert_weight", w=gu, P=Pg, NT=NTg, KT=KT, Pk=Pk, n0=n0, n1=n1, sel=sel)

            _guarded_linear(e, (lo, hi), name=f"{sub}.gu", x=ctx.var(self.x), tok=":", out=gu_tile, w_hbm=gu,
                            w_src=gu_src, Pk=Pk, KT=KT, Pn=Pg, NT=NTg, T=T, wdtype=self.gate_up.dtype,
                            chunk_bytes=ctx.chunk_bytes, earliest=i, index=i, stream="dynamic")
            e.code("experts_group_combine.j2", name=sub, hact=f"{out}_ga", h=f"{out}_h", gu=gu_tile, Pg=Pg, NTh=KTi,
                   T=T, act_op=act_op(self.act), dtype=nl_dtype(dt), lo=lo, hi=hi)
            y = f"{out}_y"
            e.code("linear_open.j2", module=f"{self.module or 'experts'} down of expert slot[0, {s}]", aten="bmm",
                   N=NTo * Ph, K=KTi * Pi, out=y, Pn=Ph, NT=NTo, T=T, dtype=nl_dtype(dt), name=sub,
                   nchunks="streamed")

            def dn_src(n0: int, n1: int, sel: str = sel) -> str:
                return expr("exprs.j2", "expert_weight", w=dn, P=Ph, NT=NTo, KT=KTi, Pk=Pi, n0=n0, n1=n1, sel=sel)

            _guarded_linear(e, (lo, hi), name=f"{sub}.down", x=f"{out}_h", tok=":", out=y, w_hbm=dn, w_src=dn_src,
                            Pk=Pi, KT=KTi, Pn=Ph, NT=NTo, T=T, wdtype=self.down.dtype, chunk_bytes=ctx.chunk_bytes,
                            earliest=i, index=i, stream="dynamic")
            e.code("experts_group_accumulate.j2", name=sub, yw=f"{out}_yw", y=y, ws=f"{v}w", acc=f"{v}acc", Ph=Ph,
                   FTh=NTo, T=T, dtype=nl_dtype(dt) if self.round_terms else "nl.float32", lo=lo, hi=hi)
        e.code("experts_close.j2", out=out, acc=f"{v}acc", Ph=Ph, FTh=NTo, T=T, dtype=nl_dtype(dt), name=name,
               lnc=bool(half), engine=sb2sb_dma_engine(Ph, NTo * T, 4))
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        x = env[self.x.name]
        gu, dn = env[self.gate_up.name], env[self.down.name]
        w, idx = env[self.weights.name], env[self.indices.name].long()
        T, K = idx.shape
        act = activation(self.act).fn
        out = torch.zeros(T, x.shape[1], dtype=torch.float32)
        if T == 1:  # the per-token kernel: top-k rank order
            for t in range(T):
                for k in range(K):
                    e = int(idx[t, k])
                    g, u = F.linear(x[t:t + 1], gu[e]).chunk(2, dim=-1)
                    y = F.linear(act(g) * u, dn[e])
                    out[t] += self._term(y[0], w[t, k], x.dtype)
        else:  # the grouped kernel: expert order, each expert applied to every token
            for e in sorted(set(idx.reshape(-1).tolist())):
                g, u = F.linear(x, gu[e]).chunk(2, dim=-1)
                y = F.linear(act(g) * u, dn[e])
                for t, k in (idx == e).nonzero().tolist():
                    out[t] += self._term(y[t], w[t, k], x.dtype)
        env[self.out.name] = out.to(x.dtype)

    def _term(self, y: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """One routed term in fp32: rounded to ``dtype`` first unless ``round_terms`` is off."""
        term = y.float() * w.float()  # torch's bf16 x fp32 product (bf16 x bf16: exact in fp32, then rounded)
        return (term.to(dtype) if self.round_terms else term).float()


def _guard(piece: str, start: str, stop: str) -> str:
    """A code piece (rendered at the kernel body's indentation) run only when range(start, stop) has a step."""
    pad = " " * IND
    body = "".join(("    " + line) if line.strip() else line for line in piece.splitlines(keepends=True))
    return f"{pad}for _ in nl.dynamic_range(start={start}, stop={stop}):\n{body}"


def _guarded_linear(e: Emitted, guard: tuple[str, str], **kw: Any) -> None:
    """:func:`~..emitters.linear_pieces` whose weight DMAs and matmuls all run under ``guard``."""
    sub = Emitted()
    linear_pieces(sub, **kw)
    for p in sub.pieces:
        if isinstance(p, ChunkUse):
            p.chunk.guard = guard
            e.pieces.append(p)
        else:
            e.pieces.append(_guard(p, *guard))
    e.psum_banks = max(e.psum_banks, sub.psum_banks)


def expert_operands(L: Lowerer, m: Any, what: str = "experts") -> tuple[ir.Value, ...]:
    """(x, routing weights, expert indices, gate_up, down) of an experts match. The experts' weight DMAs are
    indexed by the choices in SBUF: a router pattern's own ROUTING tiles, or any router the kernel computed (a
    sigmoid, group-limited or sparsemixer router lowered generically) or received, loaded token-major
    (``Lowerer.routing``), so experts do not depend on one router form."""
    x = L.act(L.input(m, "x"), L.views(m, "x"))
    wv = L.routing(L.input(m, "weights"), L.views(m, "weights"))
    iv = L.routing(L.input(m, "indices"), L.views(m, "indices"), dtype=torch.int32)
    if what and wv.shape != iv.shape:
        raise CodegenError(f"{what}: routing weights {wv.shape} and expert ids {iv.shape} differ")
    return x, wv, iv, L.hbm(L.input(m, "gate_up_proj")), L.hbm(L.input(m, "down_proj"))


@register_lowering(moe_experts, instructions=[Experts])
def lower_experts(L: Lowerer, m: Any) -> None:
    x, wv, iv, gu, dn = expert_operands(L, m)
    out = L.new_act(L.output(m), L.label(m))
    # HF's batched/grouped forms with fp32 routing weights (Mixtral's router) sum fp32 products, rounded once
    round_terms = not str(getattr(m, "variant", "")).startswith(("batched_mm_fp32_weights", "grouped_mm_fp32_weights"))
    L.emit(Experts(x=x, weights=wv, indices=iv, gate_up=gu, down=dn, out=out, intermediate=gu.shape[1] // 2,
                   act=str(m.params.get("act", "silu")), round_terms=round_terms), m)
