"""Paged KV caches (vLLM layout): ``PagedKVWrite`` and ``PagedAttention`` (block-table gathers by indirect DMA,
streamed online softmax) against the reference VM and the formula, and the plain-PyTorch paged decode step of
``paged_step.py`` fused into one kernel equal to its eager run. vLLM itself does not install without a GPU, so
its paged-attention ops are not the reference here; the eager step is."""
import os
import sys

import pytest
import torch

from fusegraph import FusegraphWarning, nkisim
from fusegraph.capture.session import last_session
from fusegraph.codegen.errors import CodegenError
from fusegraph.patterns.paged_attention.lowering import PagedAttention, PagedKVWrite, block_segments, mask_extent
from fusegraph.codegen.testing import Builder, V
from fusegraph.nkiapi.conformance import check_source
from fusegraph.perf.kernelview import parse_source, region_of

sys.path.insert(0, os.path.dirname(__file__))
from paged_step import PagedDecoder, PagedServer  # noqa: E402
from test_stream_models import SLOW, eager_ops  # noqa: E402

NEG = torch.finfo(torch.float32).min


def _program(dtype, lens, BS, MB, NB, Hq=4, Hkv=2, D=64, block=0, seed=3, extent=False):
    """Each sequence writes its new row at position lens[b] (slot from its table), then attends over lens[b] + 1
    positions of its blocks (``extent``: bounded by each sequence's last unmasked position, test_paged_extent)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    b = Builder(B)
    table = torch.randperm(NB, generator=g)[:B * MB].reshape(B, MB).to(torch.int32)
    pos = torch.tensor(lens)
    slots = (table.long().gather(1, (pos // BS)[:, None])[:, 0] * BS + pos % BS).to(torch.int32)
    kc = b.hbm("k_pool", torch.randn(NB, BS, Hkv, D, generator=g).to(dtype), V.STATE)
    vc = b.hbm("v_pool", torch.randn(NB, BS, Hkv, D, generator=g).to(dtype), V.STATE)
    sl = b.hbm("slots", slots, V.INPUT)
    b.ins.append(PagedKVWrite(cache=kc, value=b.act("k", torch.randn(B, Hkv * D, generator=g).to(dtype)), slots=sl,
                              layer=0))
    b.ins.append(PagedKVWrite(cache=vc, value=b.act("v", torch.randn(B, Hkv * D, generator=g).to(dtype)), slots=sl,
                              layer=0))
    mask = torch.zeros(B, MB * BS)
    for i, p in enumerate(lens):
        mask[i, p + 1:] = NEG
    mask = mask.to(dtype)
    ext = b.hbm("extent", mask_extent(mask), V.INPUT) if extent else None
    o = b.new("o", Hq * D, dtype)
    b.ins.append(PagedAttention(q=b.act("q", (2 * torch.randn(B, Hq * D, generator=g)).to(dtype)), k_cache=kc,
                                v_cache=vc, mask=b.hbm("mask", mask, V.INPUT), out=o, scale=D ** -0.5,
                                groups=Hq // Hkv, table=b.hbm("table", table, V.INPUT), extent=ext, block=block,
                                layer=0))
    b.store(o)
    return b, table, slots


def _formula(b, ref, table, Hq, Hkv, D):
    k, v = ref["k_pool"].float(), ref["v_pool"].float()
    B, MB = table.shape
    BS = k.shape[1]
    K = k[table.long()].reshape(B, MB * BS, Hkv, D).transpose(1, 2).repeat_interleave(Hq // Hkv, 1)
    Vv = v[table.long()].reshape(B, MB * BS, Hkv, D).transpose(1, 2).repeat_interleave(Hq // Hkv, 1)
    q = b.tensors["in_q"].float().reshape(B, Hq, 1, D)
    s = q @ K.transpose(2, 3) * D ** -0.5 + b.tensors["mask"].float().reshape(B, 1, 1, -1)
    return (torch.softmax(s, -1) @ Vv).reshape(B, Hq * D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("BS,MB,block,lnc", [(16, 16, 128, 1), (16, 16, 128, 2), (32, 8, 0, 1), (256, 2, 256, 1)])
def test_paged_write_and_attention_equal_reference(dtype, BS, MB, block, lnc):
    """Block sizes dividing 128 (several gathers per position tile) and a multiple of it (one gather per tile);
    two streamed blocks where ``block`` forces it; LNC=2 splits the kv heads. Sequences end inside a block, on a
    block's last row, and in the last block of their table."""
    Hq, Hkv, D, L = 4, 2, 64, BS * MB
    b, table, slots = _program(dtype, [5, BS - 1, L - 2], BS, MB, NB=3 * MB + 5, Hq=Hq, Hkv=Hkv, D=D, block=block)
    gen, res, ref, kern = b.run(lnc=lnc)
    assert check_source(gen.source) == []
    # one K gather (call) per run of a cache block in a position tile, each run for every sequence (no extent: every
    # block of the table) on each core
    gathers = L // min(BS, 128)
    assert sum(1 for ln in parse_source(gen.source)[0] if ln.name.endswith(".kgather")) == gathers
    assert nkisim.last_profile().executions(".kgather", "dma_copy") == lnc * 3 * gathers
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(res["out_o"].float(), ref["o"].float(), **tol)
    ftol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=6e-2, rtol=6e-2)
    torch.testing.assert_close(res["out_o"].float(), _formula(b, ref, table, Hq, Hkv, D), **ftol)
    for pool in ("k_pool", "v_pool"):
        assert torch.equal(kern[pool], ref[pool])  # the rows landed at their slots, nothing else moved
        assert not torch.equal(kern[pool], b.tensors[pool])


