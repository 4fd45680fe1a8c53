"""Residual add: ``tensor_tensor(add)`` on the hidden state (``fusegraph.residual_add``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fusegraph.codegen.api import aten, Context, Emitted, inst_name, ir, Lowerer, nbytes, nl_dtype, register_lowering
from .pattern import residual_add


@dataclass
class Add(ir.Instruction):
    opcode: ClassVar[str] = "add"
    a: ir.Value
    b: ir.Value
    out: ir.Value

    def constrain(self, c: ir.Constraints) -> None:
        c.same(self.a, self.b, self.out)

    def emit(self, ctx: Context, i: int) -> Emitted:
        lay = ctx.layout(self.out)
        e = Emitted(sbuf=lay.FT * ctx.tokens * nbytes(self.out.dtype))
        e.code("add.j2", module=self.module or "", aten=aten(self), name=inst_name(self), P=lay.P, FT=lay.FT,
               T=ctx.tokens, out=ctx.var(self.out), a=ctx.var(self.a), b=ctx.var(self.b),
               dtype=nl_dtype(self.out.dtype))
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        env[self.out.name] = env[self.a.name] + env[self.b.name]


@register_lowering(residual_add, "add", instructions=[Add])
def lower_add(L: Lowerer, m: Any) -> None:
    a = L.act(L.input(m, "a"), L.views(m, "a"))
    b = L.act(L.input(m, "b"), L.views(m, "b"))
    out = L.new_act(L.output(m), L.label(m, "add"))
    L.emit(Add(a=a, b=b, out=out), m)
