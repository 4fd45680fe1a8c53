"""K^T of a streamed attention block by an indirect ``dma_transpose`` (``attention_stream.j2`` with
the ``attn_kt_by_dma`` option), the way nki-library's decode ``attention_tkg`` loads K, instead of Tensor-engine transposes and
PSUM evictions. A transpose is exact, so every output must be bit-identical to the Tensor-engine path (the
previous template, ``attn_kt_by_dma=False``) and within the streamed template's tolerance of the reference; the
structure tests check that no K^T transpose is left on the Tensor engine and where the new path does not apply."""
from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

import fusegraph.patterns.attention.lowering as attention
from fusegraph import FusegraphWarning, nkisim
from fusegraph.capture.session import last_session
from fusegraph.patterns.attention.lowering import kt_by_dma
from fusegraph.nkiapi.conformance import check_source
from fusegraph.perf.kernelview import parse_source

sys.path.insert(0, os.path.dirname(__file__))
from test_stream_attention import _block_loops, _check, _program, switch  # noqa: E402,F401 - switch: the fixture
from test_stream_models import padded_batch  # noqa: E402


def _run_both(switch, make, **run):
    """(builder, kernel, results, reference, profile) with the DMA transpose and with the Tensor-engine transposes."""
    out = []
    switch(row_groups=1)  # K^T by DMA keeps one row group: compare like with like
    for flag in (True, False):
        switch(kt_by_dma=flag)
        b = make()
        gen, res, ref, _ = b.run(**run)
        out.append((b, gen, res, ref, nkisim.last_profile()))
    return out


def _dma_transposes(src: str) -> int:
    """The ``nisa.dma_transpose`` calls of the kernel (parsed: comments and strings do not count)."""
    return sum(1 for ln in parse_source(src)[0] if ln.opcode == "dma_transpose")


def _kt_on_tensor_engine(profile) -> int:
    """K^T transposes the Tensor engine ran (``nc_transpose`` named ``*.kT``) and their PSUM evictions
    (``*.kT_copy``)."""
    return profile.executions(".kT", "nc_transpose") + profile.executions(".kT_copy")


@pytest.mark.parametrize("case", [
    # positions, cache length, query heads, kv heads, head size, block, KV write in the kernel
    ([5, 700, 1023], 1024, 8, 4, 64, 256, True),  # position-bounded loop, blocks of 2 rows per partition
    ([3999, 9], 4000, 8, 2, 128, 1024, True),  # a length that is not a multiple of the block: short first block
    ([1023, 1023], 1024, 4, 2, 64, 128, False),  # no KV write: every block (static loop bound), 1 row per partition
])
def test_kt_by_dma_is_bit_identical_to_tensor_engine_transposes(switch, case):
    pos, L, Hq, Hkv, D, block, write = case
    (b, gen, res, ref, prof), (_, gen0, res0, _, prof0) = _run_both(
        switch, lambda: _program(torch.bfloat16, pos, L, Hq, Hkv, D, block=block, write=write))
    assert torch.equal(res["out_o"], res0["out_o"])
    _check(b, gen, res, ref, Hq, Hkv, D, torch.bfloat16)
    assert check_source(gen.source) == []
    # structure: one DMA transpose per kv head in block 0 (the short one when the block does not divide L) and in
    # the loop's block; with a KV write block 0 is written out three times (sequence 0's early read at the layer's
    # start and its guarded re-read, attention.PREFETCH, and the other sequences' read); none of K^T on the Tensor
    # engine, no PSUM eviction of it
    assert _dma_transposes(gen.source) == (4 if write else 2) * Hkv and prof.executions(opcode="dma_transpose") > 0
    assert _kt_on_tensor_engine(prof) == 0
    assert _kt_on_tensor_engine(prof0) > 0 and _dma_transposes(gen0.source) == 0
    assert prof0.executions(opcode="dma_transpose") == 0


def test_kt_by_dma_under_lnc2_head_split(switch):
    """LNC=2 with an even number of kv heads (each core its heads): the same bits as the Tensor-engine path."""
    (b, gen, res, ref, prof), (_, _, res0, _, _) = _run_both(
        switch, lambda: _program(torch.bfloat16, [5, 700, 1023], 1024, 8, 4, 64, block=256), lnc=2)
    assert prof.executions(opcode="dma_transpose") > 0 and _kt_on_tensor_engine(prof) == 0
    assert torch.equal(res["out_o"], res0["out_o"])
    _check(b, gen, res, ref, 8, 4, 64, torch.bfloat16)


