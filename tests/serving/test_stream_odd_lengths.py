"""Streamed attention over caches that are not a multiple of the block (issue 15): the first ``r = L % Lb``
positions are one more block, read as the multiple of 128 above ``r`` with its positions past ``r`` masked (the
next block reads them), first under LNC=1 / a head split, after the two cores' combine under a block split.
Against the reference VM and the fp32 formula at the positions around the short block's edges, the paged
variant at a table length that is not a multiple of 128, and the bytes read."""
import os
import sys

import pytest
import torch

from fusegraph import nkisim
from fusegraph.patterns.attention.lowering import block_starts, choose_stream, scratch_limit, stream_plan
from fusegraph.perf.kernelview import parse_source

sys.path.insert(0, os.path.dirname(__file__))
from test_paged_extent import _gathers, _program as _paged_program  # noqa: E402
from test_paged_attention import _formula as _paged_formula  # noqa: E402
from test_stream_attention import _block_loops, _check, _program  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def _block_and_rest(source):
    """(Lb, r) of a streamed attention over a cache that is not a multiple of its block: its hardware block loop
    steps Lb positions and starts after the short first block of r positions (the parsed source)."""
    (loop,) = _block_loops(source)
    return loop.step, loop.start


def _odd_masks(profile):
    """(sites, executions, columns) of the short block's memset of its positions past r (``.mask_odd``)."""
    sites = profile.named(".mask_odd", "memset")
    return len(sites), sum(s.count for s in sites), {s.max_free for s in sites}


def test_block_starts_cover_every_position_once():
    for L, Lb in [(2100, 1024), (700, 256), (144, 128), (4000, 2048), (1024, 256), (5000, 1024)]:
        starts, sizes = block_starts(L, Lb)
        r = L % Lb
        covered = []
        for i, (s, n) in enumerate(zip(starts, sizes)):
            assert n % 128 == 0 and s + n <= L  # whole tiles, inside the cache
            covered += list(range(s, s + (r if (r and i == 0) else n)))
        assert covered == list(range(L))


