"""fusegraph.jax.jit on the hand-written JAX Llama decode step: one megakernel per step in the NKI interpreter,
greedy tokens equal to jax.jit over 8 steps, logits within tolerance, KV cache written in place."""
import warnings

import numpy as np
import pytest

pytest.importorskip("jaxlib")  # not "jax": tests/jax itself would satisfy that
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fusegraph.jax as fj  # noqa: E402
from fusegraph.jax.models import build_llama_case  # noqa: E402


def _decode(case, steps=8, options=None):
    fused = fj.jit(case.step, donate_argnums=(1,), options={"executor": "nkisim", **(options or {})})
    ref = jax.jit(case.step)
    params, cache, tok, pos = case.args()
    rcache, rtok = cache, tok
    tokens, ref_tokens, diffs, scales, launches = [], [], [], [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any fusegraph fallback warning fails the test
        for _ in range(steps):
            logits, cache = fused(params, cache, tok, pos)
            rlogits, rcache = ref(params, rcache, rtok, pos)
            diffs.append(float(jnp.abs(logits.astype(jnp.float32) - rlogits.astype(jnp.float32)).max()))
            scales.append(float(jnp.abs(rlogits.astype(jnp.float32)).max()))
            tok = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None]
            rtok = jnp.argmax(rlogits[:, -1], -1).astype(jnp.int32)[:, None]
            tokens.append(np.asarray(tok))
            ref_tokens.append(np.asarray(rtok))
            launches.append(fused.last.launches_per_step)
            pos = pos + 1
    cache_diff = max(float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
                     for a, b in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(rcache)))
    return fused, tokens, ref_tokens, diffs, scales, launches, cache_diff


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_llama_step_one_megakernel_tokens_equal_jax(dtype, tol):
    case = build_llama_case(dtype=dtype)
    fused, tokens, ref_tokens, diffs, scales, launches, cache_diff = _decode(case)
    assert [t.tolist() for t in tokens] == [t.tolist() for t in ref_tokens]
    assert max(d / s for d, s in zip(diffs, scales)) < tol, diffs
    assert cache_diff <= tol * 10
    assert launches == [1] * 8
    c = fused.last
    assert c.verified and c.fallback is None
    report = c.report()
    data = report.to_dict()
    assert len(data["regions"]) == 1 and data["regions"][0]["kind"] == "decoder_stack"
    counts = data["pattern_counts"]
    for name, n in {"fusegraph.decode_attention": 2, "fusegraph.kv_cache_update": 4, "fusegraph.rmsnorm": 5,
                    "fusegraph.linear": 15, "fusegraph.rope": 4, "fusegraph.swiglu": 2,
                    "fusegraph.embedding": 1, "fusegraph.rope_tables": 1}.items():
        assert counts.get(name) == n, (name, counts)
    assert report.analysis.coverage > 0.85
    # what is not in a region is the index arithmetic and the mask, on the host path (named in the report)
    unmatched = {u["op"] for u in data["unmatched"]}
    assert unmatched <= {"aten.add.Tensor", "aten.clamp.default", "aten.lt.Scalar", "aten.view.default",
                         "aten.where.self", "aten.arange.default", "aten.le.Tensor", "aten.scalar_tensor.default",
                         "aten.zeros.default"}, unmatched


def test_inputs_are_classified_like_the_torch_path():
    from fusegraph.program import InputKind

    case = build_llama_case(dtype="float32")
    fused = fj.jit(case.step, donate_argnums=(1,), options={"dryrun": True})
    c = fused.compile(*case.args())
    kinds = {}
    for pin in c.program.inputs():
        kinds.setdefault(pin.kind, []).append(pin)
    assert len(kinds[InputKind.WEIGHT]) == 1 + 2 * 9 + 2  # embed, 9 per layer, final norm, lm_head
    assert len(kinds[InputKind.STATE]) == 4 and all(p.source.startswith("cache[") for p in kinds[InputKind.STATE])
    assert len(kinds[InputKind.STEP]) == 2 and len(kinds[InputKind.BUFFER]) == 1  # token/position; inv_freq
    layers = {p.module: c.program.graph.nodes[p.node]["layer"] for p in kinds[InputKind.WEIGHT]}
    assert layers["layers.1.wq"] == 1 and layers["embed"] is None
    writes = [c.program.graph.nodes[n]["op"] for g in c.program.graphs for n in g.state_writes.values()]
    assert writes == ["aten.index_copy_.default"] * 4


def test_donated_cache_is_not_required_for_correctness():
    """Without donation the cache is no state (JAX keeps both arrays): the step still equals jax.jit."""
    case = build_llama_case(dtype="float32", prompt_len=3)
    fused = fj.jit(case.step, options={"executor": "eager"})
    out, cache = fused(*case.args())
    rout, rcache = jax.jit(case.step)(*case.args())
    np.testing.assert_allclose(np.asarray(out), np.asarray(rout), rtol=1e-5, atol=1e-5)
    assert fused.last.fallback is None
