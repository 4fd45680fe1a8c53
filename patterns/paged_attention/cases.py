"""Test cases of the paged-attention op: :class:`~.lowering.PagedKVWrite` + :class:`~.lowering.PagedAttention`
against ``paged_kv_write`` and ``paged_attention`` (block sizes dividing 128, and with the per-sequence extent the
lowering derives from the mask, :func:`~.lowering.mask_extent`)."""
from __future__ import annotations

import torch

from fusegraph.codegen.api import BF16_TOL, Builder, CaseProgram, OpCase, length_mask, register_cases

from .lowering import PagedAttention, PagedKVWrite, mask_extent
from .pattern import paged_attention, paged_kv_write

F32, BF16 = torch.float32, torch.bfloat16


def _paged(lens: list[int], Hq: int, Hkv: int, D: int, BS: int, MB: int, dtype: torch.dtype,
           extent: bool = False, block: int = 0) -> CaseProgram:
    """Each sequence's new row written at its slot (from its block table), then attention over its blocks, masked
    after its position; ``extent``: streamed blocks (of ``block`` positions) after each sequence's last unmasked
    position are skipped."""
    B, NB = len(lens), 3 * MB + 5
    g = torch.Generator().manual_seed(B * BS * MB + D)
    table = torch.randperm(NB, generator=g)[:B * MB].reshape(B, MB)
    pos = torch.tensor(lens)
    slots = table.gather(1, (pos // BS)[:, None])[:, 0] * BS + pos % BS
    kp, vp = (torch.randn(NB, BS, Hkv, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, Hkv * D, generator=g).to(dtype) for _ in range(2))
    q = (2 * torch.randn(B, Hq * D, generator=g)).to(dtype)
    mask = length_mask(lens, MB * BS, dtype)
    b = Builder(B)
    kpv, vpv = b.hbm("k_pool", kp, "state"), b.hbm("v_pool", vp, "state")
    sl = b.hbm("slots", slots.to(torch.int32), "input")
    b.ins.append(PagedKVWrite(cache=kpv, value=b.act("k", k), slots=sl, layer=0))
    b.ins.append(PagedKVWrite(cache=vpv, value=b.act("v", v), slots=sl, layer=0))
    o = b.new("o", Hq * D, dtype)
    b.ins.append(PagedAttention(q=b.act("q", q), k_cache=kpv, v_cache=vpv, mask=b.hbm("mask", mask, "input"), out=o,
                                scale=D ** -0.5, groups=Hq // Hkv, table=b.hbm("table", table.to(torch.int32), "input"),
                                extent=b.hbm("extent", mask_extent(mask), "input") if extent else None, block=block,
                                layer=0))
    b.store(o)

    def eager(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        kp = paged_kv_write(t["k_pool"], t["slots"], t["k"].reshape(B, Hkv, D))
        vp = paged_kv_write(t["v_pool"], t["slots"], t["v"].reshape(B, Hkv, D))
        out = paged_attention(t["q"].reshape(B, Hq, 1, D), kp, vp, t["table"], t["mask"].reshape(B, 1, 1, -1),
                              scale=D ** -0.5)
        return {"o": out.reshape(B, Hq * D), "k_pool": kp, "v_pool": vp}

    inputs = {"q": q, "k": k, "v": v, "k_pool": kp, "v_pool": vp, "slots": slots, "table": table, "mask": mask}
    return CaseProgram(b, inputs, eager)


register_cases(__package__, [
    OpCase("BS16_MB16_B3_4q2kv_D64_bf16", lambda: _paged([5, 15, 254], 4, 2, 64, 16, 16, BF16), BF16_TOL),
    OpCase("extent_BS32_MB8_B2_4q1kv_D64_f32",  # 2 streamed blocks of 128: sequence 0 reads only the first
           lambda: _paged([40, 200], 4, 1, 64, 32, 8, F32, extent=True, block=128)),
])
