"""Paged attention reads only the blocks a sequence uses (issue 15): every streamed block after the first runs
under a guard (``nl.dynamic_range`` of one iteration or none) bounded by the sequence's *extent*, the last
position its mask leaves unmasked (computed on the host from the step's mask). Ragged batches against the
reference VM and the formula, the bytes of a shape-only profile against the position (not the table size), and
the paged decode step of ``paged_step.py`` with ragged lengths in one kernel equal to eager."""
import os
import sys

import pytest
import torch

from fusegraph import nkisim
from fusegraph import FusegraphWarning
from fusegraph.capture.session import last_session
from fusegraph.codegen.megakernel import generate
from fusegraph.patterns.paged_attention.lowering import PagedAttention, mask_extent
from fusegraph.nkisim.torch_io import abstract_args
from fusegraph.codegen.testing import V
from fusegraph.nkiapi.conformance import check_source
from fusegraph.perf.kernelview import loops, parse_source

sys.path.insert(0, os.path.dirname(__file__))
from paged_step import PagedDecoder, PagedServer  # noqa: E402
from test_paged_attention import _formula  # noqa: E402
from test_paged_attention import _program as paged_program  # noqa: E402
from test_stream_models import eager_ops  # noqa: E402

NEG = torch.finfo(torch.float32).min


def _guards(source):
    """The guards of the streamed blocks after the first: the ``nl.dynamic_range`` loops around the K gathers, each
    with the kernel input its bound register was loaded from (``register_load`` of a tile the kernel DMAs from that
    input), from the parsed source."""
    lines = parse_source(source)[0]
    by_line = {lp.line: lp for lp in loops(source)}
    loaded = {w: ln.reads[0] for ln in lines if ln.opcode == "register_load" for w in ln.writes}
    copied = {w: ln.reads[0] for ln in lines if ln.opcode == "dma_copy" and ln.reads for w in ln.writes}
    around = sorted({i for ln in lines if ln.name.endswith(".kgather") for i in ln.loops})
    return [(by_line[i], copied.get(loaded.get(by_line[i].stop))) for i in around if by_line[i].hardware]


def _program(dtype, lens, BS, MB, NB, Hq=4, Hkv=2, D=64, block=0, bounded=True, seed=5):
    """Each sequence writes its row at position lens[b], then attends over lens[b] + 1 positions of its table
    (``bounded``: with its extent input)."""
    b, table, _ = paged_program(dtype, lens, BS, MB, NB, Hq=Hq, Hkv=Hkv, D=D, block=block, seed=seed, extent=bounded)
    return b, table


def _gathers():
    """Executions of the profiled K gathers of the last run (over both programs of an LNC=2 run)."""
    return sum(s["count"] for s in nkisim.last_profile().to_dict()["sites"]
               if s["opcode"] == "dma_copy" and any(n.endswith(".kgather") for n in s.get("names") or ()))


def test_mask_extent_is_the_last_unmasked_position():
    mn = torch.finfo(torch.bfloat16).min
    m = torch.tensor([[0.0, 0.0, mn, mn], [mn, 0.0, mn, 0.0], [mn, mn, mn, mn], [0.0, -1e9, -1e9, -1e9]])
    assert mask_extent(m.to(torch.bfloat16)[:, None, None, :]).tolist() == [1, 3, 3, 3]
    m32 = torch.tensor([[0.0, float("-inf"), float("-inf")], [0.0, 0.0, NEG]])
    assert mask_extent(m32).tolist() == [0, 1]
    assert mask_extent(torch.tensor([[True, True, False], [False, False, False]])).tolist() == [1, 2]
    assert mask_extent(m32).dtype == torch.int32
    assert mask_extent(torch.zeros(2, 5, dtype=torch.int64)).tolist() == [4, 4]  # unknown form: every block


@pytest.mark.parametrize("dtype,lnc", [(torch.float32, 1), (torch.bfloat16, 1), (torch.float32, 2)])
def test_ragged_paged_attention_reads_only_used_blocks(dtype, lnc):
    """Batch 3 at positions 5, 200, 510 of a 512-position table (BS 16, streamed blocks of 128): 1, 2 and 4 blocks
    run (the others are skipped by their guards); the output equals the reference VM and the formula."""
    Hq, Hkv, D, BS, MB = 4, 2, 64, 16, 32
    lens = [5, 200, 510]
    b, table = _program(dtype, lens, BS, MB, NB=3 * MB + 4, Hq=Hq, Hkv=Hkv, D=D, block=128)
    gen, res, ref, kern = b.run(lnc=lnc)
    assert check_source(gen.source) == []
    # blocks 1, 2, 3 (positions 128, 256, 384 ...) each under a guard of one iteration or none (a step of the whole
    # table) up to a register loaded from the extent input, loaded once per sequence on each core
    guards = _guards(gen.source)
    assert [(lp.start, lp.step, bound) for lp, bound in guards] == [(jb * 128 - 1, MB * BS, "extent") for jb in (1, 2, 3)]
    assert nkisim.last_profile().executions(opcode="register_load") == lnc * len(lens)
    # 8 gathers of 16 rows per 128-position block, per sequence the blocks up to its extent; per core under LNC=2
    assert _gathers() == lnc * 8 * sum(p // 128 + 1 for p in lens)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(res["out_o"].float(), ref["o"].float(), **tol)
    ftol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=6e-2, rtol=6e-2)
    torch.testing.assert_close(res["out_o"].float(), _formula(b, ref, table, Hq, Hkv, D), **ftol)
    for pool in ("k_pool", "v_pool"):
        assert torch.equal(kern[pool], ref[pool])


