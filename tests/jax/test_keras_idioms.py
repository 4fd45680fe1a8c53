"""keras-hub's idioms, imported into the forms fusegraph's (PyTorch) patterns match, each checked against JAX on
small functions written the way keras-hub writes them (no Keras needed): the stacked KV cache."""
import numpy as np
import pytest
import torch

pytest.importorskip("jaxlib")  # not "jax": tests/jax itself would satisfy that
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from fusegraph.stablehlo import import_stablehlo  # noqa: E402

from jax_helpers import run_imported  # noqa: E402

B, LAYERS, L, KV, D = 2, 2, 8, 2, 4


def keras_cache_step(cache, new, index):
    """keras-hub's ``call_with_cache``: ``cache[:, i]``, ``[:, 0/1]``, ``slice_update`` at ``[0, index, 0, 0]``,
    ``stack`` per layer and over layers (``LlamaAttention.call``)."""
    updated, reads = [], []
    for i in range(LAYERS):
        current = cache[:, i, ...]
        k_cache, v_cache = current[:, 0, ...], current[:, 1, ...]
        k = jax.lax.dynamic_update_slice(k_cache, new * (i + 1), (0, index, 0, 0))
        v = jax.lax.dynamic_update_slice(v_cache, new - i, (0, index, 0, 0))
        reads.append(jnp.sum(k * 2.0 + v, axis=1))  # a read of the updated cache ([B, L, KV, D] layout)
        updated.append(jnp.stack((k, v), axis=1))
    return reads[0], reads[1], jnp.stack(updated, axis=1)


def _case(seed=0):
    rng = np.random.default_rng(seed)
    cache = jnp.asarray(rng.normal(size=(B, LAYERS, 2, L, KV, D)).astype(np.float32))
    new = jnp.asarray(rng.normal(size=(B, 1, KV, D)).astype(np.float32))
    return cache, new


def test_stacked_cache_is_split_into_per_layer_state_parts_written_in_place():
    cache, new = _case()
    text = jax.jit(keras_cache_step, donate_argnums=(0,)).lower(cache, new, jnp.int32(3)).as_text()
    imported = import_stablehlo(text, arg_kinds=["state", "step", "step"])
    parts = [s for s in imported.inputs if s.part is not None]
    assert [s.part for s in parts] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(s.kind == "state" and s.shape == (B, KV, L, D) for s in parts)  # HF's [B, KV, L, D] per layer
    ops = [n for n in imported.gm.graph.nodes if n.op == "call_function"]
    writes = [n for n in ops if n.target is torch.ops.aten.index_copy.default]
    assert len(writes) == 4 and all(n.args[1] == 2 for n in writes)  # the L dim of [B, KV, L, D]
    placeholders = [n for n in imported.gm.graph.nodes if n.op == "placeholder"]
    assert {w.args[0] for w in writes} == set(placeholders[:4])  # each writes its own state part
    copies = [n for n in ops if n.target is torch.ops.aten.copy_.default]
    assert len(copies) == 4 and {c.args[0] for c in copies} == set(placeholders[:4])
    assert not any(n.target is torch.ops.aten.cat.default for n in ops)  # no stacked cache is ever built
    for index in (0, 5, 11, -1):  # 11: clamped like XLA; -1: clamped to 0 (no wrap in lax)
        expected = jax.jit(keras_cache_step)(cache, new, jnp.int32(index))
        got = run_imported(imported, cache, new, np.int32(index))
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, np.asarray(e), rtol=1e-6, atol=1e-6)


