"""Each NKI template, generated and run in the interpreter, against the reference VM (fp32 and bf16)."""
import pytest
import torch

from fusegraph.codegen import ir
from fusegraph.nkiapi.conformance import check_source

from .harness import Builder, V

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def _check(gen, results, ref_env, name, dtype):
    assert check_source(gen.source) == []
    got = results[f"out_{name}"]
    exp = ref_env[name]
    assert got.dtype == exp.dtype
    torch.testing.assert_close(got.float(), exp.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3])
def test_rmsnorm_hidden_and_linear_with_bias(dtype, T):
    torch.manual_seed(0)
    b = Builder(T)
    x = b.act("x", torch.randn(T, 384, dtype=dtype))
    w = b.hbm("w_norm", (1 + 0.1 * torch.randn(384)).to(dtype))
    y = b.new("y", 384, dtype)
    b.ins.append(ir.RMSNorm(x=x, weight=w, out=y, eps=1e-6, group=384, layer=0))
    z = b.new("z", 512, dtype)
    b.ins.append(ir.Linear(x=y, weight=b.hbm("w_lin", (torch.randn(512, 384) / 20).to(dtype)), out=z,
                           bias=b.hbm("b_lin", torch.randn(512).to(dtype)), layer=0))
    b.store(y)
    b.store(z)
    gen, res, ref, _ = b.run(chunk_bytes=1024)
    _check(gen, res, ref, "y", dtype)
    _check(gen, res, ref, "z", dtype)
    assert gen.stats["chunks"] > 3  # the weight really streamed in several chunks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,bias", [(1, True), (3, False)])
