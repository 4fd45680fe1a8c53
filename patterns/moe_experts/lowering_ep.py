"""MoE experts of one expert-parallel rank (pattern ``fusegraph.moe_experts_ep``: HF's ``AllReduceEP`` + its
``batched_mm`` or ``grouped_mm`` experts forward over the rank's ``E`` local experts).

Two instructions: :class:`EpRoute` maps the replicated router's global choices to the rank's experts on chip
(``[T, K]`` tiles: local id ``idx - rank * E`` where ``0 <= idx - rank * E < E``, routing weight 0 elsewhere), and
the ordinary :class:`~.experts.Experts` instruction runs the rank's experts on those local choices. Its output is
the rank's partial sum; the all-reduce after it (``fusegraph.all_reduce``) adds the ranks' partial sums inside the
same kernel. An off-rank choice contributes exactly 0 (its weight is 0), as in HF:

* one token (the per-choice path): the experts run each of the token's ``K`` choices under a run-time guard
  (``nl.dynamic_range`` over registers loaded from the ``mine`` flags): another rank's choice skips its weight
  DMAs, matmuls and accumulation, so a rank reads only the weights of the experts it owns that the token chose
  (HF's ``batched_mm`` computes the clamped sentinel ``E - 1`` and multiplies it by 0; the id is ``E - 1`` here
  too, a valid address, but never read);
* ``T > 1`` tokens (grouped by expert): its local id is ``E``, which matches no expert, so no slot is spent on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fusegraph.codegen.api import CodegenError, Context, Emitted, inst_name, ir, Lowerer, nl_dtype, register_lowering
from .moe_experts_ep import moe_experts_ep
from .lowering import Experts, expert_operands

V = ir.ValueKind


@dataclass
class EpRoute(ir.Instruction):
    """Global top-k expert ids and weights -> this rank's local ids and masked weights (see the module docstring)."""

    opcode: ClassVar[str] = "ep_route"
    weights: ir.Value  # ROUTING [T, K], the router's
    indices: ir.Value  # ROUTING [T, K] int32, global expert ids
    local_weights: ir.Value  # ROUTING [T, K]: 0 where the choice is another rank's
    local_indices: ir.Value  # ROUTING [T, K] int32: ids among this rank's experts
    mine: ir.Value  # ROUTING [T, K] fp32: 1 where the choice is one of this rank's experts
    experts: int  # local experts per rank
    offset: int  # the rank's first global expert id (rank * experts)
    output_fields: ClassVar[tuple[str, ...]] = ("local_weights", "local_indices", "mine")

    def fill(self, tokens: int) -> int:
        """Local id of another rank's choice: ``E - 1`` for the one-token path (it reads every chosen slot),
        ``E`` (no expert) for the grouped path."""
        return self.experts - 1 if tokens == 1 else self.experts

    def emit(self, ctx: Context, i: int) -> Emitted:
        T, K = ctx.tokens, self.weights.shape[-1]
        if self.offset + self.experts >= 1 << 24:
            raise CodegenError("expert ids beyond 2^24 are not exact in the fp32 route mask")
        v = ctx.var(self.local_weights)
        e = Emitted(sbuf=K * (4 * 2 + 4 + self.weights.dtype.itemsize) + 4 * K)
        e.code("experts_ep_route.j2", module=self.module or "", name=inst_name(self), T=T, K=K, E=self.experts,
               offset=self.offset, fill=self.fill(T), indices=ctx.var(self.indices), weights=ctx.var(self.weights),
               d=f"{v}_d", mask=ctx.var(self.mine), hi=f"{v}_hi", local=ctx.var(self.local_indices), lw=v,
               wdtype=nl_dtype(self.local_weights.dtype))
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        idx = env[self.indices.name].long()
        w = env[self.weights.name]
        d = idx - self.offset
        mine = (d >= 0) & (d < self.experts)
        T = idx.shape[0]
        env[self.local_indices.name] = torch.where(mine, d, self.fill(T)).to(torch.int32)
        env[self.local_weights.name] = (w.float() * mine.float()).to(w.dtype)
        env[self.mine.name] = mine.float()


def _check(m: Any, graph: Any, tokens: int | None) -> str | None:
    if int(m.params.get("ep_rank", -1)) < 0:
        return f"EP experts without a rank ({m.params.get('ep_rank')})"
    return None


@register_lowering(moe_experts_ep, check=_check, instructions=[EpRoute, Experts])
def lower_experts_ep(L: Lowerer, m: Any) -> None:
    x, wv, iv, gu, dn = expert_operands(L, m, "EP experts")
    E = int(gu.shape[0])
    rank = int(m.params["ep_rank"])
    stem = L.label(m, "ep")
    lw = ir.Value(L.unique(stem + "_w"), V.ROUTING, tuple(wv.shape), wv.dtype)
    li = ir.Value(L.unique(stem + "_idx"), V.ROUTING, tuple(iv.shape), torch.int32)
    mine = ir.Value(L.unique(stem + "_mine"), V.ROUTING, tuple(iv.shape), torch.float32)
    L.emit(EpRoute(weights=wv, indices=iv, local_weights=lw, local_indices=li, mine=mine, experts=E,
                   offset=rank * E), m)
    out = L.new_act(L.output(m), L.label(m))
    # fp32 routing weights (HF Mixtral's router, the ``fp32_weights`` variant): fp32 products, one rounding
    round_terms = "fp32_weights" not in str(getattr(m, "variant", ""))
    L.emit(Experts(x=x, weights=lw, indices=li, gate_up=gu, down=dn, out=out, intermediate=gu.shape[1] // 2,
                   act=str(m.params.get("act", "silu")), round_terms=round_terms, mine=mine), m)