def test_state_parts_are_written_in_place_and_reassembled():
    """The graph writes each part into its input tensor; the function's result is the reassembled cache."""
    cache, new = _case(1)
    text = jax.jit(keras_cache_step, donate_argnums=(0,)).lower(cache, new, jnp.int32(2)).as_text()
    imported = import_stablehlo(text, arg_kinds=["state", "step", "step"])
    whole = torch.from_numpy(np.array(cache))
    tensors = [s.take(whole) if s.part is not None else s.value if s.arg is None else
               torch.from_numpy(np.array(new)) if s.arg == 1 else torch.tensor(2) for s in imported.inputs]
    outs = imported.gm(*tensors)
    *_, expected_cache = jax.jit(keras_cache_step)(cache, new, jnp.int32(2))
    results = imported.results(outs)
    np.testing.assert_allclose(results[2].numpy(), np.asarray(expected_cache), rtol=1e-6)
    e = np.asarray(expected_cache)
    for s, t in zip(imported.inputs[:4], tensors[:4]):  # in place: the inputs now hold the new cache
        np.testing.assert_allclose(t.numpy(), e[:, s.part[0], s.part[1]].transpose(0, 2, 1, 3), rtol=1e-6)
    assert whole.data_ptr() not in {t.data_ptr() for t in tensors[:4]}  # parts are copies of the argument


def test_stacked_cache_without_donation_stays_whole():
    cache, new = _case()
    text = jax.jit(keras_cache_step).lower(cache, new, jnp.int32(3)).as_text()
    imported = import_stablehlo(text)
    assert all(s.part is None for s in imported.inputs)
    expected = jax.jit(keras_cache_step)(cache, new, jnp.int32(3))
    for g, e in zip(run_imported(imported, cache, new, np.int32(3)), expected):
        np.testing.assert_allclose(g, np.asarray(e), rtol=1e-6, atol=1e-6)


# ---- RoPE and attention, written as keras-hub writes them ----------------------------------------------------
H, T = 4, 1


def keras_rotate_half(x):
    """keras-hub's ``RotaryEmbedding._rotate_half``: ``stack((-x2, x1), axis=-2)`` flattened back."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    half_rot = jnp.stack((-x2, x1), axis=-2)
    return jnp.reshape(half_rot, x.shape)


def keras_rope(x, cos, sin):
    """``x * cos + rotate_half(x) * sin`` on ``[B, T, H, D]`` with per-token tables ``[B, T, 1, D]``."""
    return x * cos + keras_rotate_half(x) * sin


def keras_attention(q, k_cache, v_cache, mask):
    """``LlamaAttention._compute_attention`` on its fused path: ``jnp.repeat``ed keys/values, then
    ``jax.nn.dot_product_attention`` with a boolean mask (``[B, T, L]`` -> ``[B, 1, T, L]``)."""
    groups = H // KV
    key = jnp.repeat(k_cache, groups, axis=2)
    value = jnp.repeat(v_cache, groups, axis=2)
    return jax.nn.dot_product_attention(q, key, value, mask=mask[:, None], scale=D ** -0.5)


def _fused(fn, *args):
    import fusegraph.jax as fj

    fused = fj.jit(fn, params_argnums=(), options={"executor": "eager"})
    out = fused(*args)
    assert fused.last.fallback is None and fused.last.verified
    return fused.last, out


def test_keras_rope_imports_as_hf_rope_and_equals_jax():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(B, T, H, D)).astype(np.float32))
    ang = rng.normal(size=(B, T, 1, D)).astype(np.float32)
    cos, sin = jnp.asarray(np.cos(ang)), jnp.asarray(np.sin(ang))
    c, out = _fused(keras_rope, x, cos, sin)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(keras_rope)(x, cos, sin)), rtol=1e-6, atol=1e-6)
    assert c.report().to_dict()["pattern_counts"].get("fusegraph.rope") == 1
    ops = [str(n.target) for n in c.imported.gm.graph.nodes if n.op == "call_function"]
    assert "aten.cat.default" in ops and "aten.permute.default" not in ops  # HF's rotate_half, one transpose


def test_keras_rope_with_tables_shared_by_the_batch():
    """keras-hub's tables are ``[1, T, 1, D]`` (positions from ``start_index``, the same for every row): expanded
    to HF's per-row ``[B, 1, T, D]`` (a broadcast, no arithmetic)."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(B, T, H, D)).astype(np.float32))
    ang = rng.normal(size=(1, T, 1, D)).astype(np.float32)
    cos, sin = jnp.asarray(np.cos(ang)), jnp.asarray(np.sin(ang))
    c, out = _fused(keras_rope, x, cos, sin)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(keras_rope)(x, cos, sin)), rtol=1e-6, atol=1e-6)
    assert c.report().to_dict()["pattern_counts"].get("fusegraph.rope") == 1


