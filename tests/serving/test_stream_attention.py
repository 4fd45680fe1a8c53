"""The streamed (flash-decoding) decode attention template, ``attention_stream.j2``, against the reference VM and
the softmax formula in fp32: blocks forced small (``block=``) so a small cache streams in several blocks, fp32 and
bf16, LNC=1 and LNC=2 (kv heads split between the cores; an odd number of kv heads splits the *blocks* and
combines the two running states with one ``sendrecv``), blocks past each sequence's position skipped."""
import contextlib
import dataclasses

import pytest
import torch

from fusegraph import nkisim
from fusegraph.codegen import ir
from fusegraph.patterns.attention import lowering as attention
from fusegraph.patterns.attention.lowering import row_groups, stream_plan
from fusegraph.nkiapi.conformance import check_source
from fusegraph.perf.kernelview import loops, parse_source

from fusegraph.codegen.testing import Builder, V

DTYPES = [torch.float32, torch.bfloat16]
STREAM_ABOVE = attention.DEFAULT_SWITCHES.stream_above


@pytest.fixture
def switch():
    """``switch(pipeline=False, ...)``: the attention switches (``StreamSwitches``, the ``attn_*`` options) the
    rest of the test generates kernels with, outside the executors (which take them from the options)."""
    with contextlib.ExitStack() as stack:
        yield lambda **kw: stack.enter_context(attention.use_switches(dataclasses.replace(attention.switches(), **kw)))
NEG = torch.finfo(torch.float32).min


def _program(dtype, pos, L, Hq, Hkv, D=64, block=0, write=True, softcap=0.0, sinks=None):
    """KV writes at ``pos`` (one position per sequence) + attention over the written cache with a length mask
    (``sinks``: GPT-OSS's per-head sink logits, a weight argument named ``sinks``)."""
    torch.manual_seed(11)
    B = len(pos)
    b = Builder(B)
    q = b.act("q", (2 * torch.randn(B, Hq * D)).to(dtype))
    kc = b.hbm("k_cache", torch.randn(B, Hkv, L, D, dtype=dtype), V.STATE)
    vc = b.hbm("v_cache", torch.randn(B, Hkv, L, D, dtype=dtype), V.STATE)
    mask = torch.zeros(B, L)
    for i, p in enumerate(pos):
        mask[i, p + 1:] = NEG
    m = b.hbm("mask", mask.to(dtype), V.INPUT)
    idx = None
    if write:
        idx = b.hbm("kv_idx", torch.tensor(pos, dtype=torch.int32), V.INPUT)
        k = b.act("k", torch.randn(B, Hkv * D, dtype=dtype))
        v = b.act("v", torch.randn(B, Hkv * D, dtype=dtype))  # (both before the writes: layer 0 is one run)
        b.ins.append(ir.KVWrite(cache=kc, value=k, index=idx, layer=0))
        b.ins.append(ir.KVWrite(cache=vc, value=v, index=idx, layer=0))
    o = b.new("o", Hq * D, dtype)
    sv = b.hbm("sinks", sinks.to(dtype)) if sinks is not None else None
    b.ins.append(ir.Attention(q=q, k_cache=kc, v_cache=vc, mask=m, out=o, scale=D ** -0.5, groups=Hq // Hkv,
                              softcap=softcap, index=idx, block=block, sinks=sv, layer=0))
    b.store(o)
    return b


