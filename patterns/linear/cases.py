"""Test cases of the linear op (:class:`~.lowering.Linear`) against its pattern function ``F.linear``: with and
without bias, feature counts that are no multiple of 128, a weight streamed in many chunks, a projection whose
output is stored chunk by chunk (the logits), and the fused-QKV forms the lowering splits into one projection per
piece over the weight's rows (Phi-3's ``qkv[..., a:b]`` slices; GPT-NeoX's per-head ``[heads, 3 * D]`` chunks,
several row ranges per piece)."""
from __future__ import annotations

import torch

from fusegraph.codegen.api import BF16_TOL, Builder, CaseProgram, OpCase, register_cases

from .lowering import Linear
from .pattern import linear

F32, BF16 = torch.float32, torch.bfloat16


def _tensors(T: int, K: int, N: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    return x, w, bias


def _linear(T: int, K: int, N: int, dtype: torch.dtype, bias: bool) -> CaseProgram:
    x, w, bt = _tensors(T, K, N, dtype, seed=K + N)
    b = Builder(T)
    y = b.new("y", N, dtype)
    b.ins.append(Linear(x=b.act("x", x), weight=b.hbm("w", w), out=y, bias=b.hbm("bias", bt) if bias else None,
                        layer=0))
    b.store(y)
    inputs = {"x": x, "weight": w, **({"bias": bt} if bias else {})}
    return CaseProgram(b, inputs, lambda t: {"y": linear(t["x"], t["weight"], t.get("bias"))})


def _fused(T: int, K: int, pieces: dict[str, tuple[tuple[int, int], ...]], N: int, dtype: torch.dtype,
           eager_pieces) -> CaseProgram:
    """One fused ``[N, K]`` weight (with bias), one projection per piece over its row ranges."""
    x, w, bt = _tensors(T, K, N, dtype, seed=3 * N)
    b = Builder(T)
    xv = b.act("x", x)
    for name, rows in pieces.items():
        y = b.new(name, sum(r1 - r0 for r0, r1 in rows), dtype)
        b.ins.append(Linear(x=xv, weight=b.rows(f"w_{name}", w, rows), out=y, bias=b.rows(f"b_{name}", bt, rows),
                            layer=0))
        b.store(y)
    return CaseProgram(b, {"x": x, "weight": w, "bias": bt},
                       lambda t: eager_pieces(linear(t["x"], t["weight"], t["bias"])))


def _phi3_qkv(T: int, K: int, q: int, kv: int, dtype: torch.dtype) -> CaseProgram:
    """``qkv = linear(x)``, then ``qkv[..., :q]``, ``qkv[..., q:q + kv]``, ``qkv[..., q + kv:]``."""
    pieces = {"q": ((0, q),), "k": ((q, q + kv),), "v": ((q + kv, q + 2 * kv),)}
    return _fused(T, K, pieces, q + 2 * kv, dtype,
                  lambda y: dict(zip("qkv", y.split([q, kv, kv], dim=-1))))


def _neox_qkv(T: int, K: int, heads: int, D: int, dtype: torch.dtype) -> CaseProgram:
    """``qkv.view(T, heads, 3 * D).chunk(3, -1)``: piece j of every head, rows ``h * 3D + j * D ...``."""
    pieces = {n: tuple((h * 3 * D + j * D, h * 3 * D + (j + 1) * D) for h in range(heads))
              for j, n in enumerate("qkv")}

    def eager(y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: p.reshape(T, heads * D) for n, p in zip("qkv", y.view(T, heads, 3 * D).chunk(3, dim=-1))}

    return _fused(T, K, pieces, heads * 3 * D, dtype, eager)


register_cases(__package__, [
    OpCase("T1_K384_N512_f32_chunked", lambda: _linear(1, 384, 512, F32, bias=False), gen={"chunk_bytes": 1024}),
    OpCase("bias_T3_K200_N300_bf16", lambda: _linear(3, 200, 300, BF16, bias=True), BF16_TOL),
    OpCase("stored_chunks_T8_K256_N1024_bf16", lambda: _linear(8, 256, 1024, BF16, bias=False), BF16_TOL,
           gen={"chunk_bytes": 64}),
    OpCase("fused_qkv_rows_T2_K256_bf16", lambda: _phi3_qkv(2, 256, 256, 128, BF16), BF16_TOL),
    OpCase("neox_qkv_per_head_rows_T3_K192_f32", lambda: _neox_qkv(3, 192, 2, 64, F32)),
])