def test_stream_plan_takes_every_length():
    args = dict(D=128, G=4, split=1, kvb=2, qb=2, mb=2, sb=2)
    for L in (2049, 2100, 4000, 5000, 131071):
        Lb, scratch = stream_plan(L, **args)
        assert Lb % 128 == 0 and Lb <= L and scratch <= scratch_limit("trn2")
        Lb2, _ = stream_plan(L, **args, pos_split=True)
        assert L // Lb2 >= 2  # a block split needs a full block per core


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lnc", [1, 2])
def test_odd_length_cache_streams_by_default(dtype, lnc):
    """2100 positions (> 2048, not a multiple of 128): full blocks after a short first block of r = L % Lb positions
    read as the multiple of 128 above r; sequences in the short block, on its last position, just after it, in the
    middle and at the end. LNC=2 splits the heads."""
    L, Hq, Hkv, D = 2100, 4, 2, 64
    # the block is the modeled choice (dtype, heads per core): any block leaving a short first block of r positions;
    # the sequences sit inside it, on its last position, just after it, at the end of its read (Lr) and past it
    heads = Hkv // lnc
    sb = dtype.itemsize if dtype != torch.float32 else 4
    choice = choose_stream(L, D, Hq // Hkv, 1, dtype.itemsize, dtype.itemsize, dtype.itemsize, sb, heads=heads,
                           target="trn2", kv_rows=Hkv * L, exact=dtype != torch.float32)
    r0 = L % choice.Lb
    Lr0 = -(-r0 // 128) * 128
    b = _program(dtype, [5, r0 - 1, r0, Lr0 - 1, Lr0, (L + Lr0) // 2, L - 1], L, Hq, Hkv, D)
    gen, res, ref, kern = b.run(lnc=lnc)
    prof = nkisim.last_profile()
    Lb, r = _block_and_rest(gen.source)
    Lr = -(-r // 128) * 128
    # the short block's mask is written in the early read of sequence 0 (attention.PREFETCH) and the others' read:
    # two sites, once per sequence on each core, its Lr - r positions past r
    assert Lb == choice.Lb and r == L % Lb > 5
    assert _odd_masks(prof) == (2, lnc * 7, {Lr - r})
    # V read as blocks of Lr positions (the short block) and of Lb
    assert sorted({d.max_bytes // (heads * D * dtype.itemsize) for d in prof.named_dmas(".vload")}) == [Lr, Lb]
    _check(b, gen, res, ref, Hq, Hkv, D, dtype)
    assert torch.equal(kern["k_cache"], ref["k_cache"]) and torch.equal(kern["v_cache"], ref["v_cache"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,pos", [(700, [0, 187, 188, 699]), (1100, [75, 76, 600, 1099])])
def test_odd_length_block_split_under_lnc2(dtype, L, pos):
    """3 kv heads under LNC=2 split the blocks: each core reads every other full block, the states are combined,
    then both cores add the short first block; equal to LNC=1 and the reference. 700 = 188 + 2 x 256 (no loop),
    1100 = 76 + 4 x 256 (each core one more block in its loop)."""
    Hq, Hkv, D = 6, 3, 64
    b = _program(dtype, pos, L, Hq, Hkv, D, block=256)
    gen1, res1, ref, _ = b.run()
    gen2, res2, _, _ = b.run(lnc=2)
    prof2 = nkisim.last_profile()
    # the two cores' states are combined (once per sequence on each core), then both cores read the short block:
    # one site, after the combine, masking the Lr - r positions past r
    r = L % 256
    assert prof2.executions(".acc_both") == 2 * len(pos)
    assert _odd_masks(prof2) == (1, 2 * len(pos), {-(-r // 128) * 128 - r})
    lines = parse_source(gen2.source)[0]
    combine = max(ln.index for ln in lines if ln.name.endswith(".acc_both"))
    assert [ln.index > combine for ln in lines if ln.name.endswith(".mask_odd")] == [True]
    _check(b, gen1, res1, ref, Hq, Hkv, D, dtype)
    _check(b, gen2, res2, ref, Hq, Hkv, D, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_length_without_positions_and_softcap(dtype):
    """No KV write (every block read, static bound), Gemma 2 soft-capping, 600 = 88 + 2 x 256 positions; a
    sequence whose short first block is masked entirely stays finite."""
    L, Hq, Hkv, D, cap = 600, 4, 2, 64, 20.0
    b = _program(dtype, [L - 1, L - 1], L, Hq, Hkv, D, block=256, write=False, softcap=cap)
    b.tensors["mask"][1, :100] = torch.finfo(torch.float32).min
    gen, res, ref, _ = b.run()
    assert _odd_masks(nkisim.last_profile()) == (1, 2, {128 - 88})  # once per sequence: positions 88 ... 127
    assert torch.isfinite(res["out_o"].float()).all()
    _check(b, gen, res, ref, Hq, Hkv, D, dtype, softcap=cap)


def test_odd_length_reads_only_a_tile_more_than_the_cache():
    """The bytes of the K/V loads at the end of a 2100-position cache: every position once, plus the short block's
    padding to a multiple of 128 (read twice); a sequence at position 5 reads only the short block, twice: once at
    the layer's start, before the KV write (attention.PREFETCH), and again after it, its row being in that block."""
    L, Hq, Hkv, D = 2100, 2, 1, 64
    for end in (True, False):
        b = _program(torch.float32, [L - 1 if end else 5], L, Hq, Hkv, D)
        gen = b.run()[0]
        Lb, r = _block_and_rest(gen.source)
        Lr = -(-r // 128) * 128
        positions = L + Lr - r if end else 2 * Lr
        pos = positions
        by = nkisim.last_profile().to_dict()["hbm_by_tensor"]
        # the KV write reads nothing of the cache; K and V of every position read, fp32
        assert by["k_cache"]["read_bytes"] == positions * Hkv * D * 4, pos
        assert by["v_cache"]["read_bytes"] == positions * Hkv * D * 4, pos


@pytest.mark.parametrize("dtype,lnc", [(torch.float32, 1), (torch.bfloat16, 2)])
def test_paged_table_not_a_multiple_of_128(dtype, lnc):
    """A paged table of 41 blocks of 16 (656 positions): blocks of 512 after a short first block of 144 read as
    256; sequences in the short block, at its edge, in the last block; only their blocks are gathered."""
    Hq, Hkv, D, BS, MB = 4, 2, 64, 16, 41
    lens = [5, 143, 655]
    b, table = _paged_program(dtype, lens, BS, MB, NB=3 * MB + 4, Hq=Hq, Hkv=Hkv, D=D)
    gen, res, ref, kern = b.run(lnc=lnc)
    prof = nkisim.last_profile()
    # scores (and softmax) over the short block read as 256 positions and over blocks of 512; one short-block mask
    # (positions 144 ... 255) per sequence on each core
    assert sorted({s.max_free for s in prof.named(".exp", "activation")}) == [256, 512]
    assert _odd_masks(prof) == (1, lnc * 3, {256 - 144})
    # gathers of 16 rows: the short block 16, the block of 512 32 more, per sequence that reaches it
    assert _gathers() == lnc * (16 * 3 + 32 * 1)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(res["out_o"].float(), ref["o"].float(), **tol)
    ftol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=6e-2, rtol=6e-2)
    torch.testing.assert_close(res["out_o"].float(), _paged_formula(b, ref, table, Hq, Hkv, D), **ftol)
