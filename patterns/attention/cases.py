"""Test cases of the attention op (:class:`~.lowering.Attention`) against the ``decode_attention`` pattern
functions (on the model's ``[B, heads, 1, D]`` q and ``[B, kv, L, D]`` caches, after this step's KV write by the
kv_cache op, which attention builds on): GQA with HF eager's rounding, SDPA's fp32 scores with its boolean mask (the
kernel gets it additive, :func:`~.lowering.bool_to_additive`, as the lowering converts it), heads of 256 features
(split over two partition tiles), Gemma 2's soft-capped scores, and the streamed (flash-decoding) template with a
short first block, bounded by each sequence's position."""
from __future__ import annotations

import torch

from fusegraph.codegen.api import BF16_TOL, Builder, CaseProgram, OpCase, length_mask, register_cases
from fusegraph.patterns.kv_cache.kv_cache_update import kv_cache_update
from fusegraph.patterns.kv_cache.lowering import KVWrite

from .decode_attention import _sdpa, decode_attention, decode_attention_softcap
from .lowering import Attention, bool_to_additive

F32, BF16 = torch.float32, torch.bfloat16


def _attention(positions: list[int], Hq: int, Hkv: int, D: int, L: int, dtype: torch.dtype, *,
               form: str = "eager", softcap: float = 0.0, block: int = 0, q_scale: float = 1.0) -> CaseProgram:
    """This step's K/V rows written at each sequence's position, then attention over the cache (masked after the
    position). ``form``: ``eager`` (HF eager: scores rounded to the dtype) or ``sdpa`` (fp32 scores, boolean
    mask); ``block``: force the streamed template with blocks of that many positions."""
    B = len(positions)
    g = torch.Generator().manual_seed(B * Hq * D + L)
    q = (q_scale * torch.randn(B, Hq * D, generator=g)).to(dtype)
    k, v = (torch.randn(B, Hkv * D, generator=g).to(dtype) for _ in range(2))
    kc, vc = (torch.randn(B, Hkv, L, D, generator=g).to(dtype) for _ in range(2))
    pos = torch.tensor(positions)
    allowed = torch.arange(L)[None, :] <= pos[:, None]  # HF's causal mask of the step (True = attend)
    mask = length_mask(positions, L, dtype) if form == "eager" else bool_to_additive(allowed)
    b = Builder(B)
    kcv, vcv = b.hbm("k_cache", kc, "state"), b.hbm("v_cache", vc, "state")
    idx = b.hbm("kv_idx", pos.to(torch.int32), "input")
    b.ins.append(KVWrite(cache=kcv, value=b.act("k", k), index=idx, layer=0))
    b.ins.append(KVWrite(cache=vcv, value=b.act("v", v), index=idx, layer=0))
    o = b.new("o", Hq * D, dtype)
    b.ins.append(Attention(q=b.act("q", q), k_cache=kcv, v_cache=vcv, mask=b.hbm("mask", mask, "input"), out=o,
                           scale=D ** -0.5, groups=Hq // Hkv, rounding="fused" if form == "sdpa" else "eager",
                           softcap=softcap, index=idx, block=block, layer=0))
    b.store(o)

    def eager(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        kc, vc = t["k_cache"], t["v_cache"]
        for s in range(B):
            kv_cache_update(kc[s:s + 1], t["position"][s:s + 1], t["k"].reshape(B, Hkv, 1, D)[s:s + 1])
            kv_cache_update(vc[s:s + 1], t["position"][s:s + 1], t["v"].reshape(B, Hkv, 1, D)[s:s + 1])
        qh = t["q"].reshape(B, Hq, 1, D)
        if form == "sdpa":
            out = _sdpa(qh, kc, vc, t["allowed"].reshape(B, 1, 1, L), scale=D ** -0.5)
        elif softcap:
            out = decode_attention_softcap(qh, kc, vc, t["mask"].reshape(B, 1, 1, L), scale=D ** -0.5,
                                           softcap=softcap)
        else:
            out = decode_attention(qh, kc, vc, t["mask"].reshape(B, 1, 1, L), scale=D ** -0.5)
        return {"o": out.reshape(B, Hq * D), "k_cache": kc, "v_cache": vc}

    inputs = {"q": q, "k": k, "v": v, "k_cache": kc, "v_cache": vc, "position": pos, "mask": mask,
              "allowed": allowed}
    return CaseProgram(b, inputs, eager)


register_cases(__package__, [
    OpCase("gqa_B2_4q2kv_D64_L200_bf16", lambda: _attention([5, 199], 4, 2, 64, 200, BF16), BF16_TOL),
    OpCase("sdpa_B1_8q2kv_D128_L64_f32", lambda: _attention([40], 8, 2, 128, 64, F32, form="sdpa")),
    OpCase("head_dim_256_B2_4q2kv_L40_bf16", lambda: _attention([3, 39], 4, 2, 256, 40, BF16), BF16_TOL),
    OpCase("softcap_B2_4q2kv_D64_L32_bf16",
           lambda: _attention([20, 31], 4, 2, 64, 32, BF16, softcap=20.0, q_scale=8.0), BF16_TOL),
    OpCase("streamed_B2_4q1kv_D64_L300_f32", lambda: _attention([100, 299], 4, 1, 64, 300, F32, block=128)),
    OpCase("streamed_long_B2_8q2kv_D128_L4096_bf16", lambda: _attention([1000, 4095], 8, 2, 128, 4096, BF16),
           BF16_TOL, slow=True),
])
