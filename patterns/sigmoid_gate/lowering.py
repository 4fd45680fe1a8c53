"""Scalar sigmoid gate ``sigmoid(gate) * x`` with one logit per token (Qwen2-MoE's shared-expert gate): the logit is
broadcast to every partition by a ones-matmul."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fusegraph.codegen.api import (aten, CodegenError, Context, Emitted, inst_name, ir, Lowerer, nbytes, nl_dtype,
                                    per_token_features, PMAX, register_lowering, weights as W)
from .pattern import sigmoid_gate


@dataclass
class ScalarGate(ir.Instruction):
    """out = sigmoid(gate) * x with one gate logit per token (a shared expert's gate)."""

    opcode: ClassVar[str] = "sigmoid_gate"
    gate: ir.Value  # ACT [T, 1]
    x: ir.Value
    out: ir.Value

    def constrain(self, c: ir.Constraints) -> None:
        c.same(self.x, self.out)

    def constants(self, ctx: Context) -> dict[str, ir.Constant]:
        return {"c_ones": ir.Constant(W.ones(PMAX), "ones")}

    def emit(self, ctx: Context, i: int) -> Emitted:
        lay = ctx.layout(self.x)
        T = ctx.tokens
        v = ctx.var(self.out)
        e = Emitted(sbuf=lay.FT * T * nbytes(self.out.dtype) + 3 * 4 * T, psum_banks=1)
        e.code("sigmoid_gate.j2", module=self.module or "", aten=aten(self), name=inst_name(self), P=lay.P, FT=lay.FT,
               T=T, gate=ctx.var(self.gate), x=ctx.var(self.x), out=v, g32=f"{v}_g32", gps=f"{v}_gps", sg=f"{v}_sg",
               sg32=f"{v}_sg32", ones=ctx.consts["ones"], gdtype=nl_dtype(self.gate.dtype),
               dtype=nl_dtype(self.out.dtype))
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        env[self.out.name] = torch.sigmoid(env[self.gate.name]) * env[self.x.name]


def _check(m: Any, graph: Any, tokens: int | None) -> str | None:
    f = per_token_features(graph, m.inputs["gate"], tokens)
    if f is not None and f != 1:
        return f"sigmoid gate with {f} logits per token"
    return None


@register_lowering(sigmoid_gate, check=_check, instructions=[ScalarGate])
def lower_sigmoid_gate(L: Lowerer, m: Any) -> None:
    gate = L.act(L.input(m, "gate"), L.views(m, "gate"))
    x = L.act(L.input(m, "x"), L.views(m, "x"))
    if gate.features != 1:
        raise CodegenError(f"sigmoid gate with {gate.features} logits per token")
    out = L.new_act(L.output(m), L.label(m, "gate"))
    L.emit(ScalarGate(gate=gate, x=x, out=out), m)