def test_layernorm_hidden(dtype, T, bias):
    """LayerNorm (RMSNorm template with the mean subtracted), against torch's layer_norm: fp32 inside, one
    rounding at the end. Offset inputs, so a missing mean subtraction cannot pass."""
    torch.manual_seed(4)
    b = Builder(T)
    xt = (3.0 + torch.randn(T, 384)).to(dtype)
    wt = (1 + 0.1 * torch.randn(384)).to(dtype)
    bt = torch.randn(384).to(dtype) if bias else None
    x = b.act("x", xt)
    y = b.new("y", 384, dtype)
    b.ins.append(ir.RMSNorm(x=x, weight=b.hbm("w_ln", wt), out=y, eps=1e-5, group=384, center=True,
                            bias=b.hbm("b_ln", bt) if bias else None, layer=0))
    b.store(y)
    gen, res, ref, _ = b.run()
    _check(gen, res, ref, "y", dtype)
    expected = torch.nn.functional.layer_norm(xt, (384,), wt, bt, 1e-5)
    torch.testing.assert_close(res["out_y"].float(), expected.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_norm_and_rope(dtype):
    torch.manual_seed(1)
    T, H, D = 2, 4, 64
    b = Builder(T)
    q = b.act("q", torch.randn(T, H * D, dtype=dtype))
    qn = b.new("qn", H * D, dtype)
    b.ins.append(ir.RMSNorm(x=q, weight=b.hbm("w_qn", (1 + 0.1 * torch.randn(D)).to(dtype)), out=qn, eps=1e-6,
                            group=D, layer=0))
    pos = torch.tensor([[3.0], [9.0]])
    freqs = pos * (1.0 / 10000 ** (torch.arange(0, D, 2) / D))
    emb = torch.cat([freqs, freqs], -1)
    cos = b.hbm("cos", emb.cos().to(dtype), V.INPUT)
    sin = b.hbm("sin", emb.sin().to(dtype), V.INPUT)
    qr = b.new("qr", H * D, dtype)
    b.ins.append(ir.Rope(x=qn, cos=cos, sin=sin, out=qr, head_dim=D, layer=0))
    b.store(qn)
    b.store(qr)
    gen, res, ref, _ = b.run()
    _check(gen, res, ref, "qn", dtype)
    _check(gen, res, ref, "qr", dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_rope_rotates_only_the_first_features(dtype):
    """Partial rotary (R < D): the kernel gets cos/sin padded with 1/0 past R; checked against HF's formula."""
    torch.manual_seed(3)
    T, H, D, R = 2, 4, 64, 32
    b = Builder(T)
    x = torch.randn(T, H * D, dtype=dtype)
    q = b.act("q", x)
    pos = torch.tensor([[3.0], [9.0]])
    freqs = pos * (1.0 / 10000 ** (torch.arange(0, R, 2) / R))
    emb = torch.cat([freqs, freqs], -1)  # [T, R]
    pad = torch.ones(T, D - R)
    cos = b.hbm("cos", torch.cat([emb.cos(), pad], -1).to(dtype), V.INPUT)
    sin = b.hbm("sin", torch.cat([emb.sin(), 0 * pad], -1).to(dtype), V.INPUT)
    qr = b.new("qr", H * D, dtype)
    b.ins.append(ir.Rope(x=q, cos=cos, sin=sin, out=qr, head_dim=D, rotary_dim=R, layer=0))
    b.store(qr)
    gen, res, ref, _ = b.run()
    _check(gen, res, ref, "qr", dtype)
    # HF: cat((rot * cos + rotate_half(rot) * sin, rest), -1) with rot, rest = x[..., :R], x[..., R:]
    xh = x.float().reshape(T, H, D)
    rot, rest = xh[..., :R], xh[..., R:]
    half = torch.cat((-rot[..., R // 2:], rot[..., :R // 2]), -1)
    c, s_ = emb.cos()[:, None, :], emb.sin()[:, None, :]
    hf = torch.cat((rot * c + half * s_, rest), -1).reshape(T, H * D)
    torch.testing.assert_close(res["out_qr"].float(), hf, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R", [64, 32])
def test_interleaved_rope(dtype, R):
    """GPT-J style pair rotation (Cohere; GLM with a partial rotary dim), against HF's formula."""
    torch.manual_seed(5)
    T, H, D = 2, 4, 64
    b = Builder(T)
    x = torch.randn(T, H * D, dtype=dtype)
    q = b.act("q", x)
    pos = torch.tensor([[3.0], [9.0]])
    freqs = pos * (1.0 / 10000 ** (torch.arange(0, R, 2) / R))
    emb = torch.repeat_interleave(freqs, 2, dim=-1)  # [T, R]
    pad = torch.ones(T, D - R)
    cos = b.hbm("cos", torch.cat([emb.cos(), pad], -1).to(dtype), V.INPUT)
    sin = b.hbm("sin", torch.cat([emb.sin(), 0 * pad], -1).to(dtype), V.INPUT)
    qr = b.new("qr", H * D, dtype)
    b.ins.append(ir.Rope(x=q, cos=cos, sin=sin, out=qr, head_dim=D, rotary_dim=R if R < D else 0, interleaved=True,
                         layer=0))
    b.store(qr)
    gen, res, ref, _ = b.run()
    _check(gen, res, ref, "qr", dtype)
    xh = x.float().reshape(T, H, D)
    rot, rest = xh[..., :R], xh[..., R:]
    turned = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    c, s_ = emb.cos()[:, None, :], emb.sin()[:, None, :]
    hf = torch.cat((rot * c + turned * s_, rest), -1).reshape(T, H * D)
    torch.testing.assert_close(res["out_qr"].float(), hf, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", [32, 200, 256])
def test_kv_write_and_decode_attention(dtype, L):
    torch.manual_seed(2)
    B, Hq, Hkv, D = 2, 4, 2, 64
    b = Builder(B)
    q = b.act("q", torch.randn(B, Hq * D, dtype=dtype))
    k = b.act("k", torch.randn(B, Hkv * D, dtype=dtype))
    v = b.act("v", torch.randn(B, Hkv * D, dtype=dtype))
    kc = b.hbm("k_cache", torch.randn(B, Hkv, L, D, dtype=dtype), V.STATE)
    vc = b.hbm("v_cache", torch.randn(B, Hkv, L, D, dtype=dtype), V.STATE)
    pos = torch.tensor([5, L - 1], dtype=torch.int32)
    idx = b.hbm("kv_idx", pos, V.INPUT)
    mask = torch.zeros(B, L)
    for i, p in enumerate(pos.tolist()):
        mask[i, p + 1:] = torch.finfo(torch.float32).min
    m = b.hbm("mask", mask.to(dtype), V.INPUT)
    b.ins.append(ir.KVWrite(cache=kc, value=k, index=idx, layer=0))
    b.ins.append(ir.KVWrite(cache=vc, value=v, index=idx, layer=0))
    o = b.new("o", Hq * D, dtype)
    b.ins.append(ir.Attention(q=q, k_cache=kc, v_cache=vc, mask=m, out=o, scale=D ** -0.5, groups=Hq // Hkv, layer=0))
    b.store(o)
    gen, res, ref, kern = b.run()
    _check(gen, res, ref, "o", dtype)
    assert torch.equal(kern["k_cache"], ref["k_cache"]) and torch.equal(kern["v_cache"], ref["v_cache"])
    assert not torch.equal(kern["k_cache"], b.tensors["k_cache"])  # written in place


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["eager", "fused"])
def test_decode_attention_with_softcap(dtype, rounding):
    """Gemma 2's soft-capped scores, against the formula in fp32: large scores (x8) so the cap matters."""
    torch.manual_seed(6)
    B, Hq, Hkv, D, L, cap = 2, 4, 2, 64, 32, 20.0
    b = Builder(B)
    qt = (8 * torch.randn(B, Hq * D)).to(dtype)
    kt, vt = torch.randn(B, Hkv, L, D, dtype=dtype), torch.randn(B, Hkv, L, D, dtype=dtype)
    mask = torch.zeros(B, L)
    mask[0, 20:] = torch.finfo(torch.float32).min
    o = b.new("o", Hq * D, dtype)
    b.ins.append(ir.Attention(q=b.act("q", qt), k_cache=b.hbm("k_cache", kt, V.STATE),
                              v_cache=b.hbm("v_cache", vt, V.STATE), mask=b.hbm("mask", mask.to(dtype), V.INPUT),
                              out=o, scale=D ** -0.5, groups=Hq // Hkv, rounding=rounding, softcap=cap, layer=0))
    b.store(o)
    gen, res, ref, _ = b.run()
    _check(gen, res, ref, "o", dtype)
    q = qt.float().reshape(B, Hq, 1, D)
    k, v = kt.float().repeat_interleave(2, dim=1), vt.float().repeat_interleave(2, dim=1)
    s = torch.tanh((q @ k.transpose(2, 3)) * D ** -0.5 / cap) * cap + mask.reshape(B, 1, 1, L)
    expected = (torch.softmax(s, -1) @ v).reshape(B, Hq * D)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=6e-2, rtol=6e-2)
    torch.testing.assert_close(res["out_o"].float(), expected, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalize", [True, False])
def test_router_and_selective_experts(dtype, normalize):
    torch.manual_seed(3)
    T, H, E, I, K = 2, 256, 16, 96, 4
    b = Builder(T)
    x = b.act("x", torch.randn(T, H, dtype=dtype))
    wts = b.new("rw", K, dtype, V.ROUTING)
    ids = ir.Value("ri", V.ROUTING, (T, K), torch.int32)
    b.ins.append(ir.Router(x=x, weight=b.hbm("w_router", torch.randn(E, H).to(dtype)), weights=wts, indices=ids,
                           top_k=K, normalize=normalize, layer=0))
    y = b.new("y", H, dtype)
    gu = b.hbm("w_gu", (torch.randn(E, 2 * I, H) / 16).to(dtype))
    dn = b.hbm("w_dn", (torch.randn(E, H, I) / 10).to(dtype))
    b.ins.append(ir.Experts(x=x, weights=wts, indices=ids, gate_up=gu, down=dn, out=y, intermediate=I, layer=0))
    g = b.new("g", H, dtype)
    b.ins.append(ir.GatedAct(gate=x, up=y, out=g, act="silu", layer=0))
    b.store(y)
    b.store(g)
    gen, res, ref, _ = b.run(chunk_bytes=4096)
    _check(gen, res, ref, "y", dtype)
    _check(gen, res, ref, "g", dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lnc2_split_matches_lnc1(dtype):
    """LNC=2: projections, kv heads and experts split between the two cores, halves swapped by sendrecv."""
    torch.manual_seed(4)
    T, H, Hq, Hkv, D, L, E, I, K = 1, 256, 4, 2, 64, 32, 8, 64, 2
    b = Builder(T)
    x = b.act("x", torch.randn(T, H, dtype=dtype))
    q = b.new("q", Hq * D, dtype)
    b.ins.append(ir.Linear(x=x, weight=b.hbm("w_q", (torch.randn(Hq * D, H) / 16).to(dtype)), out=q, layer=0))
    k = b.new("k", Hkv * D, dtype)
    b.ins.append(ir.Linear(x=x, weight=b.hbm("w_k", (torch.randn(Hkv * D, H) / 16).to(dtype)), out=k, layer=0))
    kc = b.hbm("k_cache", torch.randn(T, Hkv, L, D, dtype=dtype), V.STATE)
    vc = b.hbm("v_cache", torch.randn(T, Hkv, L, D, dtype=dtype), V.STATE)
    idx = b.hbm("kv_idx", torch.tensor([7], dtype=torch.int32), V.INPUT)
    mask = torch.zeros(T, L)
    mask[:, 8:] = torch.finfo(torch.float32).min
    b.ins.append(ir.KVWrite(cache=kc, value=k, index=idx, layer=0))
    b.ins.append(ir.KVWrite(cache=vc, value=k, index=idx, layer=0))
    o = b.new("o", Hq * D, dtype)
    b.ins.append(ir.Attention(q=q, k_cache=kc, v_cache=vc, mask=b.hbm("mask", mask.to(dtype), V.INPUT), out=o,
                              scale=D ** -0.5, groups=Hq // Hkv, layer=0))
    wts = b.new("rw", K, dtype, V.ROUTING)
    ids = ir.Value("ri", V.ROUTING, (T, K), torch.int32)
    b.ins.append(ir.Router(x=x, weight=b.hbm("w_router", torch.randn(E, H).to(dtype)), weights=wts, indices=ids,
                           top_k=K, normalize=True, layer=0))
    y = b.new("y", H, dtype)
    b.ins.append(ir.Experts(x=x, weights=wts, indices=ids, gate_up=b.hbm("w_gu", (torch.randn(E, 2 * I, H) / 16).to(dtype)),
                            down=b.hbm("w_dn", (torch.randn(E, H, I) / 8).to(dtype)), out=y, intermediate=I, layer=0))
    logits = b.new("logits", 512, dtype)
    b.ins.append(ir.Linear(x=y, weight=b.hbm("w_head", (torch.randn(512, H) / 16).to(dtype)), out=logits))
    b.store(o)
    b.store(logits)
    gen1, res1, ref, kern1 = b.run()
    gen2, res2, _, kern2 = b.run(lnc=2)
    assert "nisa.sendrecv(" in gen2.source and "pid = nl.program_id(axis=0)" in gen2.source
    for name in ("o", "logits"):
        _check(gen2, res2, ref, name, dtype)
        torch.testing.assert_close(res2[f"out_{name}"].float(), res1[f"out_{name}"].float(), **TOL[dtype])
    # the written rows are a Linear's output: LNC=2 splits its matmuls (other shapes), so to rounding, not bitwise
    for cache in ("k_cache", "v_cache"):
        torch.testing.assert_close(kern2[cache].float(), kern1[cache].float(), **TOL[dtype])
