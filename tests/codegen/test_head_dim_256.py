"""Heads larger than 128 partitions (Gemma 7B / Gemma 2 / Gemma 3 use head_dim 256): each head is split over
partition tiles (``Layout.split``) in q/k-norm, RoPE, the KV-cache write and attention.

Template tests run each split-head template in the interpreter against the reference VM (and HF's formulas); the
model tests run tiny HF models with head_dim 256 through ``torch.compile(backend="fusegraph")`` as one megakernel.
"""
import warnings

import pytest
import torch

from fusegraph import FusegraphWarning
from fusegraph.capture.session import last_session
from fusegraph.codegen import ir
from fusegraph.codegen.errors import CodegenError
from fusegraph.codegen.layout import Layout, choose
from fusegraph.models import build_family_decode, greedy_decode

from .harness import Builder, V
from .test_templates import DTYPES, TOL, _check

D = 256


def _tables(T: int, R: int, interleaved: bool = False, dtype=torch.float32, D: int = D):
    pos = torch.arange(3, 3 + 7 * T, 7, dtype=torch.float32)[:, None]
    freqs = pos * (1.0 / 10000 ** (torch.arange(0, R, 2) / R))
    emb = torch.repeat_interleave(freqs, 2, dim=-1) if interleaved else torch.cat([freqs, freqs], -1)
    pad = torch.ones(T, D - R)
    return torch.cat([emb.cos(), pad], -1).to(dtype), torch.cat([emb.sin(), 0 * pad], -1).to(dtype), emb


# ---- layout ---------------------------------------------------------------------------------------------------
def test_head_split_layout_maps_every_feature_once():
    lay = choose(3 * D, head_size=D)
    assert lay == Layout(128, 6, split=2) and lay.heads == 3
    idx = lay.feature_index()
    assert sorted(idx.reshape(-1).tolist()) == list(range(3 * D))
    # chunk j * heads + h holds tile j of head h: features h * 256 + j * 128 + p
    for j in range(2):
        for h in range(3):
            assert idx[:, j * 3 + h].tolist() == [h * D + j * 128 + p for p in range(128)]
    x = torch.randn(2, 3 * D)
    assert torch.equal(lay.from_tile(lay.to_tile(x)), x)
    assert choose(4 * 192, head_size=192) == Layout(96, 8, split=2)
    with pytest.raises(CodegenError, match="equal partition tiles"):  # a prime head size: refused, not mis-tiled
        choose(2 * 257, head_size=257)


@pytest.mark.parametrize("lay", [Layout(128, 6, split=2), Layout(96, 8, split=2), Layout(64, 4), Layout(64, 4, True)])
def test_row_pattern_is_the_feature_map(lay):
    """The DMA pattern of embedding gathers, loads and stores puts feature ``feature_index()[p, ft]`` at (p, ft):
    the kernel's on-chip order and the host-side weight layouts agree."""
    addr = torch.zeros(1, dtype=torch.long)
    for stride, count in lay.row_pattern():  # row-major over the pattern dims = (p, ft) order of the tile
        addr = (addr[:, None] + stride * torch.arange(count)[None, :]).reshape(-1)
    assert torch.equal(addr.reshape(lay.P, lay.FT), lay.feature_index())
    assert repr(choose(256, head_size=64)) == "Layout(P=64, FT=4, pmajor=False)"  # unsplit names unchanged