def _formula(b, ref, Hq, Hkv, D, softcap=0.0):
    B, _, L, _ = ref["k_cache"].shape
    q = b.tensors["in_q"].float().reshape(B, Hq, 1, D)
    k = ref["k_cache"].float().repeat_interleave(Hq // Hkv, dim=1)
    v = ref["v_cache"].float().repeat_interleave(Hq // Hkv, dim=1)
    s = q @ k.transpose(2, 3) * D ** -0.5
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s + b.tensors["mask"].float().reshape(B, 1, 1, L)
    return (torch.softmax(s, -1) @ v).reshape(B, Hq * D)


def _block_loops(source):
    """The streamed attention's block loops: the ``nl.dynamic_range`` loops (of the parsed source) around its V loads,
    in source order."""
    by_line = {lp.line: lp for lp in loops(source)}
    around = {i for ln in parse_source(source)[0] if ln.name.endswith(".vload") for i in ln.loops}
    return [by_line[i] for i in sorted(around) if by_line[i].hardware]


def _v_blocks(profile, heads, D, dtype):
    """(V-block loads executed, the positions each moved): what the profile's V loads (``.vload``) say about the
    blocks read, ``heads`` kv heads per load."""
    (nbytes,) = {d.max_bytes for d in profile.named_dmas(".vload")}
    return profile.executions(".vload", "dma_copy"), nbytes // (heads * D * dtype.itemsize)


def _early_reads(source, profile):
    """The K reads (``.kload`` / ``.kT_dma``) of the early piece (attention.PREFETCH) that ran: issued at the layer's
    start, outside every loop (the attention's own reads are inside its loop over the sequences)."""
    early = {(ln.line, ln.name) for ln in parse_source(source)[0]
             if ln.name.endswith((".kload", ".kT_dma")) and not ln.loops}
    return sorted(n for s in profile.sites for n in s.names if (s.line, n) in early and s.count)


def _run_before_first_kv_write(profile):
    """The names of the instructions that ran before the layer's first KV write, in order (the profile's records)."""
    names = [r.name for r in profile.records]
    assert profile.records_dropped == 0
    return names[:names.index("L0.kv_write.kv_write")]


def _check(b, gen, res, ref, Hq, Hkv, D, dtype, softcap=0.0):
    assert check_source(gen.source) == []
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(res["out_o"].float(), ref["o"].float(), **tol)
    # the probabilities are rounded before normalization in bf16 (docs/serving.md): vs the fp32 formula
    ftol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=6e-2, rtol=6e-2)
    torch.testing.assert_close(res["out_o"].float(), _formula(b, ref, Hq, Hkv, D, softcap), **ftol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lnc", [1, 2])
def test_streamed_attention_in_blocks_equals_reference(dtype, lnc):
    """4 kv heads (split between the cores under LNC=2), 1024 positions in blocks of 256; sequence 0 at position 5
    reads one block, sequence 1 at 700 three, sequence 2 at the last position all four."""
    L, Hq, Hkv, D = 1024, 8, 4, 64
    pos = [5, 700, L - 1]
    b = _program(dtype, pos, L, Hq, Hkv, D, block=256)
    gen, res, ref, kern = b.run(lnc=lnc)
    prof = nkisim.last_profile()
    # each core reads V of its kv heads in blocks of 256 positions, only the blocks up to each sequence's position
    # (1, 3 and 4), in a hardware loop stepping one block; no combine of two cores' states (no block split)
    assert _v_blocks(prof, Hkv // lnc, D, dtype) == (lnc * sum(p // 256 + 1 for p in pos), 256)
    assert [lp.step for lp in _block_loops(gen.source)] == [256]
    assert prof.executions(".max_both") == 0 and prof.executions(".acc_both") == 0
    _check(b, gen, res, ref, Hq, Hkv, D, dtype)
    assert torch.equal(kern["k_cache"], ref["k_cache"]) and torch.equal(kern["v_cache"], ref["v_cache"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_streamed_attention_odd_kv_heads_splits_blocks_under_lnc2(dtype):
    """3 kv heads do not split between two cores: each core reads every other block, the running (max, sum,
    output) states are combined with one sendrecv. LNC=2 equals LNC=1 and the reference."""
    L, Hq, Hkv, D = 1024, 6, 3, 64
    b = _program(dtype, [900, 130], L, Hq, Hkv, D, block=256)
    gen1, res1, ref, _ = b.run()
    gen2, res2, _, _ = b.run(lnc=2)
    prof2 = nkisim.last_profile()
    # each core steps two blocks (every other block: the blocks split between the cores, not the heads), then the
    # two running states are combined: one sendrecv (the only one in the kernel) per sequence on each core
    assert [lp.step for lp in _block_loops(gen2.source)] == [2 * 256]
    assert [ln.opcode for ln in parse_source(gen2.source)[0]].count("sendrecv") == 1
    assert prof2.executions(opcode="sendrecv") == 2 * 2 and prof2.executions(".acc_both") == 2 * 2
    _check(b, gen1, res1, ref, Hq, Hkv, D, dtype)
    _check(b, gen2, res2, ref, Hq, Hkv, D, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_streamed_attention_without_positions_reads_every_block(dtype):
    """No KV write in the kernel (a full sliding window's mask, or a cache written elsewhere): every block is read
    (a static loop); Gemma 2 soft-capping; a sequence whose first block is masked entirely (all -inf) stays finite."""
    L, Hq, Hkv, D, cap = 512, 4, 2, 64, 20.0
    b = _program(dtype, [L - 1, L - 1], L, Hq, Hkv, D, block=128, write=False, softcap=cap)
    b.tensors["mask"][1, :200] = NEG  # sequence 1: positions 0..199 masked (the whole first block)
    gen, res, ref, _ = b.run()
    prof = nkisim.last_profile()
    # a hardware block loop with a static bound (the cache length, not a position register): every block is read
    assert [(lp.step, lp.stop) for lp in _block_loops(gen.source)] == [(128, L)]
    assert prof.executions(opcode="register_load") == 0  # no sequence position loaded into a register
    assert _v_blocks(prof, Hkv, D, dtype) == (2 * L // 128, 128)
    assert torch.isfinite(res["out_o"].float()).all()
    _check(b, gen, res, ref, Hq, Hkv, D, dtype, softcap=cap)


def test_stream_plan_chooses_by_cache_length_and_keeps_sbuf_flat():
    """Caches up to STREAM_ABOVE positions keep the single-pass template; longer ones stream in the block the cost
    model's closed form chose (attention.choose_stream), within the scratch limit, with a per-block scratch that
    stops growing with the cache (the same block at 32k and 128k: the candidates end at BLOCK_MAX)."""
    args = dict(D=128, G=4, split=1, kvb=2, qb=2, mb=2, sb=2)
    assert stream_plan(STREAM_ABOVE, **args) is None
    a, c = stream_plan(32768, **args), stream_plan(131072, **args)
    assert a is not None and a == c and a[1] <= attention.scratch_limit("trn2")
    choice = attention.choose_stream(131072, **args)
    fits = [x for x in choice.candidates if x[5]]
    assert choice.how == "modeled" and (choice.Lb, choice.scratch) == c
    assert choice.seconds == min(x[2] for x in fits)  # the closed form's fastest of those that fit
    assert stream_plan(256, **args, block=128)[0] == 128
    Lb, _ = stream_plan(4100, **args)  # not a multiple of 128: some block, one more short block (issue 15)
    assert Lb % 128 == 0 and 4100 % Lb


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_max", [0, 1024])
def test_streamed_attention_default_block_at_4k(dtype, block_max, switch):
    """A 4096-position cache streams without forcing, one sequence near the end, in the block the modeled choice
    takes (attention.choose_stream; one block of 4096 for one kv head of 64 features: no loop to drain) and, with
    BLOCK_MAX = 1024, in a hardware loop stepping the block chosen among blocks up to 1024."""
    if block_max:
        switch(block_max=block_max)
    L, Hq, Hkv, D = 4096, 2, 1, 64
    b = _program(dtype, [L - 3], L, Hq, Hkv, D)
    gen, res, ref, _ = b.run()
    n, Lb = _v_blocks(nkisim.last_profile(), Hkv, D, dtype)
    choice = attention.choose_stream(L, D, Hq // Hkv, 1, dtype.itemsize, dtype.itemsize, dtype.itemsize,
                                     dtype.itemsize if dtype != torch.float32 else 4, target="trn2",
                                     kv_rows=Hkv * L, exact=dtype != torch.float32)
    # streamed: V read in blocks of the chosen size (every position once); more than one: a loop stepping one block
    assert Lb == choice.Lb and n == L // Lb and f"cache positions streamed in blocks of {Lb}" in gen.source
    assert [lp.step for lp in _block_loops(gen.source)] == ([Lb] if Lb < L else [])
    if block_max:
        assert Lb <= block_max < L
    _check(b, gen, res, ref, Hq, Hkv, D, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_streamed_attention_keeps_the_running_max(dtype):
    """Scores of the first block far above the later blocks' (a gap of ~300): the running max must stay the
    largest seen, or ``exp(m_old - m_block)`` overflows to inf and the output is NaN."""
    L, Hq, Hkv, D = 512, 2, 1, 64
    b = _program(dtype, [L - 1], L, Hq, Hkv, D, block=128, write=False)
    q = torch.zeros(1, Hq * D)
    q[0, 0] = q[0, D] = 40.0
    b.tensors["in_q"].copy_(q.to(dtype))
    k = b.tensors["k_cache"]
    k[:, :, :128, 0] = 30.0  # block 0: scores 150
    k[:, :, 128:, 0] = -30.0  # later blocks: scores -150
    gen, res, ref, _ = b.run()
    assert torch.isfinite(res["out_o"].float()).all()
    _check(b, gen, res, ref, Hq, Hkv, D, dtype)


def _executed(name_suffix, opcode):
    """(executions, largest partition count) of the profiled instructions named ``*<name_suffix>``."""
    from fusegraph import nkisim

    sites = [s for s in nkisim.last_profile().to_dict()["sites"]
             if s["opcode"] == opcode and any(n.endswith(name_suffix) for n in s.get("names") or ())]
    return sum(s["count"] for s in sites), max((s["max_partitions"] for s in sites), default=0)


@pytest.mark.parametrize("lnc", [1, 2])
def test_streamed_softmax_runs_once_per_block_for_all_kv_heads(lnc, switch):
    """The kv heads of a core share one [heads x G, Lb] score tile: each block's exp (and every other softmax
    instruction) runs once over heads x G partitions, not once per kv head, and one K and one V DMA load all the
    heads' block. 2 sequences x 4 blocks of 256; 4 kv heads x G = 2 (LNC=2: 2 heads per core); the most row groups
    (ROW_GROUPS = 4, not the modeled choice)."""
    switch(row_groups=4)
    L, Hq, Hkv, D = 1024, 8, 4, 64
    b = _program(torch.float32, [L - 1, L - 1], L, Hq, Hkv, D, block=256)
    gen, res, ref, _ = b.run(lnc=lnc)
    heads = Hkv // lnc
    groups = row_groups(heads * 2, 256 // 128, r=0, paged=False, kt_dma=False)
    assert groups == 2  # two row groups of 128 positions per block (ROW_GROUPS; blocks of 2 position tiles)
    n, parts = _executed(".exp", "activation")
    # per core: 2 sequences x 4 blocks, all its heads' rows at once, in each row group
    assert (n, parts) == (2 * 4 * lnc, heads * 2 * groups)
    n_k, _ = _executed(".kload", "dma_copy")
    assert n_k == 2 * 4 * lnc
    _check(b, gen, res, ref, Hq, Hkv, D, torch.float32)


def test_streamed_kv_loads_read_whole_runs_of_positions_per_partition():
    """Each partition of a K/V block tile holds nb = Lb / 128 *consecutive* positions (p * nb ... p * nb + nb - 1),
    so one DMA descriptor moves nb x D contiguous elements of a head instead of one D-element row: the cost model's
    DMA efficiency s / (s + s0) is charged on that run. The order is undone on chip (K^T columns copied back into
    position order, P^T tiles taken with a stride of nb) and the result equals the reference."""
    from fusegraph import nkisim

    L, Hq, Hkv, D, Lb = 1024, 4, 2, 64, 512
    b = _program(torch.float32, [L - 1], L, Hq, Hkv, D, block=Lb)
    gen, res, ref, _ = b.run()
    loads = [d for d in nkisim.last_profile().to_dict()["dmas"] if d["dst_tensor"].endswith((".k", ".v"))]
    assert loads and all(d["bytes"] / d["descriptors"] == (Lb // 128) * D * 4 for d in loads)
    _check(b, gen, res, ref, Hq, Hkv, D, torch.float32)


def test_streamed_heads_beyond_128_rows_run_in_groups():
    """8 kv heads x G = 32 would be 256 score rows: the heads run in 2 groups of 4 ([128, Lb] tiles, the 128
    partitions), each group's output written to its own query heads."""
    L, Hq, Hkv, D = 256, 256, 8, 32
    b = _program(torch.float32, [L - 1, 100], L, Hq, Hkv, D, block=128)
    gen, res, ref, _ = b.run()
    prof = nkisim.last_profile()
    # 4 kv heads x G = 32 rows per [128, 128] score tile: each block's exp runs once per group (2 groups x 3 blocks:
    # sequence 0 reads 2, sequence 1 one), each group's output normalized once per sequence
    (exp,) = {(s.max_partitions, s.max_free) for s in prof.named(".exp", "activation")}
    assert exp == (128, 128) and prof.executions(".exp", "activation") == 2 * 3
    assert prof.executions(".rsum") == 2 * 2
    # the loops around the normalization: the 2 sequences, then the 2 head groups (a loop, not 2 copies)
    by_line = {lp.line: lp for lp in loops(gen.source)}
    (rsum,) = [ln for ln in parse_source(gen.source)[0] if ln.name.endswith(".rsum")]
    assert [by_line[i].trips for i in rsum.loops] == [2, 2]
    _check(b, gen, res, ref, Hq, Hkv, D, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lnc,Hkv", [(1, 2), (2, 3)])
def test_pipelined_block_loop_is_bit_identical_to_one_block_at_a_time(dtype, lnc, Hkv, monkeypatch, switch):
    """The software-pipelined loop (block k's scores beside block k - 1's softmax and P.V, the running state from
    -max = FLT_MAX) computes exactly what the one-block-at-a-time loop does: same outputs bit for bit, for ragged
    positions (one block, a block boundary, the last position) under a head split and under LNC=2's block split."""

    L, D = 1024, 64
    Hq = 2 * Hkv
    b = _program(dtype, [5, 511, 512, L - 1], L, Hq, Hkv, D, block=128)
    gen, res, ref, _ = b.run(lnc=lnc)
    prof = nkisim.last_profile()
    # pipelined: the pending block's first position is carried in a register (one move per block read) and the last
    # block's softmax runs after the block loop
    assert prof.executions(opcode="register_move") == prof.executions(".vload") > 0
    (loop,) = _block_loops(gen.source)
    assert any(ln.line > loop.end_line for ln in parse_source(gen.source)[0] if ln.name.endswith(".exp"))
    _check(b, gen, res, ref, Hq, Hkv, D, dtype)
    switch(pipeline=False)
    gen0, res0, _, _ = b.run(lnc=lnc)
    assert nkisim.last_profile().executions(opcode="register_move") == 0
    (loop0,) = _block_loops(gen0.source)
    assert all(ln.line < loop0.end_line for ln in parse_source(gen0.source)[0] if ln.name.endswith(".exp"))
    assert torch.equal(res["out_o"], res0["out_o"])




@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pos,L,block,kt", [
    ([5, 700, 1023], 1024, 128, False),  # sequence 0's row in the prefetched block: read again after the write
    ([700, 5, 1023], 1024, 128, False),  # sequence 0's row past it: the early read is used as it is
    ([130, 3999], 4000, 1024, False),  # a short first block (4000 % 1024 = 928, read as 1024), not pipelined
    ([3999, 9], 4000, 1024, True),  # K^T by DMA transpose
])
def test_prefetched_first_block_is_bit_identical(dtype, pos, L, block, kt, monkeypatch, switch):
    """The first block of sequence 0 read before the layer's KV write (attention.PREFETCH) and read again by a
    guarded DMA only when this step's row falls in it: the same outputs bit for bit as reading it after the write,
    whether the row is in it or not. Breaking the guard (never re-reading) leaves the stale row in the tile, which
    this test sees when sequence 0's position is in block 0."""

    if kt and dtype == torch.float32:
        pytest.skip("K^T by DMA moves 2-byte elements")
    switch(kt_by_dma=kt)
    Hq, Hkv, D = 4, 2, 64 if not kt else 128
    b = _program(dtype, pos, L, Hq, Hkv, D, block=block)
    gen, res, ref, kern = b.run()
    prof = nkisim.last_profile()
    # block 0 of sequence 0 read once at the layer's start (one K DMA; by DMA transpose one per kv head), before the
    # KV write ...
    early = ["L0.attention.attention.kT_dma"] * Hkv if kt else ["L0.attention.attention.kload"]
    assert _early_reads(gen.source, prof) == early
    assert [n for n in _run_before_first_kv_write(prof) if n.endswith((".kload", ".kT_dma"))] == early
    # ... and its guarded re-read placed after the KV writes, run only when sequence 0's row is in that block
    again = ".kT_dma_again" if kt else ".kload_again"
    lines = parse_source(gen.source)[0]
    assert max(ln.index for ln in lines if ln.name == "L0.kv_write.kv_write2") < min(
        ln.index for ln in lines if ln.name.endswith(again))
    assert (prof.executions(again) > 0) == (pos[0] < block)
    _check(b, gen, res, ref, Hq, Hkv, D, dtype)
    switch(prefetch=False)
    gen0, res0, _, _ = b.run()
    assert _early_reads(gen0.source, nkisim.last_profile()) == []
    assert not [n for n in _run_before_first_kv_write(nkisim.last_profile()) if n.endswith((".kload", ".kT_dma"))]
    assert not any(ln.name.endswith(again) for ln in parse_source(gen0.source)[0])
    assert torch.equal(res["out_o"], res0["out_o"])


def test_prefetch_applies_only_to_position_bounded_head_split_blocks():
    """No early read without the KV write's positions (every block is read after the write anyway: a full sliding
    window), under a block split (odd kv heads on LNC=2), or for the single-pass template."""
    def early(b, **run):
        gen = b.run(**run)[0]
        return _early_reads(gen.source, nkisim.last_profile())

    assert early(_program(torch.float32, [1023], 1024, 4, 2, block=256, write=False)) == []
    assert early(_program(torch.float32, [900, 130], 1024, 6, 3, block=256), lnc=2) == []
    assert early(_program(torch.float32, [900, 130], 1024, 4, 2)) == []  # 1024 <= STREAM_ABOVE
    assert early(_program(torch.float32, [900, 130], 1024, 8, 4, block=256), lnc=2) == ["L0.attention.attention.kload"]


def test_prefetched_tiles_count_in_the_budget_of_the_instructions_they_cross(monkeypatch, switch):
    """The early read's tiles live from the layer's start to the attention: generate adds them to the scratch of
    the instructions in between (here the KV writes) in the SBUF budget, not only to the attention's."""
    from fusegraph.codegen.megakernel import generate

    prog = _program(torch.float32, [5, 700], 1024, 4, 2, block=256).program()
    base = generate(prog).budget.items["instruction scratch (at the peak)"]
    monkeypatch.setattr(attention, "_prefetch_bytes", lambda *a: 10 * base)
    # the peak is now a KV write's scratch plus the early tiles, above the attention's own
    assert generate(prog).budget.items["instruction scratch (at the peak)"] >= 10 * base
    switch(prefetch=False)
    assert generate(prog).budget.items["instruction scratch (at the peak)"] == base


def test_row_groups_choice(switch):
    """Row groups the template can run (attention.valid_row_groups; the most of them: row_groups): as many as fit
    128 rows and divide the block's position tiles, with each group's partitions starting at 0/32/64/96; one for a
    short first block, paged gathers and K^T by DMA. ROW_GROUPS = N keeps the most up to N."""
    assert attention.valid_row_groups(8, 8, r=0, paged=False, kt_dma=False) == [1, 2, 4]
    assert attention.valid_row_groups(64, 8, r=0, paged=False, kt_dma=False) == [1, 2]
    assert attention.valid_row_groups(8, 2, r=0, paged=False, kt_dma=False) == [1, 2]
    assert row_groups(8, 8, r=0, paged=False, kt_dma=False) == 4  # a TP rank's one kv head: 8 rows -> 32
    assert row_groups(32, 8, r=0, paged=False, kt_dma=False) == 4  # 4 kv heads x 8 -> 128 rows
    assert row_groups(64, 8, r=0, paged=False, kt_dma=False) == 2
    assert row_groups(128, 8, r=0, paged=False, kt_dma=False) == 1
    assert row_groups(8, 2, r=0, paged=False, kt_dma=False) == 2  # blocks of 2 position tiles
    assert row_groups(8, 1, r=0, paged=False, kt_dma=False) == 1
    assert row_groups(8, 8, r=52, paged=False, kt_dma=False) == 1
    assert row_groups(8, 8, r=0, paged=True, kt_dma=False) == 1
    assert row_groups(8, 8, r=0, paged=False, kt_dma=True) == 1
    switch(row_groups=2)
    assert attention.valid_row_groups(8, 8, r=0, paged=False, kt_dma=False) == [2]


def _assert_row_groups(profile, groups, rows, width, seqs, lnc):
    """The softmax ran on [groups x rows, width] score tiles and (several groups) the groups' states were folded
    into one once per sequence on each core; one group: no fold."""
    (tile,) = {(s.max_partitions, s.max_free) for s in profile.named(".exp", "activation")}
    assert tile == (groups * rows, width)
    assert profile.executions(".groups_fold", "nc_matmul") == (lnc * seqs if groups > 1 else 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lnc,pipe", [(1, True), (1, False), (2, True)])
def test_row_groups_fill_the_partitions_of_a_one_kv_head_core(dtype, lnc, pipe, monkeypatch, switch):
    """One kv head with 8 query heads (a TP rank of Qwen3-30B-A3B): 8 score rows, so each block's positions are
    split into 4 row groups of 256 ([32, 256] score tiles, one running state per group, folded at the end). Ragged
    positions: a sequence inside the first group of block 0 (the other groups see only masked positions and must
    add nothing), one at a group boundary, one at the end; LNC=2 splits the blocks (one kv head). Within the
    streamed template's tolerance of the reference and of the single-group template."""

    switch(pipeline=pipe, row_groups=4)  # 4 groups whatever the modeled choice for these shapes
    L, Hq, Hkv, D = 4096, 8, 1, 64
    b = _program(dtype, [5, 1279, L - 1], L, Hq, Hkv, D, block=1024)
    gen, res, ref, _ = b.run(lnc=lnc)
    _assert_row_groups(nkisim.last_profile(), 4, 8, 256, seqs=3, lnc=lnc)
    _check(b, gen, res, ref, Hq, Hkv, D, dtype)
    switch(row_groups=1)
    gen1, res1, _, _ = b.run(lnc=lnc)
    _assert_row_groups(nkisim.last_profile(), 1, 8, 1024, seqs=3, lnc=lnc)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(res["out_o"].float(), res1["out_o"].float(), **tol)


@pytest.mark.parametrize("lnc", [1, 2])
def test_row_groups_with_heads_of_256_and_soft_capping(lnc, switch):
    """Row groups with heads of 256 features (two partition tiles per head: q.k^T accumulates over them, the fold
    moves 257 columns) and Gemma 2's soft-capping, bf16, one kv head (LNC=2: the block split)."""
    switch(row_groups=4)
    L, Hq, Hkv, D = 4096, 8, 1, 256
    b = _program(torch.bfloat16, [5, 2000, L - 1], L, Hq, Hkv, D, block=1024, softcap=30.0)
    gen, res, ref, _ = b.run(lnc=lnc)
    _assert_row_groups(nkisim.last_profile(), 4, 8, 256, seqs=3, lnc=lnc)
    _check(b, gen, res, ref, Hq, Hkv, D, torch.bfloat16, softcap=30.0)
