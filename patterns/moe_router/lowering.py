"""MoE router: logits token-major ``[T, E]``, softmax in fp32 (or rounded at each step: ``rounding="rounded"``),
``max8`` + ``nc_match_replace8`` (k distinct experts), renormalization, and the tie guard (see docs/codegen.md,
"MoE routers: ties and guards"; the rounded form: docs/jax.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from fusegraph.codegen.api import (aten, Chunk, ChunkUse, CodegenError, Context, Emitted, inst_name, ir, Layout,
                                    Lowerer, MOVING_MAX, nbytes, nl_dtype, register_lowering, weights as W)
from .pattern import moe_router

V = ir.ValueKind
TIE_REASON = ("MoE router: equal expert probabilities at the top-k boundary (torch.topk's choice between them "
              "is implementation-defined)")


@dataclass
class Router(ir.Instruction):
    """Softmax over experts (fp32), top-k, optional renormalization; routing weights cast to ``weights.dtype``
    (the logits' dtype, or fp32 where the program keeps them in fp32: HF Mixtral's router, ``fp32_weights``).

    The k experts are distinct; among equal probabilities the lower expert index comes first (what
    ``jax.lax.top_k`` documents; torch.topk leaves it to the implementation)."""

    opcode: ClassVar[str] = "router"
    x: ir.Value
    weight: ir.Value  # WEIGHT laid out [P, KT, E]
    weights: ir.Value  # ROUTING [T, K]
    indices: ir.Value  # ROUTING [T, K] int32
    top_k: int
    normalize: bool
    #: the kernel's router-tie flag [T, 1] fp32 (ROUTING), shared by every router of the kernel: set to 1 for a
    #: token whose k-th and (k+1)-th probabilities are equal (torch.topk's choice between them is
    #: implementation-defined, so the executor recomputes such a step eagerly); the first router initializes it
    tie: ir.Value | None = None
    tie_first: bool = False
    #: where the softmax and the renormalization round: ``"fp32"`` (HF's ``softmax(logits, dtype=float32)``, top-k
    #: and renormalization in fp32, the weights rounded once) or ``"rounded"`` (the ``rounded`` pattern variant,
    #: keras-hub's router under a bf16 policy: ``x - max``, ``exp``, the fp32-accumulated sum, the division, the
    #: top-k and the renormalization's sum and division each rounded to ``weights.dtype``)
    rounding: str = "fp32"
    output_fields: ClassVar[tuple[str, ...]] = ("weights", "indices", "tie")

    def arg_specs(self, layouts: dict[str, Layout], add: ir.AddSpec) -> None:
        li = layouts[self.x.name]
        add(self.weight, f"router:{li}", lambda t, li=li: W.router(t, li))

    def emit(self, ctx: Context, i: int) -> Emitted:
        lay = ctx.layout(self.x)
        T = ctx.tokens
        E = self.weight.shape[0]
        if not 8 <= E <= MOVING_MAX:
            raise CodegenError(f"router over {E} experts: the max8 top-k template needs 8..{MOVING_MAX} experts")
        if self.top_k > 8:
            raise CodegenError(f"top-{self.top_k} routing: the template handles k <= 8 (one max8)")
        if self.rounding not in ("fp32", "rounded"):
            raise CodegenError(f"router rounding {self.rounding!r}: the template knows 'fp32' and 'rounded'")
        v = ctx.var(self.weights)
        e = Emitted(sbuf=E * 4 * 4 + E * nbytes(self.weights.dtype) * (3 if self.rounding == "rounded" else 1) + 160,
                    psum_banks=1)
        w = ctx.var(self.weight)
        name = inst_name(self)
        chunk = Chunk(shape=ctx.shape(self.weight), dtype=nl_dtype(self.weight.dtype), src=w, name=f"{name}.w",
                      earliest=0, nbytes_per_partition=lay.FT * E * nbytes(self.weight.dtype))
        e.pieces.append(ChunkUse(chunk, i))
        e.code("router.j2", module=self.module or "", aten=aten(self), name=name, T=T, E=E, KT=lay.FT,
               K=self.top_k, normalize=self.normalize, x=ctx.var(self.x), w=chunk.token,
               dtype=nl_dtype(self.x.dtype), wdtype=nl_dtype(self.weights.dtype), lps=f"{v}_lps",
               logits=f"{v}_logits", negmax=f"{v}_negmax",
               e=f"{v}_e", ssum=f"{v}_ssum", rsum=f"{v}_rsum", probs=f"{v}_probs", top8=f"{v}_top8",
               indices=ctx.var(self.indices), weights=v, ksum=f"{v}_ksum", krs=f"{v}_krs", rest=f"{v}_rest",
               next8=f"{v}_next8", tie_t=f"{v}_tie", tie=ctx.var(self.tie) if self.tie is not None else None,
               tie_first=self.tie_first, rounded=self.rounding == "rounded", shifted=f"{v}_shifted",
               sround=f"{v}_sround", sdiv=f"{v}_sdiv", kround=f"{v}_kround", kdiv=f"{v}_kdiv")
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        logits = F.linear(env[self.x.name], env[self.weight.name])
        if self.rounding == "rounded":  # every step rounded to the logits' dtype (the pattern's `rounded` form)
            e = torch.exp(logits - logits.amax(-1, keepdim=True))
            probs = (e / e.float().sum(-1, keepdim=True).to(e.dtype)).float()  # exact: bf16 values in fp32
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        # the kernel's rule: distinct experts, equal probabilities lowest index first (a stable descending sort)
        ranked, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        top, idx = ranked[:, :self.top_k], order[:, :self.top_k]
        if self.tie is not None:
            tie = (ranked[:, self.top_k - 1] == ranked[:, self.top_k]).float().unsqueeze(-1)
            env[self.tie.name] = tie if self.tie_first else torch.maximum(env[self.tie.name], tie)
        if self.normalize and self.rounding == "rounded":
            top = top.to(logits.dtype)
            top = top / top.float().sum(-1, keepdim=True).to(top.dtype)
        elif self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        env[self.weights.name] = top.to(self.weights.dtype)  # fp32 for HF Mixtral's router (no cast back)
        env[self.indices.name] = idx.to(torch.int32)


def _check(m: Any, graph: Any, tokens: int | None) -> str | None:
    top_k = int(m.params.get("top_k", 0))
    E = int(graph.nodes[m.inputs["weight"]]["shape"][0])
    if not 8 <= E <= MOVING_MAX:
        return f"router over {E} experts: the max8 top-k template needs 8..{MOVING_MAX} experts"
    if top_k > 8:
        return f"top-{top_k} routing: the template handles k <= 8 (one max8)"
    return None


@register_lowering(moe_router, check=_check, instructions=[Router])
def lower_router(L: Lowerer, m: Any) -> None:
    x = L.act(L.input(m, "x"), L.views(m, "x"))
    w = L.hbm(L.input(m, "weight"))
    top_k = int(m.params["top_k"])
    w_node = m.outputs.get("weights")
    i_node = m.outputs.get("indices")
    if not (w_node and i_node):
        raise CodegenError(f"router match must export weights and indices (has {sorted(m.outputs)})")
    wv = L.new_act(w_node, L.label(m, "w"), kind=V.ROUTING, shape=(L.T, top_k))
    iv = L.new_act(i_node, L.label(m, "idx"), dtype=torch.int32, kind=V.ROUTING, shape=(L.T, top_k))
    first = "router_tie" not in L.shared
    tie = None
    if w.shape[0] > top_k:  # with every expert chosen there is no boundary to tie at
        if first:
            L.shared["router_tie"] = ir.Value(L.unique("router_tie"), V.ROUTING, (L.T, 1), torch.float32)
            L.guard(L.shared["router_tie"], TIE_REASON)
        tie = L.shared["router_tie"]
    rounding = "rounded" if str(getattr(m, "variant", "")).startswith("rounded") else "fp32"
    L.emit(Router(x=x, weight=w, weights=wv, indices=iv, top_k=top_k, normalize=bool(m.params.get("normalize")),
                  tie=tie, tie_first=first and tie is not None, rounding=rounding), m)