def keras_table(start):
    """keras-hub's ``RotaryEmbedding._compute_cos_sin_embedding``: inverse frequencies from ``arange``/``**``,
    positions ``arange(T) + start_index`` in f32, ``einsum("bi,j->bij")``, ``stack`` + reshape."""
    freq_range = jnp.arange(0, D, 2, dtype=jnp.float32) / jnp.float32(D)
    inverse_freq = 1.0 / (10000.0 ** freq_range)
    positions = (jnp.arange(T, dtype=jnp.float32) + start.astype(jnp.float32))[None]
    freq = jnp.einsum("bi,j->bij", positions, inverse_freq)
    emb = jnp.reshape(jnp.stack((freq, freq), axis=-2), (*freq.shape[:-1], freq.shape[-1] * 2))[:, :, None, :]
    return jnp.cos(emb), jnp.sin(emb)


def keras_table_rope(x, start):
    """Two RoPEs, each computing its own tables (as keras-hub does for q and k in every layer)."""
    return keras_rope(x, *keras_table(start)), keras_rope(x * 2.0, *keras_table(start))


def test_keras_rope_tables_import_as_hf_rope_tables_computed_once():
    """The in-graph ``inv_freq`` is folded into a buffer (evaluated with the very PyTorch calls the graph would
    make), the positions become HF's integer ``position_ids``, and the tables (Keras recomputes them for every
    use) are computed once: the rope_tables pattern."""
    x = jnp.asarray(np.random.default_rng(6).normal(size=(B, T, H, D)).astype(np.float32))
    import fusegraph.jax as fj

    fused = fj.jit(keras_table_rope, params_argnums=(), options={"executor": "eager"})
    for start in (0, 7, 30):
        out = fused(x, jnp.int32(start))
        for g, e in zip(out, jax.jit(keras_table_rope)(x, jnp.int32(start))):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5)
    c = fused.last
    assert c.fallback is None and c.verified
    counts = c.report().to_dict()["pattern_counts"]
    assert counts.get("fusegraph.rope_tables") == 1 and counts.get("fusegraph.rope") == 2
    buffers = [s for s in c.imported.inputs if s.kind == "buffer"]
    assert len(buffers) == 1 and buffers[0].shape == (D // 2,)  # the folded inv_freq


def keras_table_rope_bf16(x, start):
    """Under a bf16 policy Keras casts each fp32 table to the activations' dtype before the rotation."""
    cos, sin = keras_table(start)
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    cos2, sin2 = (t.astype(x.dtype) for t in keras_table(start))
    return keras_rope(x, cos, sin), keras_rope(x * 2.0, cos2, sin2)


def test_bf16_rope_tables_cast_once_like_hf():
    """The tables' cast to bf16 is HF's ``cos.to(dtype=x.dtype)`` (the rope_tables pattern's last op), done on
    the shared table once, before its broadcast: nothing is left outside the patterns."""
    import ml_dtypes

    import fusegraph.jax as fj

    x = jnp.asarray(np.random.default_rng(13).normal(size=(B, T, H, D)).astype(ml_dtypes.bfloat16))
    fused = fj.jit(keras_table_rope_bf16, params_argnums=(), options={"executor": "eager"})
    for start in (0, 30):
        out = fused(x, jnp.int32(start))
        for g, e in zip(out, jax.jit(keras_table_rope_bf16)(x, jnp.int32(start))):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e, np.float32), rtol=0, atol=2 ** -6)
    c = fused.last
    assert c.fallback is None and c.verified
    data = c.report().to_dict()
    counts = data["pattern_counts"]
    assert counts.get("fusegraph.rope_tables") == 1 and counts.get("fusegraph.rope") == 2
    stray = [n for m in data["matches"] if m["pattern"] == "fusegraph.generic" for n in m["nodes"]]
    stray += [n for u in data["unmatched"] for n in u["nodes"]]
    assert not [n for n in stray if "_to_copy" in n], stray  # the casts are the pattern's


