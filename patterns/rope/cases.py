"""Test cases of the rope op (:class:`~.lowering.Rope`) against its pattern functions on the model's
``[B, heads, 1, D]`` q/k and ``[B, 1, 1, R]`` cos/sin: the half rotation (``rope``), interleaved pairs
(``rope_interleaved``), a partial rotary dim (``rope_partial``, ``rope_interleaved_partial``: the kernel gets cos/sin
padded with 1 and 0 past ``R``, as the lowering's argument padding does), and heads of 256 features split over two
partition tiles. Head counts that make feature counts no multiple of 128 (3 x 64)."""
from __future__ import annotations

import torch

from fusegraph.codegen.api import BF16_TOL, Builder, CaseProgram, OpCase, register_cases

from .lowering import Rope
from .rope import rope
from .rope_interleaved import rope_interleaved, rope_interleaved_partial
from .rope_partial import rope_partial

F32, BF16 = torch.float32, torch.bfloat16


def _tables(positions: list[int], R: int, dtype: torch.dtype, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos/sin ``[T, R]`` of each sequence's position (``inv_freq = 1 / 10000^(2i/R)``): the frequencies
    repeated as halves (``cat``) or per pair (``repeat_interleave``, GPT-J)."""
    freqs = torch.tensor(positions, dtype=torch.float32)[:, None] * (1.0 / 10000 ** (torch.arange(0, R, 2) / R))
    emb = torch.repeat_interleave(freqs, 2, dim=-1) if interleaved else torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _padded(t: torch.Tensor, D: int, value: float) -> torch.Tensor:
    """A ``[T, R]`` table padded to the head size with ``value`` (the lowering's ``ArgSource.pad``)."""
    return torch.cat([t, t.new_full((t.shape[0], D - t.shape[1]), value)], dim=-1)


def _case(T: int, H: int, D: int, dtype: torch.dtype, R: int = 0, interleaved: bool = False) -> CaseProgram:
    R = R or D
    g = torch.Generator().manual_seed(T * H * D + R)
    x = torch.randn(T, H * D, generator=g).to(dtype)
    cos, sin = _tables([3 + 37 * t for t in range(T)], R, dtype, interleaved)
    b = Builder(T)
    y = b.new("y", H * D, dtype)
    b.ins.append(Rope(x=b.act("x", x), cos=b.hbm("cos", _padded(cos, D, 1.0), "input"),
                      sin=b.hbm("sin", _padded(sin, D, 0.0), "input"), out=y, head_dim=D,
                      rotary_dim=R if R < D else 0, interleaved=interleaved, layer=0))
    b.store(y)
    fn = {(False, True): rope, (True, True): rope_interleaved, (False, False): rope_partial,
          (True, False): rope_interleaved_partial}[(interleaved, R == D)]

    def eager(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        q = t["x"].reshape(T, H, 1, D)  # [B, heads, S=1, D]
        out = fn(q, t["cos"].reshape(T, 1, 1, R), t["sin"].reshape(T, 1, 1, R))
        return {"y": out.reshape(T, H * D)}

    return CaseProgram(b, {"x": x, "cos": cos, "sin": sin}, eager)


register_cases(__package__, [
    OpCase("full_T2_3x64_f32", lambda: _case(2, 3, 64, F32)),
    OpCase("full_T3_3x128_bf16", lambda: _case(3, 3, 128, BF16), BF16_TOL),
    OpCase("interleaved_T2_4x64_bf16", lambda: _case(2, 4, 64, BF16, interleaved=True), BF16_TOL),
    OpCase("partial_R32_T2_4x64_f32", lambda: _case(2, 4, 64, F32, R=32)),
    OpCase("interleaved_partial_R32_T1_2x64_bf16", lambda: _case(1, 2, 64, BF16, R=32, interleaved=True),
           BF16_TOL),
    OpCase("split_head_T2_2x256_bf16", lambda: _case(2, 2, 256, BF16), BF16_TOL),
])
