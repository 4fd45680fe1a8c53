"""Test cases of the LLM-island op (:class:`~.lowering.LlmIsland`): a verified NKI kernel inlined into the megakernel
as a sub-function, its activation operands stored to scratch HBM, its results loaded back. The kernel text here is
a fixed hand-written stand-in for an LLM's answer (``2 x + 1`` on one engine instruction), so what the cases check is
the op's own work: renaming and inlining the module, the scratch round trips in the activations' layouts (a feature
count that is no multiple of 128 included), the call; the eager reference is the island's ATen ops, which is also
the instruction's reference (an island's reference *is* its ops: only the interpreter side can disagree). What an
LLM writes, and its verification, is tested in ``tests/llm``."""
from __future__ import annotations

import hashlib

import torch

from fusegraph.codegen.api import BF16_TOL, Builder, CaseProgram, OpCase, nl_dtype, register_cases

from .lowering import LlmIsland

F32, BF16 = torch.float32, torch.bfloat16


def affine_island(x: torch.Tensor) -> tuple[torch.Tensor]:
    """The island's ATen ops (``mul``, ``add``), as ``InlineSource.reference`` holds them."""
    return (x * 2 + 1,)


def _kernel(T: int, F: int, dtype: torch.dtype) -> str:
    """``2 x + 1`` over a ``[T, F]`` HBM tensor: tokens on partitions, one ``tensor_scalar``, fp32 inside."""
    dt = nl_dtype(dtype)
    return f'''import nki
import nki.language as nl
import nki.isa as nisa


@nki.jit
def island_0(in0):
    out = nl.ndarray(shape=({T}, {F}), dtype={dt}, buffer=nl.shared_hbm, name="out")
    x = nl.ndarray(shape=({T}, {F}), dtype={dt}, buffer=nl.sbuf, name="x")
    nisa.dma_copy(dst=x, src=in0)
    y = nl.ndarray(shape=({T}, {F}), dtype={dt}, buffer=nl.sbuf, name="y")
    nisa.tensor_scalar(dst=y, data=x, op0=nl.multiply, operand0=2.0, op1=nl.add, operand1=1.0)
    nisa.dma_copy(dst=out, src=y)
    return out
'''


def _case(T: int, F: int, dtype: torch.dtype) -> CaseProgram:
    x = torch.randn(T, F, generator=torch.Generator().manual_seed(T * F)).to(dtype)
    source = _kernel(T, F, dtype)
    b = Builder(T)
    y = b.new("y", F, dtype)
    b.ins.append(LlmIsland(args=(b.act("x", x),), arg_shapes=((T, F),), outs=(y,), out_shapes=((T, F),),
                           source=source, source_sha256=hashlib.sha256(source.encode()).hexdigest(), entry="island_0",
                           what="mul, add", island_reference=affine_island, layer=0))
    b.store(y)
    return CaseProgram(b, {"x": x}, lambda t: {"y": affine_island(t["x"])[0]})


register_cases(__package__, [
    OpCase("affine_T2_F256_f32", lambda: _case(2, 256, F32)),
    OpCase("affine_T3_F200_bf16", lambda: _case(3, 200, BF16), BF16_TOL),
])
