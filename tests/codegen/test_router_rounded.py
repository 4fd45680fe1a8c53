"""The router's ``rounded`` form (moe_router's ``rounded`` variant: keras-hub's Mixtral router under a bf16 policy):
``x - max``, ``exp``, the fp32-accumulated sum, the division, the top-k and the renormalization each rounded to the
logits' dtype. The kernel's routing weights must equal the reference bit for bit; the program here exposes them:
x is one-hot per token (the logits are the router weight's columns, exactly) and expert ``e`` outputs the one-hot
column ``e`` exactly (silu(64) * 2**-6 = 1), so ``y[t, e]`` is token t's routing weight of expert e."""
import pytest
import torch

from fusegraph.codegen import ir
from fusegraph.matching import registered_patterns

from .harness import Builder, V

E, H, I = 8, 128, 64


def _program(logits: torch.Tensor, K: int, normalize: bool, rounding: str) -> Builder:
    T = logits.shape[0]
    dtype = logits.dtype
    b = Builder(T)
    x = torch.zeros(T, H)
    x[torch.arange(T), torch.arange(T)] = 1.0
    xv = b.act("x", x.to(dtype))
    w = torch.zeros(E, H)
    w[:, :T] = logits.float().T
    wts = b.new("rw", K, dtype, V.ROUTING)
    ids = ir.Value("ri", V.ROUTING, (T, K), torch.int32)
    tie = ir.Value("tie", V.ROUTING, (T, 1), torch.float32)
    b.ins.append(ir.Router(x=xv, weight=b.hbm("w_router", w.to(dtype)), weights=wts, indices=ids, top_k=K,
                           normalize=normalize, tie=tie, tie_first=True, rounding=rounding, layer=0))
    gu = torch.zeros(E, 2 * I, H)
    gu[:, 0, :T] = 64.0  # gate: silu(64) == 64 in fp32
    gu[:, I, :T] = 2.0 ** -6  # up
    dn = torch.zeros(E, H, I)
    dn[torch.arange(E), torch.arange(E), 0] = 1.0
    y = b.new("y", H, dtype)
    b.ins.append(ir.Experts(x=xv, weights=wts, indices=ids, gate_up=b.hbm("w_gu", gu.to(dtype)),
                            down=b.hbm("w_dn", dn.to(dtype)), out=y, intermediate=I, layer=0))
    b.store(y)
    flag = ir.Value("out_tie", V.OUTPUT, (T, 1), torch.float32)
    b.ins.append(ir.Guard(x=tie, dst=flag, reason="test"))
    b.outputs.append(flag)
    return b


def _dense(weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return torch.zeros(weights.shape[0], E, dtype=weights.dtype).scatter(1, indices.long(), weights)


def _equal_but_a_flip(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal but for at most 2 of the weights, each one bf16 step (2^-7 relative) off: the interpreter's fp32 exp is
    numpy's, the reference VM's and the pattern's torch's; they may differ by an fp32 ulp, which rounding to bf16
    turns into a one-step flip for about one weight in 2^16. (Observed: equal. The fp32 rounding the rounded
    variant exists for changes 25-67 of the 256 weights, so this still tells the two apart.)"""
    g, w = got.float(), want.float()
    close = bool(((g - w).abs() <= w.abs() * 2 ** -7).all())
    return close and int((got != want).sum()) <= 2


def _keras(logits: torch.Tensor, K: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The pattern variant's own math on the logits (its ``linear`` on one-hot rows is the logits exactly); taken
    from the registry (importing ``patterns`` directly would register the built-ins a second time)."""
    router = next(p for p in registered_patterns() if p.name == "fusegraph.moe_router")
    rounded = next(i.fn for i in router.implementations if i.name == "rounded")
    eye = torch.eye(logits.shape[0], logits.shape[0], dtype=logits.dtype)
    return rounded(eye, logits.T.contiguous(), top_k=K, normalize=normalize)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("K", [2, 4])
def test_rounded_router_weights_equal_the_variant_bit_for_bit(K, normalize):
    """bf16 logits of 32 tokens: the kernel's routing weights (and experts) equal the reference VM's and the
    pattern function's exactly; HF's fp32 rounding would give other weights for some tokens (the test can fail)."""
    torch.manual_seed(5)
    logits = (torch.randn(32, E) * 2).to(torch.bfloat16)
    b = _program(logits, K, normalize, "rounded")
    gen, res, ref, _ = b.run(chunk_bytes=4096)
    assert "nl.divide" not in gen.source and ".shift" in gen.source  # the rounded steps, division by reciprocal
    got = res["out_y"][:, :E].to(torch.bfloat16)
    assert _equal_but_a_flip(got, _dense(ref["rw"], ref["ri"]))
    want_w, want_i = _keras(logits, K, normalize)
    assert _equal_but_a_flip(got, _dense(want_w, want_i))
    assert res["out_tie"].sum() == 0
    fp32 = torch.topk(torch.softmax(logits.float(), -1), K)
    fp32_w = fp32.values / fp32.values.sum(-1, keepdim=True) if normalize else fp32.values
    assert not _equal_but_a_flip(got, _dense(fp32_w.to(torch.bfloat16), fp32.indices))  # observed: 25-67 differ


def test_fp32_rounding_kernel_differs_from_the_rounded_reference():
    """The same program with the router's default (fp32) rounding does not equal the rounded variant: the
    template's ``rounded`` branch is what makes the test above pass."""
    torch.manual_seed(5)
    logits = (torch.randn(32, E) * 2).to(torch.bfloat16)
    _, res, _, _ = _program(logits, 2, True, "fp32").run(chunk_bytes=4096)
    want_w, want_i = _keras(logits, 2, True)
    assert not _equal_but_a_flip(res["out_y"][:, :E].to(torch.bfloat16), _dense(want_w, want_i))


def test_rounded_ties_set_the_guard():
    """Two equal logits straddling the top-2 boundary give equal bf16 probabilities: the tie guard is set, as in
    the fp32 form (tests/codegen/test_router_ties.py)."""
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.5, 2.0, -1.0, 0.0, -2.0]] * 2, dtype=torch.bfloat16)
    _, res, _, _ = _program(logits, 2, True, "rounded").run(chunk_bytes=4096)
    assert res["out_tie"].flatten().tolist() == [1.0, 1.0]


@pytest.mark.parametrize("dtype,bits", [(torch.bfloat16, 7), (torch.float16, 10)])
def test_reciprocal_product_rounds_like_the_division(dtype, bits):
    """The kernel divides by multiplying with the fp32 reciprocal (no divide on the ALU): for every pair of
    mantissas (the exponents only shift the quotient), ``a * (1 / b)`` in fp32 rounds to the same bf16/fp16 value
    as ``a / b`` (PyTorch's and XLA's bf16 division: fp32, one rounding)."""
    m = (torch.arange(2 ** bits, dtype=torch.float32) / 2 ** bits + 1).to(dtype)
    for shift in (-1.0, 0.0, 1.0):
        a, b = torch.meshgrid(m * 2.0 ** shift, m, indexing="ij")
        quotient = (a.float() / b.float()).to(dtype)
        product = (a.float() * (1.0 / b.float())).to(dtype)
        assert torch.equal(quotient, product)
        assert torch.equal(quotient, a / b)