# ---- templates ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,D", [(1, 256), (2, 256), (1, 192)])
def test_split_head_norm_and_rope(dtype, T, D):
    """q-norm over a head of two tiles (sums of squares across both) with a Gemma-style 1 + w weight, then
    rotate_half RoPE as a signed tile swap (no rotation matrix)."""
    torch.manual_seed(1)
    H, P = 3, D // 2
    b = Builder(T)
    xt = torch.randn(T, H * D, dtype=dtype)
    xt[:, D:D + P] *= 4  # head 1's first tile larger: a norm that only sums one tile cannot pass
    q = b.act("q", xt)
    qn = b.new("qn", H * D, dtype)
    wt = (0.1 * torch.randn(D)).to(dtype)
    b.ins.append(ir.RMSNorm(x=q, weight=b.hbm("w_qn", wt), out=qn, eps=1e-6, group=D, weight_offset=1.0, layer=0))
    cos_t, sin_t, emb = _tables(T, D, dtype=dtype, D=D)
    qr = b.new("qr", H * D, dtype)
    b.ins.append(ir.Rope(x=qn, cos=b.hbm("cos", cos_t, V.INPUT), sin=b.hbm("sin", sin_t, V.INPUT), out=qr,
                         head_dim=D, layer=0))
    b.store(qn)
    b.store(qr)
    gen, res, ref, _ = b.run()
    assert gen.layouts["qr"] == Layout(P, 2 * H, split=2)
    assert not any(k.startswith("c_rot_") for k in gen.constants)  # the half swap needs no matrix
    _check(gen, res, ref, "qn", dtype)
    _check(gen, res, ref, "qr", dtype)
    # HF: RMSNorm over each head of 256, (1 + w); then q * cos + rotate_half(q) * sin
    xh = xt.float().reshape(T, H, D)
    n = (xh * torch.rsqrt(xh.pow(2).mean(-1, keepdim=True) + 1e-6)) * (1 + wt.float())
    torch.testing.assert_close(res["out_qn"].float(), n.reshape(T, H * D), **TOL[dtype])
    nh = res["out_qn"].float().reshape(T, H, D)
    half = torch.cat((-nh[..., D // 2:], nh[..., :D // 2]), -1)
    hf = nh * emb.cos()[:, None, :] + half * emb.sin()[:, None, :]
    torch.testing.assert_close(res["out_qr"].float(), hf.reshape(T, H * D), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,R,interleaved", [(256, 128, False), (256, 192, False), (256, 256, True), (256, 128, True),
                                             (384, 384, False), (512, 256, False)])
def test_split_head_rope_by_block_matmuls(dtype, D, R, interleaved):
    """Rotations that are not a tile swap (partial rotary, GPT-J pairs, rotate_half over 3 tiles, whose halves
    straddle the middle tile): block matmuls over the tiles. A partial rotary of whole tiles (512 with R = 256)
    stays a tile swap, with the tiles past R passed through."""
    torch.manual_seed(5)
    T, H, S = 2, 2, D // 128
    b = Builder(T)
    xt = torch.randn(T, H * D, dtype=dtype)
    cos_t, sin_t, emb = _tables(T, R, interleaved, dtype, D=D)
    qr = b.new("qr", H * D, dtype)
    b.ins.append(ir.Rope(x=b.act("q", xt), cos=b.hbm("cos", cos_t, V.INPUT), sin=b.hbm("sin", sin_t, V.INPUT),
                         out=qr, head_dim=D, rotary_dim=R if R < D else 0, interleaved=interleaved, layer=0))
    b.store(qr)
    gen, res, ref, _ = b.run()
    rots = [v for k, v in gen.constants.items() if k.startswith("c_rot_")]
    if (D, R) == (512, 256):
        assert rots == [] and "rope.pass" in gen.source
    else:
        assert [r.shape for r in rots] == [(128, S, S, 128)]
    _check(gen, res, ref, "qr", dtype)
    xh = xt.float().reshape(T, H, D)
    rot_x, rest = xh[..., :R], xh[..., R:]
    if interleaved:
        turned = torch.stack((-rot_x[..., 1::2], rot_x[..., 0::2]), dim=-1).flatten(-2)
    else:
        turned = torch.cat((-rot_x[..., R // 2:], rot_x[..., :R // 2]), -1)
    hf = torch.cat((rot_x * emb.cos()[:, None, :] + turned * emb.sin()[:, None, :], rest), -1)
    torch.testing.assert_close(res["out_qr"].float(), hf.reshape(T, H * D), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_head_values_load_and_store(dtype):
    """A head-split value computed outside the kernel is loaded (and a split value stored) with the tile-major
    pattern: the RoPE between them sees the features where the layout says they are."""
    torch.manual_seed(7)
    T, H = 2, 2
    b = Builder(T)
    xt = torch.randn(T, H * D, dtype=dtype)
    src = b.hbm("src", xt, V.INPUT)
    q = b.new("q", H * D, dtype)
    b.ins.append(ir.Load(src=src, out=q))
    cos_t, sin_t, _ = _tables(T, D, dtype=dtype)
    qr = b.new("qr", H * D, dtype)
    b.ins.append(ir.Rope(x=q, cos=b.hbm("cos", cos_t, V.INPUT), sin=b.hbm("sin", sin_t, V.INPUT), out=qr,
                         head_dim=D, layer=0))
    b.store(q)
    b.store(qr)
    gen, res, ref, _ = b.run()
    assert torch.equal(res["out_q"], xt)
    _check(gen, res, ref, "qr", dtype)


def _attention_program(dtype, B: int, L: int, Hq: int = 4, Hkv: int = 2, softcap: float = 0.0, D: int = D):
    torch.manual_seed(2)
    b = Builder(B)
    q = b.act("q", torch.randn(B, Hq * D, dtype=dtype))
    k = b.act("k", torch.randn(B, Hkv * D, dtype=dtype))
    v = b.act("v", torch.randn(B, Hkv * D, dtype=dtype))
    kc = b.hbm("k_cache", torch.randn(B, Hkv, L, D, dtype=dtype), V.STATE)
    vc = b.hbm("v_cache", torch.randn(B, Hkv, L, D, dtype=dtype), V.STATE)
    pos = torch.tensor([5, L - 1][:B], dtype=torch.int32)
    idx = b.hbm("kv_idx", pos, V.INPUT)
    mask = torch.zeros(B, L)
    for i, p in enumerate(pos.tolist()):
        mask[i, p + 1:] = torch.finfo(torch.float32).min
    m = b.hbm("mask", mask.to(dtype), V.INPUT)
    b.ins.append(ir.KVWrite(cache=kc, value=k, index=idx, layer=0))
    b.ins.append(ir.KVWrite(cache=vc, value=v, index=idx, layer=0))
    o = b.new("o", Hq * D, dtype)
    b.ins.append(ir.Attention(q=q, k_cache=kc, v_cache=vc, mask=m, out=o, scale=D ** -0.5, groups=Hq // Hkv,
                              softcap=softcap, layer=0))
    b.store(o)
    return b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,D", [(32, 256), (200, 256), (256, 256), (32, 192)])
def test_split_head_kv_write_and_attention(dtype, L, D):
    """KV rows written from both tiles of each head; q.k^T accumulated over the tiles, P.V per tile; one cache
    tile per DMA (L = 32, 200) and the whole-cache DMA (L = 256)."""
    b = _attention_program(dtype, 2, L, D=D)
    gen, res, ref, kern = b.run()
    assert gen.layouts["o"] == Layout(D // 2, 8, split=2)
    _check(gen, res, ref, "o", dtype)
    assert torch.equal(kern["k_cache"], ref["k_cache"]) and torch.equal(kern["v_cache"], ref["v_cache"])
    assert not torch.equal(kern["k_cache"], b.tensors["k_cache"])  # written in place
    # and against the formula in fp32 (the reference VM is not the only judge)
    B, Hq = 2, 4
    q = b.tensors["in_q"].float().reshape(B, Hq, 1, D)
    k = ref["k_cache"].float().repeat_interleave(2, dim=1)
    v = ref["v_cache"].float().repeat_interleave(2, dim=1)
    s = q @ k.transpose(2, 3) * D ** -0.5 + b.tensors["mask"].float().reshape(B, 1, 1, L)
    expected = (torch.softmax(s, -1) @ v).reshape(B, Hq * D)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=6e-2, rtol=6e-2)
    torch.testing.assert_close(res["out_o"].float(), expected, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_head_attention_softcap_and_lnc2(dtype):
    """Gemma 2's soft-capped scores on split heads, and LNC=2 (kv heads split between the cores, each feature
    tile's head halves swapped) equal to LNC=1."""
    b = _attention_program(dtype, 1, 32, softcap=20.0)
    gen1, res1, ref, kern1 = b.run()
    gen2, res2, _, kern2 = b.run(lnc=2)
    assert gen2.source.count("nisa.sendrecv(") == 2  # one per feature tile
    _check(gen1, res1, ref, "o", dtype)
    _check(gen2, res2, ref, "o", dtype)
    torch.testing.assert_close(res2["out_o"].float(), res1["out_o"].float(), **TOL[dtype])
    assert torch.equal(kern2["k_cache"], kern1["k_cache"]) and torch.equal(kern2["v_cache"], kern1["v_cache"])


# ---- models ---------------------------------------------------------------------------------------------------
STEPS = 5
SLOW = pytest.mark.slow
MODELS = [
    ("Gemma", "float32", 1),  # Gemma 7B's head_dim 256, 1 + w norms, scaled embedding
    ("Gemma", "bfloat16", 1),
    ("Gemma2", "float32", 1),  # soft-capped attention scores and logits
    pytest.param("Gemma2", "bfloat16", 1, marks=SLOW),
    pytest.param("Gemma3", "float32", 1, marks=SLOW),
    ("Gemma3", "bfloat16", 1),  # q/k-norm (1 + w) over the split head, sliding and full attention layers
    pytest.param("Gemma3", "float32", 2, marks=SLOW),  # LNC=2: kv heads split between the cores
    ("Qwen3", "float32", 1),  # q/k-norm
    pytest.param("Qwen3", "bfloat16", 1, marks=SLOW),
    pytest.param("Llama", "float32", 1, marks=SLOW),
    ("Llama", "bfloat16", 1),
]


@pytest.mark.parametrize("family,dtype,lnc", MODELS)
def test_head_dim_256_model_runs_as_one_megakernel(family, dtype, lnc):
    """head_dim 256 no longer falls back: one kernel launch per step, verified, tokens equal to eager over
    several steps (the first call of each step version returns eager's values after verification, so the later
    calls are the ones that test the kernel), logits within the documented tolerance, no warnings."""
    case = build_family_decode(family, dtype=dtype, head_dim=256)
    ref = case.fork()
    step = torch.compile(case.step, backend="fusegraph",
                         options={"executor": "nkisim", "cache_dir": "off", "lnc": lnc})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        toks_c, logits_c = greedy_decode(step, case.token, case.position, STEPS)
    assert not [w for w in caught if issubclass(w.category, FusegraphWarning)], [str(w.message) for w in caught]
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, STEPS)
    (stats,) = last_session().program.execution.values()
    assert stats.launches_per_call == 1, stats.executed_by
    assert list(stats.verification.values()) == ["passed"]
    assert stats.calls >= 3  # at least two steps ran the kernel itself, after the verified first call
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    tol = 1e-4 if dtype == "float32" else 2 ** -6  # docs/codegen.md "Numerics"
    for a, b in zip(logits_c, logits_e):
        assert (a - b).abs().max().item() <= tol * b.abs().max().item()
    for a, b in zip(case.cache_tensors(), ref.cache_tensors()):
        assert (a.float() - b.float()).abs().max().item() <= (1e-5 if dtype == "float32" else 2e-2)


# ---- full size --------------------------------------------------------------------------------------------------
def gemma_7b_meta(layers: int = 28, max_cache_len: int = 32):
    """Gemma-7B's dimensions (hidden 3072, 16 heads of 256, MLP 24576, vocabulary 256000) on the meta device, no
    memory allocated: ``fusegraph kernel --model tests.codegen.test_head_dim_256:gemma_7b_meta``."""
    from transformers import GemmaConfig, GemmaForCausalLM, StaticCache

    from fusegraph.models import DecodeCase

    cfg = GemmaConfig(vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=16, head_dim=256, max_position_embeddings=8192)
    with torch.device("meta"):
        model = GemmaForCausalLM._from_config(cfg, dtype=torch.bfloat16, attn_implementation="eager").eval()
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    cache.early_initialization(1, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16, torch.device("meta"))
    token = torch.zeros(1, 1, dtype=torch.long, device="meta")
    position = torch.full((1, 1), 8, dtype=torch.long, device="meta")
    return DecodeCase("gemma-7b", model, cache, token, position, torch.bfloat16, {"max_cache_len": max_cache_len})


@pytest.mark.slow
def test_gemma_7b_full_size_builds_shape_only_within_sbuf():
    """Full-size Gemma-7B layers (2 of them: SBUF per partition is the weight ring plus the largest layer, the
    same for 28) generate one megakernel whose shape-only run stays inside trn2's SBUF budget."""
    from fusegraph.api import build_for_target, capture_callable

    case = gemma_7b_meta(layers=2)
    built = build_for_target(capture_callable("gemma-7b", case.step, (case.token, case.position), {}), "trn2")
    budget = built.generated.budget
    assert Layout(128, 32, split=2) in built.generated.layouts.values()  # 16 heads of 2 x 128
    assert budget.sbuf_peak <= budget.sbuf_budget, budget.to_dict()
    assert 0 < built.profile["peak_sbuf_bytes_per_partition"] <= budget.sbuf_budget
