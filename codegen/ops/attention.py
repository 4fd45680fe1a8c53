"""Grouped-query decode attention over the whole static cache with an additive mask (+ Gemma 2 soft-capping).

Per kv head: K row tiles transposed on the Tensor engine, scores for the head group, scale (+ ``tanh``
soft-capping) + mask, softmax (``tensor_reduce`` max, ``activation(exp)`` with reduce, ``reciprocal``), P^T V
accumulated over position tiles. The score rounding follows the captured implementation: HF eager rounds to the
query dtype after each op, SDPA keeps fp32 (the match's ``variant``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .. import ir
from ..emitters import MOVING_MAX, PSUM_FREE_FP32, Context, Emitted, aten, expr, inst_name, nbytes, tiles
from ..errors import CodegenError
from ..layout import PMAX
from ..lowering import Lowerer
from ..registry import register_lowering
from ..render import nl_dtype

V = ir.ValueKind


@dataclass
class Attention(ir.Instruction):
    """Grouped-query decode attention over the whole static cache with an additive mask."""

    opcode: ClassVar[str] = "attention"
    q: ir.Value  # ACT [T, Hq * D]
    k_cache: ir.Value  # STATE [B, Hkv, L, D] (already holds this step's rows)
    v_cache: ir.Value
    mask: ir.Value  # INPUT [T, L] fp32 additive
    out: ir.Value  # ACT [T, Hq * D]
    scale: float
    groups: int  # query heads per kv head
    rounding: str = "eager"  # "eager": scores rounded to q's dtype after each op, like HF eager; "fused": fp32 (SDPA)
    softcap: float = 0.0  # Gemma 2: scores -> tanh(scores / softcap) * softcap before the mask (0: off)

    def constrain(self, c: ir.Constraints) -> None:
        c.heads(self.q, self.k_cache.shape[-1])
        c.heads(self.out, self.k_cache.shape[-1])

    def emit(self, ctx: Context, i: int) -> Emitted:
        B, Hkv, L, D = self.k_cache.shape
        Hq = self.q.features // D
        G = self.groups
        T = ctx.tokens
        if Hq != Hkv * G:
            raise CodegenError(f"{Hq} query heads are not {Hkv} kv heads x {G}")
        lay = ctx.layout(self.q)
        S = lay.split  # partition tiles per head (D > 128): q.k^T accumulates over them, P.V yields one per tile
        if ctx.layout(self.out) != lay or lay.P * S != D:
            raise CodegenError(f"attention over heads of {D} features needs q and out split alike ({lay}, "
                               f"{ctx.layout(self.out)})")
        if G > PMAX or lay.P > PMAX or S * G > PSUM_FREE_FP32:
            raise CodegenError(f"attention group {G} or head size {D} exceeds {PMAX} partitions")
        v = ctx.var(self.out)
        kvb = nbytes(self.k_cache.dtype)
        qb = nbytes(self.q.dtype)
        e = Emitted(sbuf=S * L * kvb + L * (4 + 4 + qb) + (L * nbytes(self.mask.dtype)) + 2 * D * kvb * max(1, L // PMAX)
                    + Hq * T * qb,
                    psum_banks=3)
        # bf16 eager attention rounds after the matmul, the scale and the mask add; SDPA keeps scores in fp32
        exact = self.q.dtype != torch.float32 and self.rounding == "eager"
        cap = self.softcap
        per_core = ctx.split(Hkv)
        e.code("attention.j2", module=self.module or "", aten=aten(self), name=inst_name(self), D=D, Hq=Hq, Hkv=Hkv,
               G=G, L=L, T=T, out=v, dtype=nl_dtype(self.out.dtype), kv_dtype=nl_dtype(self.k_cache.dtype),
               mask=f"{v}_mask", mask_hbm=ctx.var(self.mask), mask_dtype=nl_dtype(self.mask.dtype),
               kT=f"{v}_kT", kn=f"{v}_kn", kps=f"{v}_kps", s=f"{v}_s", sps=f"{v}_sps", negmax=f"{v}_negmax",
               e=f"{v}_e", ssum=f"{v}_ssum", rsum=f"{v}_rsum", p=f"{v}_p", ops=f"{v}_ops", pTps=f"{v}_pTps",
               pT=f"{v}_pT", vn=f"{v}_vn", q=ctx.var(self.q), k_cache=ctx.var(self.k_cache),
               v_cache=ctx.var(self.v_cache), tiles=tiles(L, PMAX), chunks=[(c, s) for c, s, _ in tiles(L, MOVING_MAX)],
               scale=repr(float(self.scale)), exact_rounding=exact,
               score_dtype=nl_dtype(self.q.dtype if exact else torch.float32),
               softcap=repr(float(cap)) if cap else "", inv_softcap=repr(1.0 / cap) if cap else "",
               scale_over_cap=repr(float(self.scale) / cap) if cap else "",
               g_range=expr("exprs.j2", "core_range", per_core=per_core, total=Hkv),
               half=per_core * G if per_core else 0, whole=L > PMAX and L % PMAX == 0, split=S, P=lay.P)
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        k, v = env[self.k_cache.name], env[self.v_cache.name]
        B, Hkv, L, D = k.shape
        q = env[self.q.name].reshape(B, -1, 1, D)
        mask = env[self.mask.name].reshape(B, 1, 1, L)
        k = k.repeat_interleave(self.groups, dim=1)
        v = v.repeat_interleave(self.groups, dim=1)
        if self.rounding == "eager":
            scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        else:
            scores = torch.matmul(q.float(), k.float().transpose(2, 3)) * self.scale
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores + (mask if self.rounding == "eager" else mask.float())
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        env[self.out.name] = torch.matmul(p, v).reshape(self.out.shape)

    def shard(self) -> ir.Shard:
        return ir.Shard(("heads",), "each core attends with its kv heads and their query groups")


def _check(m: Any, graph: Any, tokens: int | None) -> str | None:
    if not m.inputs.get("mask"):
        return "decode attention without a mask input is not supported (the static cache needs one)"
    return None


@register_lowering("decode_attention", check=_check, instructions=[Attention])
def lower_attention(L: Lowerer, m: Any) -> None:
    q_node = L.input(m, "q")
    q = L.act(q_node, L.views(m, "q"))
    k = L.hbm(L.input(m, "k"))
    v = L.hbm(L.input(m, "v"))
    if k.kind != V.STATE:
        raise CodegenError("attention keys must be the KV cache updated by this step")
    B, Hkv, Lc, D = k.shape
    mask_node = m.inputs.get("mask")
    if not mask_node:
        raise CodegenError("decode attention without a mask input is not supported (the static cache needs one)")
    bool_mask = L.node(mask_node).get("dtype") == "bool"
    mask = L.step_input(mask_node, (L.T, Lc), torch.float32 if bool_mask else None, label="attn_mask")
    if bool_mask:
        L.arg_source(mask).convert = "bool_mask"
    groups = int(m.params.get("num_key_value_groups") or m.params.get("groups") or (q.features // D) // Hkv)
    scale = float(m.params.get("scale", D ** -0.5))
    out = L.new_act(L.output(m), L.label(m, "attn"))
    # the pattern's SDPA implementations keep the scores in fp32; its eager one rounds them like HF eager
    rounding = "fused" if str(getattr(m, "variant", "")).startswith("sdpa") else "eager"
    L.emit(Attention(q=q, k_cache=k, v_cache=v, mask=mask, out=out, scale=scale, groups=groups, rounding=rounding,
                     softcap=float(m.params.get("softcap") or 0.0)), m)
