"""GPT-OSS attention sinks (``fusegraph.decode_attention_sinks``): one learned logit per query head joins each
row's softmax and its probability is dropped. The ``Attention`` instruction's ``sinks`` in both templates -- the
single pass (the sink in the row's max and sum) and the streamed one (added once to the running sum, relative to
the running max, before the row groups' fold) -- against the pattern function itself (HF's GPT-OSS eager form) and
the reference VM: fp32 and bf16, one block and several, row groups, and LNC=2 with an odd number of kv heads (the
two cores' states combined first). And the pattern on HF's GPT-OSS: every layer's attention matches it."""
import contextlib
import dataclasses
import os
import sys

import pytest
import torch

from fusegraph.nkiapi.conformance import check_source
from fusegraph.patterns.attention import lowering as attention
from fusegraph.patterns.attention.decode_attention import decode_attention, decode_attention_sinks

sys.path.insert(0, os.path.dirname(__file__))
from test_stream_attention import _program as stream_program  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def switch():
    with contextlib.ExitStack() as stack:
        yield lambda **kw: stack.enter_context(attention.use_switches(dataclasses.replace(attention.switches(), **kw)))


def _program(dtype, pos, L, Hq, Hkv, D=64, block=0):
    """KV writes at ``pos`` + attention with sinks over the written cache, masked after each position
    (test_stream_attention's program). Sinks around the largest scores (mean 6, spread 2: GPT-OSS's trained sinks are
    of their order), so they change the outputs."""
    sinks = 6 + 2 * torch.randn(Hq, generator=torch.Generator().manual_seed(Hq * L))
    return stream_program(dtype, pos, L, Hq, Hkv, D, block=block, sinks=sinks)


def _eager(b, ref, Hq, D, sinks=True):
    """The pattern function (HF GPT-OSS's eager attention) on the cache the kernel wrote."""
    B, _, L, _ = ref["k_cache"].shape
    q = b.tensors["in_q"].reshape(B, Hq, 1, D)
    mask = b.tensors["mask"].reshape(B, 1, 1, L)
    if not sinks:
        out = decode_attention(q, ref["k_cache"], ref["v_cache"], mask, scale=D ** -0.5)
    else:
        out = decode_attention_sinks(q, ref["k_cache"], ref["v_cache"], mask, b.tensors["sinks"], scale=D ** -0.5)
    return out.reshape(B, Hq * D)


def _check(b, gen, res, ref, Hq, D, dtype):
    assert check_source(gen.source) == []
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    want = _eager(b, ref, Hq, D)
    torch.testing.assert_close(res["out_o"].float(), want.float(), **tol)
    torch.testing.assert_close(ref["o"].float(), want.float(), **tol)
    # the sinks matter: without them every output is different (a kernel that dropped them fails above)
    assert (_eager(b, ref, Hq, D, sinks=False).float() - want.float()).abs().max() > 0.05


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_single_pass(dtype):
    """200 positions (the single-pass template): 8 query heads over 2 kv heads, sequences at 5 and 199."""
    L, Hq, Hkv, D = 200, 8, 2, 64
    b = _program(dtype, [5, L - 1], L, Hq, Hkv, D)
    gen, res, ref, _ = b.run()
    assert "attention_stream" not in gen.source and ".sink_max" in gen.source
    _check(b, gen, res, ref, Hq, D, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_streamed_in_blocks(dtype):
    """512 positions in blocks of 128 (the streamed template), sequences reading 1 and 4 blocks."""
    L, Hq, Hkv, D = 512, 4, 1, 64
    b = _program(dtype, [100, L - 1], L, Hq, Hkv, D, block=128)
    gen, res, ref, _ = b.run()
    assert ".sink_sum" in gen.source
    _check(b, gen, res, ref, Hq, D, dtype)


def test_sinks_streamed_with_row_groups(switch):
    """Row groups (each block's positions split over 2 groups of rows, folded at the end): the sink is added to
    group 0's sum only, before the fold weighs it."""
    switch(row_groups=4)
    L, Hq, Hkv, D = 1024, 8, 4, 64
    b = _program(torch.float32, [L - 1, 300], L, Hq, Hkv, D, block=256)
    gen, res, ref, _ = b.run()
    assert ".groups_fold" in gen.source
    _check(b, gen, res, ref, Hq, D, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_lnc2_odd_kv_heads(dtype):
    """3 kv heads under LNC=2: the blocks split between the cores, the two states combined, then the sink."""
    L, Hq, Hkv, D = 1024, 6, 3, 64
    b = _program(dtype, [900, 130], L, Hq, Hkv, D, block=256)
    gen, res, ref, _ = b.run(lnc=2)
    assert ".acc_both" in gen.source
    _check(b, gen, res, ref, Hq, D, dtype)


def test_gpt_oss_attention_matches_the_sinks_pattern():
    """HF's GPT-OSS (tiny, random weights): every layer's attention is one ``decode_attention_sinks`` match."""
    import fusegraph
    from fusegraph.models.families import build_case

    case = build_case("GptOss")
    report = fusegraph.explain(case.step, case.token, case.position)
    layers = case.model.config.num_hidden_layers
    assert report.to_dict()["pattern_counts"].get("fusegraph.decode_attention_sinks") == layers
