"""Test cases of the KV-cache op against its pattern functions, on the caches after the kernel's in-place writes:
:class:`~.lowering.KVWrite` (``kv_cache_update``: ``cache.index_copy_(2, position, value)``; a batch whose sequences
are at different positions is that update per sequence, what a serving step does) and :class:`~.lowering.KVRoll`
(``sliding_window_roll``: the full window rolled by one row, the new row last). Cache lengths that are no multiple of
128, and heads of 256 features (written from two partition tiles)."""
from __future__ import annotations

import torch

from fusegraph.codegen.api import EXACT, Builder, CaseProgram, OpCase, register_cases

from .kv_cache_update import kv_cache_update
from .lowering import KVRoll, KVWrite
from .sliding_window_cache import sliding_window_roll

F32, BF16 = torch.float32, torch.bfloat16


def _tensors(B: int, H: int, L: int, D: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(B * H * L * D)
    return torch.randn(B, H, L, D, generator=g).to(dtype), torch.randn(B, H * D, generator=g).to(dtype)


def _write(positions: list[int], H: int, L: int, D: int, dtype: torch.dtype) -> CaseProgram:
    B = len(positions)
    cache, value = _tensors(B, H, L, D, dtype)
    pos = torch.tensor(positions)
    b = Builder(B)
    b.ins.append(KVWrite(cache=b.hbm("cache", cache, "state"), value=b.act("value", value),
                         index=b.hbm("index", pos.to(torch.int32), "input"), layer=0))

    def eager(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        c, v = t["cache"], t["value"].reshape(B, H, 1, D)
        for s in range(B):  # each sequence's row at its own position (one shared position: HF's static cache)
            kv_cache_update(c[s:s + 1], t["position"][s:s + 1], v[s:s + 1])
        return {"cache": c}

    return CaseProgram(b, {"cache": cache, "value": value, "position": pos}, eager)


def _roll(B: int, H: int, W: int, D: int, dtype: torch.dtype) -> CaseProgram:
    cache, value = _tensors(B, H, W, D, dtype)
    b = Builder(B)
    b.ins.append(KVRoll(cache=b.hbm("cache", cache, "state"), value=b.act("value", value), layer=0))
    return CaseProgram(b, {"cache": cache, "value": value},
                       lambda t: {"cache": sliding_window_roll(t["cache"], torch.tensor([-1]),
                                                               t["value"].reshape(B, H, 1, D))})


register_cases(__package__, [
    OpCase("write_same_position_B2_2x64_L200_f32", lambda: _write([7, 7], 2, 200, 64, F32), EXACT),
    OpCase("write_B3_4x64_L256_bf16", lambda: _write([0, 130, 255], 4, 256, 64, BF16), EXACT),
    OpCase("write_split_head_B2_2x256_L40_bf16", lambda: _write([5, 39], 2, 40, 256, BF16), EXACT),
    OpCase("roll_window_B2_2x64_W200_bf16", lambda: _roll(2, 2, 200, 64, BF16), EXACT),
    OpCase("roll_window_B1_4x128_W300_f32", lambda: _roll(1, 4, 300, 128, F32), EXACT),
])
