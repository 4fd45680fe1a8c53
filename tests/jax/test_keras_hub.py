"""keras-hub's own JAX models (Keras 3, JAX backend), random weights, decoded with their own call_with_cache:
fusegraph.jax.jit equals jax.jit (greedy tokens over 8 steps, logits), on the models' real StableHLO. What of
them fuses is what the report says (see docs/jax.md: the projections, norms and MLPs; not yet their attention,
RoPE or stacked KV cache)."""
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
    rel = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is not lowered.*")  # fragments codegen leaves to eager
        for _ in range(steps):
            logits, cache = fused(params, cache, tok, index)
            rlogits, rcache = ref(params, rcache, rtok, index)
            rel.append(float(jnp.abs(logits - rlogits).max() / jnp.abs(rlogits).max()))
            tok = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None]
            rtok = jnp.argmax(rlogits[:, -1], -1).astype(jnp.int32)[:, None]
            assert np.array_equal(np.asarray(tok), np.asarray(rtok))
            index = index + 1
    np.testing.assert_allclose(np.asarray(cache), np.asarray(rcache), rtol=1e-4, atol=1e-5)
    return fused, rel


def test_keras_llama_equals_jax_and_fuses_its_projections():
    fused, rel = _greedy(build_keras_case("keras-llama-tiny"), steps=8)
    assert max(rel) < 1e-4
    c = fused.last
    assert c.fallback is None and c.verified
    data = c.report().to_dict()
    counts = data["pattern_counts"]
    assert counts.get("fusegraph.linear", 0) >= 13 and counts.get("fusegraph.rmsnorm") == 5
    assert counts.get("fusegraph.swiglu") == 2 and counts.get("fusegraph.embedding") == 1
    assert c.launches_per_step >= 1
    assert sorted(c.program.layers()) == [0, 1]


@pytest.mark.slow
def test_keras_mixtral_moe_equals_jax():
    fused, rel = _greedy(build_keras_case("keras-mixtral-tiny"), steps=8)
    assert max(rel) < 1e-4
    assert fused.last.fallback is None and fused.last.verified
    counts = fused.last.report().to_dict()["pattern_counts"]
    assert counts.get("fusegraph.rmsnorm") == 5 and counts.get("fusegraph.linear", 0) >= 7
    assert counts.get("fusegraph.moe_router") == 2  # the router's softmax + top-k, from JAX's lax.top_k
