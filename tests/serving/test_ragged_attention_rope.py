"""RoPE for batches: 32 query heads x 17 sequences (each at its own position) are 544 head x token columns,
more than one PSUM bank (512 fp32), so ``rope.j2`` rotates them in column blocks of at most 512; against the
reference VM and HF's rotate_half formula."""
import pytest
import torch

from fusegraph.codegen import ir
from fusegraph.codegen.testing import Builder, V
from fusegraph.nkiapi.conformance import check_source


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H", [(17, 32), (5, 4)])
def test_rope_over_more_than_one_psum_bank(dtype, T, H):
    torch.manual_seed(7)
    D = 64
    b = Builder(T)
    x = torch.randn(T, H * D, dtype=dtype)
    q = b.act("q", x)
    pos = torch.arange(T, dtype=torch.float32).reshape(T, 1) * 37 + 3  # ragged: every sequence elsewhere
    freqs = pos * (1.0 / 10000 ** (torch.arange(0, D, 2) / D))
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qr = b.new("qr", H * D, dtype)
    b.ins.append(ir.Rope(x=q, cos=b.hbm("cos", cos, V.INPUT), sin=b.hbm("sin", sin, V.INPUT), out=qr, head_dim=D,
                         layer=0))
    b.store(qr)
    gen, res, ref, _ = b.run()
    assert check_source(gen.source) == []
    blocks = gen.source.count("exceed one PSUM bank: the rotation in column blocks")
    assert blocks == (1 if H * T > 512 else 0)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(res["out_qr"].float(), ref["qr"].float(), **tol)
    xh = x.float().reshape(T, H, D)
    rot = torch.cat((-xh[..., D // 2:], xh[..., :D // 2]), -1)
    hf = (xh * cos.float()[:, None] + rot * sin.float()[:, None]).reshape(T, H * D)
    torch.testing.assert_close(res["out_qr"].float(), hf, **tol)
