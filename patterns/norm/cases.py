"""Test cases of the norm op (:class:`~.lowering.RMSNorm`): plain RMSNorm over the hidden state and per head (q/k
norm), Gemma's ``offset + weight`` form, OLMo-2's fp32 weight product, and LayerNorm with and without bias, each
against its pattern function (``rmsnorm``, ``rmsnorm_offset``, ``layernorm`` and their implementations).
Hidden sizes that are no multiple of 128 (200, 320) take other partition counts.

Known difference (within the bf16 tolerance): for Gemma's ``rmsnorm_offset`` in bf16 the kernel and the reference
VM round the normalized values to bf16 before the ``(1 + w)`` product, where the pattern (Gemma's eager) multiplies
in fp32 and rounds once: ``rmsnorm_offset_T2_H256_bf16`` differs from eager by one bf16 ulp in 115 of 512 values."""
from __future__ import annotations

import torch

from fusegraph.codegen.api import BF16_TOL, Builder, CaseProgram, OpCase, register_cases, tol_for

from .layernorm import layernorm
from .layernorm_offset import layernorm_offset
from .lowering import RMSNorm
from .rmsnorm import _fp32_weight, rmsnorm
from .rmsnorm_offset import rmsnorm_offset

F32, BF16 = torch.float32, torch.bfloat16


def _inputs(T: int, H: int, dtype: torch.dtype, seed: int, shift: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (shift + torch.randn(T, H, generator=g)).to(dtype)
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    return x, w


def _rmsnorm(T: int, H: int, dtype: torch.dtype, group: int = 0, fp32_product: bool = False) -> CaseProgram:
    """RMSNorm over each ``group`` features (0: the whole hidden state; the head size: a q/k norm)."""
    group = group or H
    x, w = _inputs(T, H, dtype, seed=T * H + group)
    wt = w[:group].clone()
    b = Builder(T)
    y = b.new("y", H, dtype)
    b.ins.append(RMSNorm(x=b.act("x", x), weight=b.hbm("w", wt), out=y, eps=1e-6, group=group,
                         fp32_product=fp32_product, layer=0))
    b.store(y)
    fn = _fp32_weight if fp32_product else rmsnorm.fn

    def eager(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        heads = t["x"].reshape(T, H // group, group)  # the model's [T, heads, D] view of a q/k norm
        return {"y": fn(heads, t["w"], eps=1e-6).reshape(T, H)}

    return CaseProgram(b, {"x": x, "w": wt}, eager)


def _rmsnorm_offset(T: int, H: int, dtype: torch.dtype) -> CaseProgram:
    x, w = _inputs(T, H, dtype, seed=7 * H)
    b = Builder(T)
    y = b.new("y", H, dtype)
    b.ins.append(RMSNorm(x=b.act("x", x), weight=b.hbm("w", w), out=y, eps=1e-6, group=H, weight_offset=1.0,
                         layer=0))
    b.store(y)
    return CaseProgram(b, {"x": x, "w": w},
                       lambda t: {"y": rmsnorm_offset(t["x"], t["w"], eps=1e-6, offset=1.0)})


def _layernorm(T: int, H: int, dtype: torch.dtype, bias: bool, affine: bool = True,
               offset: float = 0.0) -> CaseProgram:
    """Offset inputs (mean 3), so a kernel that forgot to subtract the mean cannot pass. ``affine=False``: OLMo's
    LayerNorm, no weight and no bias; ``offset``: Nemotron's, scaled by ``weight + offset``."""
    x, w = _inputs(T, H, dtype, seed=11 * H, shift=3.0)
    bt = (0.5 * torch.randn(H, generator=torch.Generator().manual_seed(H))).to(dtype)
    b = Builder(T)
    y = b.new("y", H, dtype)
    if offset:
        w = w - 1  # stored as its difference from 1
    b.ins.append(RMSNorm(x=b.act("x", x), weight=b.hbm("w", w) if affine else None, out=y, eps=1e-5, group=H,
                         center=True, bias=b.hbm("bias", bt) if bias else None, weight_offset=offset, layer=0))
    b.store(y)
    inputs = {"x": x, **({"w": w} if affine else {}), **({"bias": bt} if bias else {})}
    if offset:
        return CaseProgram(b, inputs, lambda t: {"y": layernorm_offset(t["x"], t["w"], t.get("bias"), eps=1e-5,
                                                                       offset=offset)})
    return CaseProgram(b, inputs, lambda t: {"y": layernorm(t["x"], t.get("w"), t.get("bias"), eps=1e-5)})


register_cases(__package__, [
    OpCase("rmsnorm_T1_H384_f32", lambda: _rmsnorm(1, 384, F32)),
    OpCase("rmsnorm_T3_H200_bf16", lambda: _rmsnorm(3, 200, BF16), BF16_TOL),
    OpCase("qk_norm_T2_4x64_bf16", lambda: _rmsnorm(2, 256, BF16, group=64), BF16_TOL),
    OpCase("qk_norm_T3_2x128_f32", lambda: _rmsnorm(3, 256, F32, group=128)),
    OpCase("rmsnorm_fp32_product_T2_H256_bf16", lambda: _rmsnorm(2, 256, BF16, fp32_product=True), BF16_TOL),
    OpCase("rmsnorm_offset_T2_H256_bf16", lambda: _rmsnorm_offset(2, 256, BF16), BF16_TOL),
    OpCase("rmsnorm_offset_T1_H320_f32", lambda: _rmsnorm_offset(1, 320, F32)),
    OpCase("layernorm_bias_T3_H384_bf16", lambda: _layernorm(3, 384, BF16, bias=True), tol_for(BF16)),
    OpCase("layernorm_nobias_T1_H320_f32", lambda: _layernorm(1, 320, F32, bias=False)),
    OpCase("layernorm_offset_T2_H256_f32", lambda: _layernorm(2, 256, F32, bias=True, offset=1.0)),
    OpCase("layernorm_noaffine_T2_H256_f32", lambda: _layernorm(2, 256, F32, bias=False, affine=False)),
])
