"""Test cases of the per-token sigmoid gate (:class:`~.lowering.ScalarGate`) against its pattern function
``sigmoid(gate) * x`` (one logit per token, broadcast over the features)."""
from __future__ import annotations

import torch

from fusegraph.codegen.api import BF16_TOL, Builder, CaseProgram, OpCase, register_cases

from .lowering import ScalarGate
from .pattern import sigmoid_gate

F32, BF16 = torch.float32, torch.bfloat16


def _case(T: int, H: int, dtype: torch.dtype) -> CaseProgram:
    g = torch.Generator().manual_seed(T * H)
    gate, x = (3 * torch.randn(T, 1, generator=g)).to(dtype), torch.randn(T, H, generator=g).to(dtype)
    b = Builder(T)
    y = b.new("y", H, dtype)
    b.ins.append(ScalarGate(gate=b.act("gate", gate), x=b.act("x", x), out=y, layer=0))
    b.store(y)
    return CaseProgram(b, {"gate": gate, "x": x}, lambda t: {"y": sigmoid_gate(t["gate"], t["x"])})


register_cases(__package__, [
    OpCase("T1_H384_f32", lambda: _case(1, 384, F32)),
    OpCase("T3_H200_bf16", lambda: _case(3, 200, BF16), BF16_TOL),
])