def test_kt_by_dma_applies_only_where_its_constraints_hold(switch):
    """fp32 caches (an indirect DMA transpose moves 2-byte elements), heads of more than 128 features, a block
    split (odd kv heads under LNC=2) and paged gathers keep the Tensor-engine transposes; so do rows of positions
    that do not divide a 512-column score chunk."""
    base = dict(Lb=1024, Lr=0, D=128, split=1, kvb=2, rows=2 * 131072, paged=False, pos_split=False)
    assert not attention.switches().kt_by_dma  # off by default (docs/serving.md: O6's transpose throughput)
    switch(kt_by_dma=True)
    assert kt_by_dma(**base)
    assert not kt_by_dma(**{**base, "kvb": 4})
    assert not kt_by_dma(**{**base, "D": 256, "split": 2})
    assert not kt_by_dma(**{**base, "pos_split": True})
    assert not kt_by_dma(**{**base, "paged": True})
    assert not kt_by_dma(**{**base, "Lb": 384})  # 3 positions per partition row: 512 is not whole rows
    switch(kt_by_dma=False)
    assert not kt_by_dma(**base)
    switch(kt_by_dma=True)
    b = _program(torch.float32, [900, 130], 1024, 6, 3, 64, block=256)
    gen, _, _, _ = b.run(lnc=2)
    prof = nkisim.last_profile()
    assert _dma_transposes(gen.source) == 0 and prof.executions(opcode="dma_transpose") == 0
    assert _kt_on_tensor_engine(prof) > 0


def _decode(flag: bool, eager: bool = False):
    """(tokens, logits, kernel source, its profile) of one compiled bf16 decode step of a tiny Qwen3-MoE at 4096 positions
    (and the eager step's tokens and logits with ``eager``); ``flag``: the attn_kt_by_dma option."""
    torch._dynamo.reset()  # else dynamo reuses the previous compile (same step code, guards pass) and its kernel
    case = padded_batch("Qwen3Moe", 4096, 1, dtype="bfloat16", moe_intermediate_size=128, num_experts=8,
                        num_experts_per_tok=2, decoder_sparse_step=1)
    ref = case.fork() if eager else None
    # attn_row_groups=1: the same row groups on both paths (K^T by DMA has one)
    step = torch.compile(case.step, backend="fusegraph", options={"executor": "nkisim", "cache_dir": "off",
                                                                  "attn_kt_by_dma": flag, "attn_row_groups": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusegraphWarning)
        toks, logits = case.decode(step, 1)
    prof = nkisim.last_profile()  # the step's one kernel (one launch, checked below)
    session = last_session()
    (record,) = session.program.execution.values()
    assert record.launches_per_call == 1 and set(record.executed_by.values()) == {"nkisim"}, record.executed_by
    assert list(record.verification.values()) == ["passed"]  # against eager on the first call
    (plan,) = record.run.plans
    return toks, logits, plan.generated.source, prof, (ref.decode(ref.step, 1) if eager else None)


def test_tiny_bf16_model_at_4096_positions_with_kt_by_dma_equals_eager():
    """A tiny bf16 Qwen3-MoE at 4096 positions (streamed, blocks of 2048): K^T by DMA in both layers, no K^T
    transpose on the Tensor engine; the kernel verifies against eager and gives eager's greedy token."""
    toks, logits, src, prof, (toks_e, logits_e) = _decode(True, eager=True)
    assert [lp.step for lp in _block_loops(src)] == [2048, 2048]  # both layers streamed, blocks of 2048
    # layers x (block 0 early, its guarded re-read, the loop's block) x heads
    assert _dma_transposes(src) == 2 * 3 * 2 and prof.executions(opcode="dma_transpose") > 0
    assert _kt_on_tensor_engine(prof) == 0
    assert all(torch.equal(a, b) for a, b in zip(toks, toks_e))
    for a, b in zip(logits, logits_e):
        assert (a.float() - b.float()).abs().max().item() <= 3e-2 * b.float().abs().max().item()


@pytest.mark.slow
def test_tiny_bf16_model_at_4096_positions_equals_tensor_engine_path():
    """The same model with K^T by DMA and by Tensor-engine transposes: identical tokens and bit-identical logits."""
    toks, logits, src, prof, _ = _decode(True)
    toks0, logits0, src0, prof0, _ = _decode(False)
    assert prof.executions(opcode="dma_transpose") > 0 and _kt_on_tensor_engine(prof) == 0
    assert _kt_on_tensor_engine(prof0) > 0 and prof0.executions(opcode="dma_transpose") == 0
    assert all(torch.equal(a, b) for a, b in zip(toks, toks0))
    assert all(torch.equal(a, b) for a, b in zip(logits, logits0))