def _gather_bytes(gen, extent):
    """HBM bytes read from the K/V pools in a shape-only run with every sequence's extent register at ``extent``."""
    ns = nkisim.load_kernel_source(gen.source, f"<test:{gen.name}>", target="trn2")
    nkisim.run(ns[gen.name], *abstract_args(gen), target="trn2", shape_only=True, assume={"kv_extent": extent})
    by = nkisim.last_profile().to_dict()["hbm_by_tensor"]
    return by["k_pool"]["read_bytes"] + by["v_pool"]["read_bytes"]


def test_shape_only_profile_bytes_scale_with_the_position_not_the_table():
    """Shape-only (``assume={"kv_extent": p}``): the K/V bytes are those of the blocks up to p, the same for a table
    of 32 or 64 entries; without a bound (the old static loop) every entry is read."""
    Hkv, D, BS, Lb = 2, 64, 16, 128
    per_block = 2 * Lb * Hkv * D * 4  # K and V of one 128-position block, fp32, one sequence
    for MB in (32, 64):
        b, _ = _program(torch.float32, [5], BS, MB, NB=MB + 4, Hkv=Hkv, D=D, block=Lb)
        gen = generate(b.program())
        for p in (0, 127, 128, 300, 511):
            assert _gather_bytes(gen, p) == (p // Lb + 1) * per_block, (MB, p)
        assert _gather_bytes(gen, MB * BS - 1) == MB * BS // Lb * per_block
        b, _ = _program(torch.float32, [5], BS, MB, NB=MB + 4, Hkv=Hkv, D=D, block=Lb, bounded=False)
        gen = generate(b.program())
        assert _guards(gen.source) == []
        assert _gather_bytes(gen, 0) == MB * BS // Lb * per_block


def _serve(lens, steps, max_blocks, num_blocks):
    import warnings

    torch.manual_seed(0)
    model = PagedDecoder().eval()
    srv = PagedServer(model, lens, num_blocks=num_blocks, max_blocks=max_blocks)
    ref = srv.fork()
    step = torch.compile(model, backend="fusegraph", options={"executor": "nkisim", "cache_dir": "off"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusegraphWarning)
        got = [srv.step(step) for _ in range(steps)]
    want = [ref.step(model) for _ in range(steps)]
    return srv, ref, got, want


def test_paged_decode_step_with_ragged_lengths_skips_unused_blocks():
    """The paged decode step (2 layers) with 3 sequences at 15, 40 and 700 positions of 48-entry tables (768
    positions, streamed blocks of 384): one kernel launch per step, nothing eager, tokens/logits/pools equal
    eager; the short sequences' second block is skipped (gathers executed per step: 2 layers x (24 + 24 + 48))."""
    srv, ref, got, want = _serve([15, 40, 700], steps=2, max_blocks=48, num_blocks=160)
    for a, b in zip(got, want):
        assert torch.equal(a[:, -1].argmax(-1), b[:, -1].argmax(-1))
        assert (a.float() - b.float()).abs().max().item() <= 1e-4 * b.float().abs().max().item()
    for (k1, v1), (k2, v2) in zip(srv.caches, ref.caches):
        for a, b in ((k1, k2), (v1, v2)):
            assert (a - b).abs().max().item() <= 1e-5
    session = last_session()
    (record,) = session.program.execution.values()
    assert record.launches_per_call == 1 and list(record.verification.values()) == ["passed"]
    assert not eager_ops(session, record)
    src = record.run.plans[0].generated.source
    # per layer, scores over blocks of 384 positions and one guard (the second block, from position 384)
    assert {s.max_free for s in nkisim.last_profile().named(".exp", "activation")} == {384}
    assert [(lp.start, lp.step) for lp, _ in _guards(src)] == [(383, 768)] * 2
    assert _gathers() == 2 * (24 + 24 + 48)


def test_two_masks_get_their_own_extents():
    """Two paged attentions over the same pools with different masks (e.g. a shorter window of the same table):
    each is bounded by its own mask's extents (``kv_extent`` and ``kv_extent_1``), both equal the reference."""
    Hq, Hkv, D, BS, MB = 4, 2, 64, 16, 32
    lens = [300, 510]
    b, table = _program(torch.float32, lens, BS, MB, NB=2 * MB + 4, Hq=Hq, Hkv=Hkv, D=D, block=128)
    att = b.ins[-2]  # the first attention (the store follows it)
    mask2 = b.tensors["mask"].clone()
    mask2[:, 100:] = NEG  # the second attends over the first 100 positions only: one block
    m2 = b.hbm("mask2", mask2, V.INPUT)
    o2 = b.new("o2", Hq * D, torch.float32)
    b.ins.append(PagedAttention(q=att.q, k_cache=att.k_cache, v_cache=att.v_cache, mask=m2, out=o2,
                                scale=att.scale, groups=att.groups, table=att.table,
                                extent=b.hbm("extent2", mask_extent(mask2), V.INPUT), block=128, layer=0))
    b.store(o2)
    gen, res, ref, _ = b.run()
    assert check_source(gen.source) == []
    # each attention's three guards bounded by a register loaded from its own extent input
    assert [bound for _, bound in _guards(gen.source)] == ["extent"] * 3 + ["extent2"] * 3
    assert _gathers() == 8 * sum(p // 128 + 1 for p in lens) + 8 * len(lens)
    for out, want in (("out_o", "o"), ("out_o2", "o2")):
        torch.testing.assert_close(res[out], ref[want], atol=2e-5, rtol=2e-5)
