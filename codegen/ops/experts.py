"""MoE experts: per token and chosen expert, gate/up and down weights fetched by expert-id-indexed DMA (only the
chosen experts are read, on the dynamic weight stream); routing weights broadcast by a selector matmul."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from fusegraph.matching.activations import activation

from .. import ir
from .. import weights as W
from ..emitters import Context, Emitted, act_op, aten, expr, inst_name, linear_pieces, nbytes
from ..errors import CodegenError
from ..layout import PMAX, Layout, experts_intermediate_layout
from ..lowering import Lowerer
from ..registry import register_lowering
from ..render import nl_dtype


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

    def constrain(self, c: ir.Constraints) -> None:
        c.same(self.x, self.out)

    def arg_specs(self, layouts: dict[str, Layout], add: ir.AddSpec) -> None:
        lx, lo = layouts[self.x.name], layouts[self.out.name]
        mid = experts_intermediate_layout(self.intermediate)
        gu_out = Layout(mid.P, 2 * mid.FT)
        add(self.gate_up, f"experts_gate_up:{lx}:{gu_out}", lambda t, a=lx, b=gu_out: W.experts(t, a, b))
        add(self.down, f"experts_down:{mid}:{lo}", lambda t, a=mid, b=lo: W.experts(t, a, b))

    def constants(self, ctx: Context) -> dict[str, ir.Constant]:
        dt = str(self.weights.dtype).split(".")[-1]
        return {f"c_sel_{dt}": ir.Constant(W.token_selectors(ctx.tokens, PMAX, self.weights.dtype), "selectors")}

    def emit(self, ctx: Context, i: int) -> Emitted:
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
        for t in range(T):
            for kk in range(kh or K):
                k = expr("exprs.j2", "core_index", per_core=kh, i=kk)
                sel = expr("exprs.j2", "expert_id", idx=idx, t=t, k=k)
                sub = f"{name}.t{t}k{kk}"
                gu_tile = f"{out}_gu"
                e.code("linear_open.j2", module=f"{self.module or 'experts'} gate/up of expert idx[{t},{k}]", aten="bmm",
                       N=NTg * Pg, K=KT * Pk, out=gu_tile, Pn=Pg, NT=NTg, T=1, dtype=nl_dtype(dt), name=sub,
                       nchunks="streamed")

                def gu_src(n0: int, n1: int, sel: str = sel) -> str:
                    return expr("exprs.j2", "expert_weight", w=gu, P=Pg, NT=NTg, KT=KT, Pk=Pk, n0=n0, n1=n1, sel=sel)

                linear_pieces(e, name=f"{sub}.gu", x=ctx.var(self.x), tok=f"{t}:{t + 1}", out=gu_tile, w_hbm=gu,
                              w_src=gu_src, Pk=Pk, KT=KT, Pn=Pg, NT=NTg, T=1, wdtype=self.gate_up.dtype,
                              chunk_bytes=ctx.chunk_bytes, earliest=i, index=i, stream="dynamic")
                e.code("experts_combine.j2", name=sub, hact=f"{out}_ga", h=f"{out}_h", gu=gu_tile, Pg=Pg, NTh=KTi,
                       act_op=act_op(self.act), dtype=nl_dtype(dt))
                y = f"{out}_y"
                e.code("linear_open.j2", module=f"{self.module or 'experts'} down of expert idx[{t},{k}]", aten="bmm",
                       N=NTo * Ph, K=KTi * Pi, out=y, Pn=Ph, NT=NTo, T=1, dtype=nl_dtype(dt), name=sub,
                       nchunks="streamed")

                def dn_src(n0: int, n1: int, sel: str = sel) -> str:
                    return expr("exprs.j2", "expert_weight", w=dn, P=Ph, NT=NTo, KT=KTi, Pk=Pi, n0=n0, n1=n1, sel=sel)

                linear_pieces(e, name=f"{sub}.down", x=f"{out}_h", tok="0:1", out=y, w_hbm=dn, w_src=dn_src, Pk=Pi,
                              KT=KTi, Pn=Ph, NT=NTo, T=1, wdtype=self.down.dtype, chunk_bytes=ctx.chunk_bytes,
                              earliest=i, index=i, stream="dynamic")
                e.code("experts_accumulate.j2", name=sub, yw=f"{out}_yw", y=y, wb=wb, t=t, k=k, acc=f"{out}_acc",
                       Ph=Ph, FTh=NTo, dtype=nl_dtype(dt))
        e.code("experts_close.j2", out=out, acc=f"{out}_acc", Ph=Ph, FTh=NTo, T=T, dtype=nl_dtype(dt), name=name,
               lnc=bool(kh))
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        x = env[self.x.name]
        gu, dn = env[self.gate_up.name], env[self.down.name]
        w, idx = env[self.weights.name], env[self.indices.name].long()
        T, K = idx.shape
        act = activation(self.act).fn
        out = torch.zeros(T, x.shape[1], dtype=torch.float32)
        for t in range(T):
            for k in range(K):
                e = int(idx[t, k])
                g, u = F.linear(x[t:t + 1], gu[e]).chunk(2, dim=-1)
                y = F.linear(act(g) * u, dn[e])
                out[t] += (y[0] * w[t, k]).to(x.dtype).float()
        env[self.out.name] = out.to(x.dtype)

    def shard(self) -> ir.Shard:
        return ir.Shard(("experts", "intermediate"), "by expert (expert parallelism) or each expert's intermediate "
                        "dim (gate/up column-, down row-parallel)")


@register_lowering("moe_experts", instructions=[Experts])
def lower_experts(L: Lowerer, m: Any) -> None:
    x = L.act(L.input(m, "x"), L.views(m, "x"))
    wv = L.values.get(L.input(m, "weights"))
    iv = L.values.get(L.input(m, "indices"))
    for view in L.views(m, "weights"):
        wv = wv or L.values.get(view)
    for view in L.views(m, "indices"):
        iv = iv or L.values.get(view)
    if wv is None or iv is None:
        raise CodegenError("experts must consume the routing computed by a router in the same kernel")
    gu = L.hbm(L.input(m, "gate_up_proj"))
    dn = L.hbm(L.input(m, "down_proj"))
    out = L.new_act(L.output(m), L.label(m))
    L.emit(Experts(x=x, weights=wv, indices=iv, gate_up=gu, down=dn, out=out, intermediate=gu.shape[1] // 2,
                   act=str(m.params.get("act", "silu"))), m)
