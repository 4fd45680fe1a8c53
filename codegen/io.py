"""The kernel's own I/O instructions: load an activation computed outside, store a result, store a guard flag.

They come from no pattern: :func:`~fusegraph.codegen.lowering.lower_region` adds them at the region's boundary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from . import ir
from .emitters import Context, Emitted, code, inst_name
from .registry import register_instruction
from .render import nl_dtype


@register_instruction
@dataclass
class Load(ir.Instruction):
    """Bring an activation computed outside the kernel (HBM ``[T, F]``) into SBUF."""

    opcode: ClassVar[str] = "load"
    src: ir.Value  # INPUT
    out: ir.Value

    def emit(self, ctx: Context, i: int) -> Emitted:
        lay = ctx.layout(self.out)
        F, T = self.out.features, ctx.tokens
        pattern = lay.row_pattern() + [[F, T]]
        e = Emitted()
        e.code("load.j2", what=self.src.name, T=T, F=F, P=lay.P, FT=lay.FT, out=ctx.var(self.out),
               src=ctx.var(self.src), pattern=pattern, dtype=nl_dtype(self.out.dtype), name=inst_name(self))
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        env[self.out.name] = env[self.src.name].reshape(self.out.shape)


@register_instruction
@dataclass
class Store(ir.Instruction):
    """Write an SBUF activation to an HBM output tensor [T, F] (kernel outputs are in shared HBM)."""

    opcode: ClassVar[str] = "store"
    x: ir.Value
    dst: ir.Value  # OUTPUT
    output_fields: ClassVar[tuple[str, ...]] = ()

    def constrain(self, c: ir.Constraints) -> None:
        c.prefer_pmajor(self.x)

    def emit(self, ctx: Context, i: int) -> Emitted:
        if self.x.name in ctx.stored:  # its producer stored it chunk by chunk (a batch's logits, ops/linear.py)
            return Emitted()
        half = ctx.split(ctx.layout(self.x).FT) if self.x.name in ctx.store_only and ctx.layout(self.x).split == 1 \
            else 0
        e = Emitted()
        e.pieces.append(store_code(ctx, self, half=half, only_core0=ctx.lnc == 2 and not half))
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        env[self.dst.name] = env[self.x.name].reshape(self.dst.shape).clone()


@register_instruction
@dataclass
class LoadRouting(ir.Instruction):
    """Bring a token-major ``[T, K]`` value from HBM (a tensor-path buffer the kernel computed, or a per-step
    input) into a ROUTING tile: what MoE experts read their choices from when no router pattern made them (a
    sigmoid or group-limited router lowered generically), so experts never depend on one router form."""

    opcode: ClassVar[str] = "load_routing"
    src: ir.Value
    out: ir.Value  # ROUTING [T, K]

    def emit(self, ctx: Context, i: int) -> Emitted:
        T, K = self.out.shape
        e = Emitted()
        e.code("load_routing.j2", what=self.src.name, T=T, K=K, out=ctx.var(self.out), src=ctx.var(self.src),
               dtype=nl_dtype(self.out.dtype), name=inst_name(self))
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        env[self.out.name] = env[self.src.name].reshape(self.out.shape).to(self.out.dtype)


def store_code(ctx: Context, ins: "Store", *, half: int = 0, only_core0: bool = False) -> str:
    """The code storing ``ins.x`` (an SBUF activation) to ``ins.dst`` (HBM ``[T, F]`` row-major); ``half``: this
    core's half of the chunks under LNC=2."""
    lay = ctx.layout(ins.x)
    F = ins.x.features
    # partition-major: FT contiguous features per partition; chunk-major: one element per descriptor (slow)
    n = half or lay.FT
    pattern = ([[lay.FT, lay.P], [1, n], [F, ctx.tokens]] if lay.pmajor
               else [[1, lay.P], [lay.P, n], [F, ctx.tokens]])
    if lay.split != 1:  # a head-split value (heads > 128 partitions): whole, from both tile dims
        pattern = lay.row_pattern() + [[F, ctx.tokens]]
    return code("store.j2", what=ins.dst.name, T=ctx.tokens, F=F, P=lay.P, FT=lay.FT, dst=ctx.var(ins.dst),
                x=ctx.var(ins.x), name=inst_name(ins), pattern=pattern, contiguous=lay.pmajor, half=half,
                pmajor=lay.pmajor, only_core0=only_core0)


@register_instruction
@dataclass
class Spill(Store):
    """Write an SBUF activation into a tensor-path buffer of the kernel's HBM scratch (``[T, F]`` row-major), so
    ops of any shape can read it (:mod:`fusegraph.codegen.tensor`). Every core writes its own (private) copy."""

    opcode: ClassVar[str] = "spill"

    def writes(self) -> list[ir.Value]:
        return [self.dst]

    def emit(self, ctx: Context, i: int) -> Emitted:
        e = Emitted()
        e.pieces.append(code("alloc_hbm.j2", var=ctx.var(self.dst), shape=tuple(self.dst.shape),
                             dtype=nl_dtype(self.dst.dtype), name=inst_name(self)))
        e.pieces.append(store_code(ctx, self))
        return e


@register_instruction
@dataclass
class Guard(ir.Instruction):
    """Store a guard flag ([T, 1] fp32, 0 or 1, token-major) to an HBM output. A set flag tells the executor that
    the kernel's result for this step may differ from eager for a reason the kernel can detect but not resolve
    (``reason``), so the step is recomputed on the eager path."""

    opcode: ClassVar[str] = "guard"
    x: ir.Value  # ROUTING [T, 1]
    dst: ir.Value  # OUTPUT [T, 1]
    reason: str = ""
    output_fields: ClassVar[tuple[str, ...]] = ()

    def emit(self, ctx: Context, i: int) -> Emitted:
        e = Emitted()
        e.code("guard.j2", reason=self.reason, T=ctx.tokens, dst=ctx.var(self.dst), x=ctx.var(self.x),
               name=inst_name(self), only_core0=ctx.lnc == 2)
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        env[self.dst.name] = env[self.x.name].reshape(self.dst.shape).clone()
