"""Projections over a batch: tokens are the moving free axis (up to 512 per PSUM bank), and a projection whose
output is only stored (the logits) writes each weight chunk's outputs to HBM as soon as they are evicted, so the
whole [vocab, T] tile never lies in SBUF (at batch 64 that tile alone is 125-148 KiB per partition for Llama-3-8B
and Qwen3). Checked against the reference VM and against the same kernel built whole."""
import pytest
import torch

from fusegraph import nkisim
from fusegraph.codegen import ir
from fusegraph.codegen.testing import Builder

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _head(T, dtype, H=256, N=1024):
    torch.manual_seed(2)
    b = Builder(T)
    x = b.act("x", torch.randn(T, H, dtype=dtype))
    h = b.new("h", H, dtype)
    b.ins.append(ir.RMSNorm(x=x, weight=b.hbm("w_norm", (1 + 0.1 * torch.randn(H)).to(dtype)), out=h, eps=1e-6,
                            group=H, layer=None))
    y = b.new("logits", N, dtype)
    b.ins.append(ir.Linear(x=h, weight=b.hbm("w_head", (torch.randn(N, H) / 16).to(dtype)), out=y))
    b.store(y)
    return b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,lnc", [(8, 1), (8, 2), (64, 1)])
def test_stored_projection_streams_its_output_chunks(dtype, T, lnc):
    # 64-byte chunks: one output chunk (128 features, 1 KiB of weights) per weight chunk, and an output tile
    # larger than a chunk: 8 chunks, each stored as soon as it is evicted
    gen, res, ref, _ = _head(T, dtype).run(chunk_bytes=64, lnc=lnc)
    streamed = nkisim.last_profile()
    assert gen.source.count("straight to HBM out_logits") == (8 // lnc)
    assert 'name="top.store.store"' not in gen.source  # the Store instruction emitted nothing
    torch.testing.assert_close(res["out_logits"].float(), ref["logits"].float(), **TOL[dtype])
    assert streamed.hbm_by_tensor["out_logits"].write_bytes == T * 1024 * dtype.itemsize

    # the same kernel with chunks large enough for the whole output tile: one store, same values
    whole_gen, whole, _, _ = _head(T, dtype).run(chunk_bytes=64 * 1024, lnc=lnc)
    assert "straight to HBM" not in whole_gen.source
    # other chunk sizes are matmuls of other widths (a BLAS may round them differently): to rounding
    torch.testing.assert_close(whole["out_logits"].float(), res["out_logits"].float(), **TOL[dtype])
    # the planned budget does not count the streamed output (8 chunks x T tokens per partition) as live
    assert gen.budget.items["activations (live at the peak)"] < 8 * T * dtype.itemsize


def test_tokens_fill_one_psum_bank_per_output_chunk_up_to_512():
    """512 tokens (a PSUM bank of fp32) as the moving axis of one projection; past it the projection refuses."""
    from fusegraph.codegen.errors import CodegenError

    def build(T):
        torch.manual_seed(5)
        b = Builder(T)
        x = b.act("x", torch.randn(T, 256))
        y = b.new("y", 256, torch.float32)
        b.ins.append(ir.Linear(x=x, weight=b.hbm("w", torch.randn(256, 256) / 16), out=y, layer=0))
        b.store(y)
        return b

    gen, res, ref, _ = build(512).run()
    assert "moving=x_x[:, kt, :]" in gen.source
    torch.testing.assert_close(res["out_y"], ref["y"], **TOL[torch.float32])
    with pytest.raises(CodegenError, match="PSUM bank"):
        build(513).run()


def test_budget_counts_activations_live_at_once_not_a_whole_layer():
    """A chain x -> a -> b -> c of projections in one layer: at most two of its values are live at any
    instruction (the compiler frees a tile after its last use), so the planned activations are two values, not
    the layer's four (the rule that asked 371 KiB of trn2's 208 for Llama-3-8B at batch 64)."""
    from fusegraph.codegen.plan import live_activation_peak

    T, H = 64, 256
    torch.manual_seed(6)
    b = Builder(T)
    v = b.act("x", torch.randn(T, H))
    for name in "abc":
        out = b.new(name, H, torch.float32)
        b.ins.append(ir.Linear(x=v, weight=b.hbm(f"w_{name}", torch.randn(H, H) / 16), out=out, layer=0))
        v = out
    b.store(v)
    gen, res, ref, _ = b.run()
    one = 2 * T * 4  # [128, 2, T] fp32 per partition
    assert gen.budget.items["activations (live at the peak)"] <= 2 * one
    assert nkisim.last_profile().peak_sbuf_bytes_per_partition <= gen.budget.sbuf_peak
    acts = {n: one for n in "xabc"}
    assert live_activation_peak(gen.program, acts, {})[:2] == (2 * one, 0)
    assert live_activation_peak(gen.program, acts, {2: 5})[1:] == (5, 2)  # the peak instruction's own scratch
