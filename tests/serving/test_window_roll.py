"""Full sliding windows (HF ``StaticSlidingWindowLayer`` once full: ``roll(-1)`` + write at ``[-1]`` +
``copy_``) roll inside the kernel (``KVRoll``, ``kv_roll.j2``): the template against the reference VM, and tiny
Gemma 2 / Mistral models whose prompts are longer than their windows, so every decode step rolls."""
import sys
import os

import pytest
import torch

from fusegraph.patterns.kv_cache.lowering import KVRoll, roll_pieces
from fusegraph.codegen.testing import Builder, V
from fusegraph.nkiapi.conformance import check_source

sys.path.insert(0, os.path.dirname(__file__))
from test_stream_models import SLOW, padded_batch, run_and_check  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("W,lnc", [(40, 1), (300, 1), (4096, 1), (300, 2)])
def test_kv_roll_equals_torch_roll(dtype, W, lnc):
    """Rows move up one slot in increasing order (each read before it is overwritten), the new row lands last;
    W = 40 (one partial piece), 300 (full tiles + rest), 4096 (two blocks of 16 tiles + rest); LNC=2 splits the
    kv heads."""
    torch.manual_seed(5)
    B, H, D = 2, 2, 64
    b = Builder(B)
    kc = b.hbm("k_cache", torch.randn(B, H, W, D, dtype=dtype), V.STATE)
    b.ins.append(KVRoll(cache=kc, value=b.act("k", torch.randn(B, H * D, dtype=dtype)), layer=0))
    gen, _, ref, kern = b.run(lnc=lnc)
    assert check_source(gen.source) == []
    expected = b.tensors["k_cache"].roll(-1, dims=2)
    expected[:, :, -1] = b.tensors["in_k"].reshape(B, H, D)
    assert torch.equal(ref["k_cache"], expected)  # the reference VM is HF's formula
    assert torch.equal(kern["k_cache"], expected)


def test_roll_pieces_cover_every_row_once_in_order():
    for W in (2, 129, 300, 2049, 4096):
        rows = [r0 + p + parts * j for r0, parts, n in roll_pieces(W) for j in range(n) for p in range(parts)]
        assert sorted(rows) == list(range(W - 1))
        starts = [r0 for r0, _, _ in roll_pieces(W)]
        assert starts == sorted(starts)


def test_full_window_rolls_in_the_kernel_gemma2():
    """Gemma 2: sliding layer (window 256, prompt 300: full, rolls every step, single-pass attention) and full
    layer (2560 positions, streamed), soft-capped scores, one kernel."""
    _, src = run_and_check(padded_batch("Gemma2", 2560, 1, prompt=300, sliding_window=256))
    assert src.count("sliding-window KV cache") == 2  # K and V of the sliding layer
    assert src.count("cache positions streamed in blocks of") == 1  # the full layer


@SLOW
@pytest.mark.parametrize("family,L,batch,W", [("Mistral", 8192, 1, 4096), ("Mistral", 4096, 3, 256),
                                              ("Gemma2", 4096, 3, 256), ("Gemma2", 32768, 1, 4096)])
def test_full_window_rolls_in_the_kernel(family, L, batch, W):
    """Windows longer than STREAM_ABOVE stream the full window (no position bound: every block is valid)."""
    _, src = run_and_check(padded_batch(family, L, batch, prompt=W + 20, sliding_window=W))
    rolled = 2 * (2 if family == "Mistral" else 1)
    assert src.count("sliding-window KV cache") == rolled
