"""keras-hub's own JAX models (Keras 3, JAX backend), random weights, decoded with their own call_with_cache:
fusegraph.jax.jit equals jax.jit (greedy tokens over 8 steps, logits), on the models' real StableHLO. Keras's
stacked KV cache, [B, T, heads, D] attention and RoPE are imported in HF's forms (tests/jax/test_keras_idioms.py),
so the Llama step is one decoder-stack megakernel, one launch per step, in fp32 and bf16 (docs/jax.md)."""
import os
import warnings

import numpy as np
import pytest

pytest.importorskip("jaxlib")  # not "jax": tests/jax itself would satisfy that
import jax  # noqa: E402
os.environ.setdefault("KERAS_BACKEND", "jax")  # before Keras is first imported (its default is TensorFlow)
pytest.importorskip("keras_hub")
import jax.numpy as jnp  # noqa: E402

import fusegraph.jax as fj  # noqa: E402
from fusegraph.jax.keras_models import build_keras_case  # noqa: E402


def _greedy(case, steps):
    fused = fj.jit(case.step, donate_argnums=(1,), options={"executor": "nkisim"})
    ref = jax.jit(case.step)
    params, cache, tok, index = case.args()
    rcache, rtok = cache, tok
    rel, launches = [], []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is not lowered.*")  # fragments codegen leaves to eager
        for _ in range(steps):
            logits, cache = fused(params, cache, tok, index)
            rlogits, rcache = ref(params, rcache, rtok, index)
            rel.append(float(jnp.abs(logits - rlogits).max() / jnp.abs(rlogits).max()))
            tok = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None]
            rtok = jnp.argmax(rlogits[:, -1], -1).astype(jnp.int32)[:, None]
            assert np.array_equal(np.asarray(tok), np.asarray(rtok))
            launches.append(fused.last.launches_per_step)
            index = index + 1
    got, want = np.asarray(cache).astype(np.float32), np.asarray(rcache).astype(np.float32)
    if case.dtype == "float32":
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    else:  # bf16: a few ulps of the cache's scale
        np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2 * float(np.abs(want).max()))
    return fused, rel, launches


def _one_megakernel(fused):
    """The last compile ran as one verified decoder-stack kernel on the interpreter: its step, report and counts."""
    c = fused.last
    assert c.fallback is None and c.verified
    data = c.report().to_dict()
    assert [r["kind"] for r in data["regions"]] == ["decoder_stack"]
    assert data["regions"][0]["executed_by"] == "nkisim"
    return c, data, data["pattern_counts"]


def test_keras_llama_is_one_megakernel_and_equals_jax():
    fused, rel, launches = _greedy(build_keras_case("keras-llama-tiny"), steps=8)
    assert max(rel) < 1e-4
    assert launches == [1] * 8
    c, data, counts = _one_megakernel(fused)
    for name, n in {"fusegraph.decode_attention": 2, "fusegraph.kv_cache_update": 4, "fusegraph.rope": 4,
                    "fusegraph.rope_tables": 1, "fusegraph.linear": 15, "fusegraph.rmsnorm": 5,
                    "fusegraph.swiglu": 2, "fusegraph.embedding": 1}.items():
        assert counts.get(name) == n, (name, counts)
    assert c.report().analysis.coverage > 0.8
    assert sorted(c.program.layers()) == [0, 1]
    # the split cache: one [B, KV, L, D] state input per layer and k/v, written in place
    parts = [s for s in c.imported.inputs if s.part is not None]
    assert len(parts) == 4 and all(s.kind == "state" for s in parts)


@pytest.mark.slow
def test_keras_mixtral_moe_is_one_megakernel_and_equals_jax():
    fused, rel, launches = _greedy(build_keras_case("keras-mixtral-tiny"), steps=8)
    assert max(rel) < 1e-4
    assert launches == [1] * 8
    c, data, counts = _one_megakernel(fused)
    for name, n in {"fusegraph.moe_experts": 2, "fusegraph.moe_router": 2, "fusegraph.decode_attention": 2,
                    "fusegraph.kv_cache_update": 4, "fusegraph.rope": 4, "fusegraph.rope_tables": 1,
                    "fusegraph.rmsnorm": 5, "fusegraph.linear": 9, "fusegraph.embedding": 1}.items():
        assert counts.get(name) == n, (name, counts)
    assert c.report().analysis.coverage > 0.75
    # the experts' weights in HF's layout: one [E, 2I, H] gate_up and one [E, H, I] down input per layer
    assert sorted(s.experts[0] for s in c.imported.inputs if s.experts) == ["down", "down", "gate_up", "gate_up"]


