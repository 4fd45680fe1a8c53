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


def test_bf16_attention_keeps_jaxs_fp32_scores():
    """jax.nn.dot_product_attention computes bf16 scores in fp32; HF's form rounds them to bf16, so it is not
    the same function and the import keeps JAX's (the pattern does not match)."""
    import ml_dtypes

    args = _attention_args(6, dtype=ml_dtypes.bfloat16)
    c, out = _fused(keras_attention, *args)
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
