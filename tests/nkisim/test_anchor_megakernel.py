"""The hand-written Qwen3-30B-A3B megakernel, unmodified: 48 layers shape-only (one TP=4 x LNC=2 rank) and 2 layers
with data on all four ranks. Needs MK and NKILIB (shared/tools/prepare_anchors.sh); slow, skipped without them."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import anchor_megakernel as M  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not M.available(), reason="MK / NKILIB checkouts not set")]

E, TOP_K, I_RANK = 128, 8, 192


def test_48_layers_shape_only_read_what_one_rank_needs():
    p, seconds = M.shape_only(48)
    assert seconds < 120 and p.lnc == 2 and p.instructions > 48 * 1000
    t = p.hbm_by_tensor
    expert_gu, expert_down = M.H * 2 * I_RANK * 2, I_RANK * M.H * 2  # bf16 bytes of one expert
    for i in range(48):
        assert t[f"Wq_{i:02d}"].read_bytes == 8 * M.D * M.H * 2  # the rank's 8 query heads, once over both cores
        assert t[f"Wo_{i:02d}"].read_bytes == 8 * M.D * M.H * 2
        assert t[f"GateUp_{i:02d}"].read_bytes == TOP_K * expert_gu  # only the top-8 experts
        assert t[f"Down_{i:02d}"].read_bytes == TOP_K * expert_down
        for kv in ("K", "V"):
            assert t[f"{kv}_{i:02d}"].write_bytes == M.D * 2  # one new row per layer
    assert t["Y"].write_bytes == M.H * 2


def test_2_layers_with_data_on_all_ranks():
    layers = 2
    before, outs, _ = M.data(layers)
    assert len(outs) == M.TP
    ys = [np.asarray(o[0], np.float32) for o in outs]
    assert np.isfinite(ys[0]).all() and np.abs(ys[0]).max() > 0
    assert all(np.array_equal(y, ys[0]) for y in ys)  # both all-reduces leave every rank with the same residual
    ix = M.arg_index(layers)
    for args, out in zip(before, outs):
        k_ref, v_ref = M.kv_reference(args, layers)
        for j, (name, ref) in enumerate((("K", k_ref), ("V", v_ref))):
            for layer in range(layers):
                new = np.asarray(out[1 + j * layers + layer], np.float32)
                old = np.asarray(args[ix[name] + layer], np.float32)
                changed = np.flatnonzero((new != old).any(axis=-1).reshape(-1))
                assert list(changed) == [M.POS]  # the in-place scatter writes the position's row only
            np.testing.assert_allclose(np.asarray(out[1 + j * layers], np.float32)[0, 0, M.POS], ref,
                                       rtol=2 ** -7, atol=1e-6)