def test_rope_with_per_head_tables_is_left_as_is():
    """Tables that differ per head have no HF ``[B, 1, T, D]`` form: the ops stay Keras's (still correct)."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(B, T, H, D)).astype(np.float32))
    cos = jnp.asarray(rng.normal(size=(B, T, H, D)).astype(np.float32))
    c, out = _fused(keras_rope, x, cos, cos)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(keras_rope)(x, cos, cos)), rtol=1e-6)
    assert "fusegraph.rope" not in c.report().to_dict()["pattern_counts"]


def _attention_args(seed, position=5, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)).astype(dtype))
    k = jnp.asarray(rng.normal(size=(B, L, KV, D)).astype(dtype))
    v = jnp.asarray(rng.normal(size=(B, L, KV, D)).astype(dtype))
    mask = jnp.asarray(np.arange(L)[None, None, :] <= position).repeat(B, 0)  # [B, T, L]
    return q, k, v, mask


def test_keras_attention_imports_as_hf_decode_attention_and_equals_jax():
    for position in (0, 5, L - 1):
        args = _attention_args(4, position)
        c, out = _fused(keras_attention, *args)
        expected = jax.jit(keras_attention)(*args)
        np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-6)
    assert c.report().to_dict()["pattern_counts"].get("fusegraph.decode_attention") == 1
    ops = [str(n.target) for n in c.imported.gm.graph.nodes if n.op == "call_function"]
    assert ops.count("aten.bmm.default") == 2 and "aten._softmax.default" in ops


def test_attention_with_a_per_head_mask_is_left_as_is():
    """A mask that differs per head is not HF's ``[B, 1, 1, L]``: the attention stays in Keras's form."""
    def per_head(q, k_cache, v_cache, mask):
        key = jnp.repeat(k_cache, H // KV, axis=2)
        value = jnp.repeat(v_cache, H // KV, axis=2)
        m = jnp.broadcast_to(mask[:, None], (B, H, T, L)) & (jnp.arange(H)[None, :, None, None] != 1)
        return jax.nn.dot_product_attention(q, key, value, mask=m, scale=D ** -0.5)

    args = _attention_args(5)
    c, out = _fused(per_head, *args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(per_head)(*args)), rtol=1e-5, atol=1e-6)
    assert "fusegraph.decode_attention" not in c.report().to_dict()["pattern_counts"]


def _fp32_score_attention(q, k, v, mask):
    """The decode_attention kernel's ``fused`` (SDPA) rounding in torch: fp32 scores, scale, mask and softmax,
    the probabilities rounded once to q's dtype, ``@ v`` (patterns/attention/lowering.py ``Attention.reference``)."""
    q, k, v = (torch.from_numpy(np.asarray(t, np.float32)).to(torch.bfloat16).transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
    s = torch.matmul(q.float(), k.float().transpose(2, 3)) * D ** -0.5
    s = s + torch.where(torch.from_numpy(np.array(mask))[:, None], 0.0, float("-inf"))
    p = torch.softmax(s, -1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v).transpose(1, 2).float().numpy()


def test_bf16_attention_with_fp32_scores_imports_as_hf_sdpa():
    """jax.nn.dot_product_attention keeps bf16 q/k's scores in fp32 up to the probabilities: HF's SDPA rounding,
    so it is imported as HF's SDPA call (the pattern's ``sdpa`` variant, lowered with fp32 scores). That rounding,
    computed in torch, equals JAX's result to bf16 accuracy; the eager executor runs torch's SDPA."""
    import ml_dtypes

    for position in (0, 5, L - 1):
        args = _attention_args(6, position, dtype=ml_dtypes.bfloat16)
        c, out = _fused(keras_attention, *args)
        expected = np.asarray(jax.jit(keras_attention)(*args), np.float32)
        scale = np.abs(expected).max()
        np.testing.assert_allclose(_fp32_score_attention(*args), expected, rtol=0, atol=scale * 2 ** -8)
        np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=0, atol=scale * 2 ** -7)
    matches = c.report().to_dict()["matches"]
    assert [m["variant"].split("[")[0] for m in matches if m["pattern"] == "fusegraph.decode_attention"] == ["sdpa"]
    ops = [str(n.target) for n in c.imported.gm.graph.nodes if n.op == "call_function"]
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in ops and "aten.bmm.default" not in ops


