"""Test cases of the gated activation (:class:`~.lowering.GatedAct`) against its pattern function ``act(gate) *
up`` with the slot's activation: SwiGLU (silu), GeGLU (gelu with tanh, and exact gelu); an intermediate size that is
no multiple of 128 (300)."""
from __future__ import annotations

import torch

from fusegraph.codegen.api import BF16_TOL, Builder, CaseProgram, OpCase, register_cases

from .lowering import GatedAct
from .swiglu import swiglu

F32, BF16 = torch.float32, torch.bfloat16


def _case(T: int, I: int, dtype: torch.dtype, act: str) -> CaseProgram:
    g = torch.Generator().manual_seed(T * I + len(act))
    gate, up = (2 * torch.randn(T, I, generator=g)).to(dtype), torch.randn(T, I, generator=g).to(dtype)
    b = Builder(T)
    y = b.new("y", I, dtype)
    b.ins.append(GatedAct(gate=b.act("gate", gate), up=b.act("up", up), out=y, act=act, layer=0))
    b.store(y)
    # the pattern's reference with its ``act`` slot resolved by name, as for a match
    return CaseProgram(b, {"gate": gate, "up": up}, lambda t: {"y": swiglu.call_reference(t, {"act": act})})


register_cases(__package__, [
    OpCase("swiglu_T1_I512_f32", lambda: _case(1, 512, F32, "silu")),
    OpCase("swiglu_T3_I300_bf16", lambda: _case(3, 300, BF16, "silu"), BF16_TOL),
    OpCase("geglu_tanh_T2_I256_bf16", lambda: _case(2, 256, BF16, "gelu_tanh"), BF16_TOL),
    OpCase("geglu_T2_I384_f32", lambda: _case(2, 384, F32, "gelu")),
])