def test_block_segments_cover_each_position_once():
    for BS, Lb, n in [(16, 256, 2), (48, 384, 1), (256, 512, 2), (128, 128, 3)]:
        seen = []
        for jb, segs in enumerate(block_segments(Lb, n, BS)):
            for u, p0, rows, e, r0 in segs:
                assert r0 + rows <= BS and p0 + rows <= 128
                seen += [e * BS + r0 + r for r in range(rows)]
                assert [jb * Lb + u * 128 + p0 + r for r in range(rows)] == seen[-rows:]
        assert seen == list(range(n * Lb))


def test_paged_attention_refuses_what_it_cannot_split():
    b, _, _ = _program(torch.float32, [3], 16, 8, NB=12, Hq=3, Hkv=3)
    with pytest.raises(CodegenError, match="does not split between the LNC=2 cores"):
        b.run(lnc=2)


def _serve(dtype, lens, steps=3, block_size=16, max_blocks=8):
    torch.manual_seed(0)
    model = PagedDecoder().to(dtype).eval()
    srv = PagedServer(model, lens, block_size=block_size, max_blocks=max_blocks, dtype=dtype)
    ref = srv.fork()
    step = torch.compile(model, backend="fusegraph", options={"executor": "nkisim", "cache_dir": "off"})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FusegraphWarning)
        got = [srv.step(step) for _ in range(steps)]
    want = [ref.step(model) for _ in range(steps)]
    return srv, ref, got, want


@pytest.mark.parametrize("dtype,lens", [(torch.float32, [15, 40, 120]),
                                        pytest.param(torch.bfloat16, [0, 17, 63, 64, 90, 100, 110, 124],
                                                     marks=SLOW)])
def test_paged_decode_step_fuses_into_one_kernel(dtype, lens):
    """Sequences at different lengths, blocks scattered over the pool; the first sequence crosses from block 0
    into block 1 during the run. Tokens and logits equal eager, the pools too; one launch, nothing eager."""
    srv, ref, got, want = _serve(dtype, lens)
    prof = nkisim.last_profile()  # the last step's kernel
    tol = 1e-4 if dtype == torch.float32 else 2 ** -6
    for a, b in zip(got, want):
        assert torch.equal(a[:, -1].argmax(-1), b[:, -1].argmax(-1))
        assert (a.float() - b.float()).abs().max().item() <= tol * b.float().abs().max().item()
    ctol = 1e-5 if dtype == torch.float32 else 2e-2  # the new rows come from the kernel's projections
    for (k1, v1), (k2, v2) in zip(srv.caches, ref.caches):
        for a, b in ((k1, k2), (v1, v2)):
            assert (a.float() - b.float()).abs().max().item() <= ctol
    session = last_session()
    (record,) = session.program.execution.values()
    assert record.launches_per_call == 1 and list(record.verification.values()) == ["passed"]
    assert not eager_ops(session, record)
    # 2 layers x (K, V): a DMA of each sequence's new row into HBM at its runtime slot; block-table gathers in both
    # layers
    writes = [d for d in prof.dmas if d.dst_buffer.endswith("hbm") and d.indirect == "scalar"]
    assert len(writes) == 4 and all(d.count == len(lens) for d in writes)
    assert {region_of(n)[1] for s in prof.named(".kgather", "dma_copy") for n in s.names} == {0, 1}