def test_bf16_scores_rounded_before_the_softmax_are_left_as_is():
    """fp32 scores rounded to bf16 before the mask and softmax are neither HF form (eager rounds after every
    op, SDPA never): the attention stays as written (still correct)."""
    import ml_dtypes

    def rounded(q, k_cache, v_cache, mask):
        key = jnp.repeat(k_cache, H // KV, axis=2)
        value = jnp.repeat(v_cache, H // KV, axis=2)
        s = jnp.einsum("btnh,bsnh->bnts", q, key, preferred_element_type=jnp.float32) * D ** -0.5
        s = jnp.where(mask[:, None], s.astype(q.dtype).astype(jnp.float32), -1e9)
        p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
        return jnp.einsum("bnts,bsnh->btnh", p, value)

    args = _attention_args(6, dtype=ml_dtypes.bfloat16)
    c, out = _fused(rounded, *args)
    expected = np.asarray(jax.jit(rounded)(*args), np.float32)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=0, atol=np.abs(expected).max() * 2 ** -7)
    assert "fusegraph.decode_attention" not in c.report().to_dict()["pattern_counts"]


# ---- dense MoE experts (keras-hub's MixtralSparseMoeBlock) ---------------------------------------------------
E, HID, INTER, TOP = 4, 16, 8, 2


def keras_moe(params, x):
    """``MixtralSparseMoeBlock.call`` + ``MixtralMoeExpertBank.call``: softmax router, top-k renormalized,
    ``one_hot`` dense routing, every expert on every token, weighted sum over experts."""
    router_probs = jax.nn.softmax(x @ params["router"], axis=-1)
    top_p, top_i = jax.lax.top_k(router_probs, TOP)
    top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    one_hot = jax.nn.one_hot(top_i, E, dtype=top_p.dtype)
    routing_full = jnp.sum(one_hot * top_p[..., None], axis=1).T
    gate = jax.nn.silu(jnp.einsum("th,ehm->etm", x, params["gate"]))
    hidden = jnp.einsum("th,ehm->etm", x, params["up"]) * gate
    out = jnp.einsum("eti,eih->eth", hidden, params["down"])
    return jnp.sum(out * routing_full[:, :, None], axis=0)


def _moe_args(seed, tokens=3):
    rng = np.random.default_rng(seed)
    params = {"router": rng.normal(size=(HID, E)), "gate": rng.normal(size=(E, HID, INTER)) * 0.3,
              "up": rng.normal(size=(E, HID, INTER)) * 0.3, "down": rng.normal(size=(E, INTER, HID)) * 0.3}
    params = {k: jnp.asarray(v.astype(np.float32)) for k, v in params.items()}
    return params, jnp.asarray(rng.normal(size=(tokens, HID)).astype(np.float32))


def test_keras_dense_experts_import_as_hf_moe_experts_and_equal_jax():
    import fusegraph.jax as fj

    params, x = _moe_args(7)
    fused = fj.jit(keras_moe, options={"executor": "eager"})
    for seed in (7, 8):
        _, x = _moe_args(seed)
        out = fused(params, x)
        np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(keras_moe)(params, x)), rtol=1e-5, atol=1e-6)
    c = fused.last
    assert c.fallback is None and c.verified
    counts = c.report().to_dict()["pattern_counts"]
    assert counts.get("fusegraph.moe_experts") == 1
    experts = {s.experts[0]: s for s in c.imported.inputs if s.experts}
    assert experts["gate_up"].shape == (E, 2 * INTER, HID) and experts["down"].shape == (E, HID, INTER)
    assert not any(len(s.shape) == 3 and not s.experts for s in c.imported.inputs)  # Keras's own layout is gone
    ops = [str(n.target) for n in c.imported.gm.graph.nodes if n.op == "call_function"]
    assert ops.count("aten.bmm.default") == 2  # the chosen experts only, not E dense products