def _only_the_lookup_fill_is_generic(c, data):
    """No bf16 op runs as a generic piece in place of a pattern's rounding; the one generic piece is Keras's
    ``ops.take`` fill (``jnp.take``: NaN rows for out-of-range ids), a ``where`` on the looked-up rows (exact; in
    the kernel on generic lowering's tensor path)."""
    G = c.program.graph
    generic = [m for m in data["matches"] if m["pattern"] == "fusegraph.generic"]
    assert all(m["params"]["ops"] == {"aten.where.self": 1} and G.nodes[m["nodes"][0]].get("module") == "token_embedding"
               for m in generic), [(m["params"]["ops"], m["nodes"]) for m in generic]


@pytest.mark.slow
def test_keras_llama_bf16_is_one_megakernel_and_equals_jax():
    """bf16: Keras's roundings are HF forms too: RMSNorm's fp32 weight product (OLMo-2's, the ``fp32_weight``
    variant), jax.nn.dot_product_attention's fp32 scores (HF's SDPA), ``ops.silu`` in fp32 rounded once (torch's
    bf16 silu), the rotary tables cast once (HF's ``cos.to(x.dtype)``): one decoder-stack launch per step."""
    fused, rel, launches = _greedy(build_keras_case("keras-llama-tiny", dtype="bfloat16"), steps=8)
    assert max(rel) < 3e-2
    assert launches == [1] * 8
    c, data, counts = _one_megakernel(fused)
    for name, n in {"fusegraph.decode_attention": 2, "fusegraph.kv_cache_update": 4, "fusegraph.rope": 4,
                    "fusegraph.rope_tables": 1, "fusegraph.linear": 15, "fusegraph.rmsnorm": 5,
                    "fusegraph.swiglu": 2, "fusegraph.embedding": 1}.items():
        assert counts.get(name) == n, (name, counts)
    _only_the_lookup_fill_is_generic(c, data)
    variants = {(m["pattern"], m["variant"].split("[")[0].split("/")[0]) for m in data["matches"]}
    assert ("fusegraph.rmsnorm", "fp32_weight_cast") in variants and ("fusegraph.decode_attention", "sdpa") in variants
    assert ("fusegraph.rmsnorm", "default") not in variants


@pytest.mark.slow
def test_keras_mixtral_bf16_equals_jax():
    """bf16 Mixtral is one decoder-stack megakernel, one launch per step. Its router rounds where HF Mixtral's does
    not (Keras's softmax runs in bf16: ``exp`` in bf16, the sum accumulated in fp32 and rounded to bf16, the
    division in bf16; the top-2 and the renormalization in bf16): moe_router's ``rounded`` variant, lowered with
    the same roundings; the dense experts (the expert sum in fp32, rounded once) are HF's bf16 batched_mm experts;
    attention (bf16 scores: HF eager's form), RMSNorm, RoPE and cache match."""
    fused, rel, launches = _greedy(build_keras_case("keras-mixtral-tiny", dtype="bfloat16"), steps=8)
    assert max(rel) < 3e-2
    assert launches == [1] * 8
    c, data, counts = _one_megakernel(fused)
    for name, n in {"fusegraph.moe_router": 2, "fusegraph.moe_experts": 2, "fusegraph.decode_attention": 2,
                    "fusegraph.kv_cache_update": 4, "fusegraph.rope": 4, "fusegraph.rope_tables": 1,
                    "fusegraph.rmsnorm": 5, "fusegraph.linear": 9, "fusegraph.embedding": 1}.items():
        assert counts.get(name) == n, (name, counts)
    _only_the_lookup_fill_is_generic(c, data)
    routers = [m["variant"] for m in data["matches"] if m["pattern"] == "fusegraph.moe_router"]
    assert routers == ["rounded[normalize=True]/bfloat16"] * 2
    assert c.report().analysis.coverage > 0.8
