"""Test cases of the residual add (:class:`~.lowering.Add`) against its pattern function ``a + b``: a hidden size
that is a multiple of 128 and one that is not (200: 100 partitions x 2)."""
from __future__ import annotations

import torch

from fusegraph.codegen.api import Builder, CaseProgram, OpCase, register_cases, tol_for

from .lowering import Add
from .pattern import residual_add


def _case(T: int, H: int, dtype: torch.dtype) -> CaseProgram:
    g = torch.Generator().manual_seed(T * H)
    a, c = torch.randn(T, H, generator=g).to(dtype), torch.randn(T, H, generator=g).to(dtype)
    b = Builder(T)
    y = b.new("y", H, dtype)
    b.ins.append(Add(a=b.act("a", a), b=b.act("b", c), out=y, layer=0))
    b.store(y)
    return CaseProgram(b, {"a": a, "b": c}, lambda t: {"y": residual_add(t["a"], t["b"])})


register_cases(__package__, [
    OpCase("T1_H384_f32", lambda: _case(1, 384, torch.float32)),
    OpCase("T3_H200_bf16", lambda: _case(3, 200, torch.bfloat16), tol_for(torch.bfloat16)),
])
