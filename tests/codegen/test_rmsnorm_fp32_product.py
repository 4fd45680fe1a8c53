"""RMSNorm with the weight product in fp32 before the one rounding (OLMo-2's ``(weight * h).to(dtype)``,
keras-hub's ``LlamaLayerNorm``): the ``fp32_weight`` variants of ``fusegraph.rmsnorm`` lower with
``fp32_product``, and the kernel rounds once, where HF Llama's form rounds before the product too."""
import pytest
import torch

from fusegraph.codegen import ir
from fusegraph.nkiapi.conformance import check_source

from .harness import Builder


def _fp32_product(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (w.float() * h).to(x.dtype)


def _llama(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("T", [1, 3])
def test_bf16_rmsnorm_with_fp32_weight_product_rounds_once(T):
    torch.manual_seed(5)
    b = Builder(T)
    xt = torch.randn(T, 384).to(torch.bfloat16)
    wt = (1 + 0.5 * torch.randn(384)).to(torch.bfloat16)
    y = b.new("y", 384, torch.bfloat16)
    b.ins.append(ir.RMSNorm(x=b.act("x", xt), weight=b.hbm("w_norm", wt), out=y, eps=1e-6, group=384, layer=0,
                            fp32_product=True))
    b.store(y)
    gen, res, ref, _ = b.run()
    assert check_source(gen.source) == []
    got, exact, llama = res["out_y"], _fp32_product(xt, wt, 1e-6), _llama(xt, wt, 1e-6)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(ref["y"], exact, atol=0, rtol=0)  # the instruction's reference is that math
    # the kernel's rsqrt may differ from torch's in the last fp32 bit: at most a rare bf16 tie flips
    assert (got != exact).sum() <= 2
    assert (llama != exact).sum() > 10  # the two roundings really differ on these inputs


def test_olmo2_bf16_norms_match_the_fp32_weight_variant():
    """HF OLMo-2 (``Olmo2RMSNorm``: ``(self.weight * hidden_states).to(input_dtype)``, the fp32 product by
    type promotion) is the real HF model behind the variant: all four norms of a layer (q/k-norm over all heads,
    post-attention, post-feed-forward) match it in bf16, none the Llama form."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "matching"))
    from fg_cases import analyzed_family

    _, _, a = analyzed_family("Olmo2", dtype="bfloat16")
    norms = [m for m in a.matches_of("fusegraph.rmsnorm") if m.layer == 0]
    assert len(norms) == 4 and {m.variant.split("/")[0] for m in norms} == {"fp32_weight"}