def test_dense_experts_with_a_shared_weight_are_left_as_is():
    """A weight that is also read elsewhere keeps its own layout: the experts stay dense (still correct)."""
    def shared(params, x):
        return keras_moe(params, x) + jnp.sum(params["gate"])

    params, x = _moe_args(9)
    c, out = _fused_with_params(shared, params, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(shared)(params, x)), rtol=1e-5, atol=1e-5)
    assert "fusegraph.moe_experts" not in c.report().to_dict()["pattern_counts"]


def _fused_with_params(fn, *args):
    import fusegraph.jax as fj

    fused = fj.jit(fn, options={"executor": "eager"})
    out = fused(*args)
    assert fused.last.fallback is None and fused.last.verified
    return fused.last, out


# ---- bf16 rounding: RMSNorm's fp32 weight product, SiLU in fp32 ------------------------------------------------
def keras_rmsnorm(x, scale):
    """keras-hub's ``LlamaLayerNorm.call`` under a bf16 policy: normalize in fp32, ``x * scale`` in fp32
    (the bf16 weight promoted), one cast back."""
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)
    return (h * scale.astype(jnp.float32)).astype(x.dtype)


def test_bf16_rmsnorm_with_fp32_weight_product_matches_its_variant():
    """Keras's fp32 weight product is the ``fp32_weight`` form of fusegraph.rmsnorm (OLMo-2's), lowered with
    one rounding; HF Llama's form (rounding before the product) would differ in the last bit."""
    import ml_dtypes

    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.normal(size=(1, 3, 64)).astype(ml_dtypes.bfloat16))
    w = jnp.asarray((1 + 0.5 * rng.normal(size=(64,))).astype(ml_dtypes.bfloat16))
    import fusegraph.jax as fj

    fused = fj.jit(lambda scale, h: keras_rmsnorm(h, scale), options={"executor": "eager"})  # the weight a param
    out = fused(w, x)
    c = fused.last
    assert c.fallback is None and c.verified
    expected = np.asarray(jax.jit(keras_rmsnorm)(x, w), np.float32)
    np.testing.assert_array_equal(np.asarray(out, np.float32), expected)
    matches = [m for m in c.report().to_dict()["matches"] if m["pattern"] == "fusegraph.rmsnorm"]
    assert [m["variant"].split("/")[0] for m in matches] == ["fp32_weight_cast"]


def keras_mlp(params, x):
    """keras-hub's ``LlamaTransformerDecoder`` feed-forward under a bf16 policy: ``ops.silu`` on the gate in fp32
    (convert, jax.nn.silu, convert back), times the up projection in bf16, down projection."""
    gate = jax.nn.silu((x @ params["gate"]).astype(jnp.float32)).astype(x.dtype)
    return (gate * (x @ params["up"])) @ params["down"]


def test_bf16_silu_in_fp32_rounded_once_is_torchs_bf16_silu():
    """``convert(silu(convert(g, f32)), bf16)`` is one rounding of the fp32 SiLU: what PyTorch's bf16 ``silu``
    computes, so the MLP is HF's swiglu (it was three unmatched ops before)."""
    import ml_dtypes

    import fusegraph.jax as fj

    rng = np.random.default_rng(12)
    params = {k: jnp.asarray((rng.normal(size=s) * 0.2).astype(ml_dtypes.bfloat16))
              for k, s in (("gate", (64, 96)), ("up", (64, 96)), ("down", (96, 64)))}
    x = jnp.asarray(rng.normal(size=(1, 64)).astype(ml_dtypes.bfloat16))
    fused = fj.jit(keras_mlp, options={"executor": "eager"})
    out = fused(params, x)
    c = fused.last
    assert c.fallback is None and c.verified
    expected = np.asarray(jax.jit(keras_mlp)(params, x), np.float32)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=0, atol=np.abs(expected).max() * 2 ** -7)
    assert c.report().to_dict()["pattern_counts"].get("fusegraph.swiglu") == 1
    ops = [str(n.target) for n in c.imported.gm.graph.nodes if n.op == "call_function"]
    assert "aten.silu.default" in ops and "aten._to_copy.default" not in ops
