"""Gated activation ``act(gate) * up`` (SwiGLU, GeGLU...): ``activation(<act>)`` then ``tensor_tensor(multiply)``.

``act`` is any slot activation of the one activation table (:mod:`fusegraph.matching.activations`): what the
pattern's slot matches, the template emits and the reference computes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fusegraph.matching.activations import activation

from fusegraph.codegen.api import (act_op, aten, Context, Emitted, inst_name, ir, Lowerer, nbytes, nl_dtype,
                                    register_lowering)
from .swiglu import swiglu


@dataclass
class GatedAct(ir.Instruction):
    """out = act(gate) * up (SwiGLU and friends)."""

    opcode: ClassVar[str] = "gated_act"
    gate: ir.Value
    up: ir.Value
    out: ir.Value
    act: str = "silu"

    def constrain(self, c: ir.Constraints) -> None:
        c.same(self.gate, self.up, self.out)

    def emit(self, ctx: Context, i: int) -> Emitted:
        lay = ctx.layout(self.out)
        v = ctx.var(self.out)
        e = Emitted(sbuf=2 * lay.FT * ctx.tokens * nbytes(self.out.dtype))
        e.code("gated_act.j2", module=self.module or "", aten=aten(self), name=inst_name(self), P=lay.P, FT=lay.FT,
               T=ctx.tokens, g=f"{v}_g", out=v, gate=ctx.var(self.gate), up=ctx.var(self.up), act=self.act,
               act_op=act_op(self.act), dtype=nl_dtype(self.out.dtype))
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        env[self.out.name] = activation(self.act).fn(env[self.gate.name]) * env[self.up.name]


@register_lowering(swiglu, "swiglu", "gated_activation", instructions=[GatedAct])
def lower_gated(L: Lowerer, m: Any) -> None:
    gate = L.act(L.input(m, "gate"), L.views(m, "gate"))
    up = L.act(L.input(m, "up"), L.views(m, "up"))
    out = L.new_act(L.output(m), L.label(m, "act"))
    L.emit(GatedAct(gate=gate, up=up, out=out, act=str(m.params.get("act", "silu"))), m)
