"""keras-hub's MoE router under a bf16 policy (``MixtralSparseMoeBlock``: ``ops.softmax`` of the bf16 logits, top-2,
``values / ops.sum(values)``), written the way it lowers (no Keras needed): every op of the softmax and the
renormalization rounds to bf16, which is not HF's router (fp32 softmax) nor PyTorch's bf16 ``F.softmax`` (fp32
inside, one rounding). The importer emits it in one canonical ATen spelling, the ``rounded`` variant of
fusegraph.moe_router, whose kernel rounds at the same points (tests/codegen/test_router_rounded.py)."""
import numpy as np
import pytest
import torch

pytest.importorskip("jaxlib")  # not "jax": tests/jax itself would satisfy that
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_helpers import aten_ops, check_against_jax  # noqa: E402


def keras_router(weight, x):
    """``router_logits = x @ W``, ``ops.softmax`` (jax.nn.softmax on bf16), ``ops.top_k(k=2)``, renormalized."""
    probs = jax.nn.softmax(x @ weight, axis=-1)
    values, indices = jax.lax.top_k(probs, 2)
    return values / jnp.sum(values, axis=-1, keepdims=True), indices


def _args(seed=0, T=6, H=64, E=8):
    import ml_dtypes

    rng = np.random.default_rng(seed)
    w = jnp.asarray((rng.normal(size=(H, E)) * 0.5).astype(ml_dtypes.bfloat16))
    x = jnp.asarray(rng.normal(size=(T, H)).astype(ml_dtypes.bfloat16))
    return w, x


def test_bf16_softmax_imports_bit_exact_in_its_rounded_spelling():
    """The imported graph equals JAX bit for bit, with ``amax(keepdim)`` (not ``amax``, ``clamp(-inf)``, ``view``)
    and the fp32-accumulated sums rounded back, as the pattern variant writes them."""
    imported, _ = check_against_jax(keras_router, *_args(), rtol=0, atol=0)
    ops = aten_ops(imported)
    assert "aten.clamp.default" not in ops and "aten._softmax.default" not in ops
    assert ops.count("aten._to_copy.default") == 4 and ops.count("aten.div.Tensor") == 2


def test_rounded_softmax_is_not_torch_bf16_softmax():
    """Why the variant: PyTorch's bf16 softmax (fp32 inside, one rounding) differs from the rounded ops."""
    torch.manual_seed(0)
    logits = (torch.randn(64, 8) * 2).to(torch.bfloat16)
    e = torch.exp(logits - logits.amax(-1, keepdim=True))
    rounded = e / e.float().sum(-1, keepdim=True).to(e.dtype)
    assert not torch.equal(rounded, torch.softmax(logits, -1))


def test_keras_bf16_router_matches_the_rounded_variant():
    """fusegraph.jax.jit on the router: one fusegraph.moe_router match, variant ``rounded``, top_k 2, normalized;
    the result equals jax.jit's bit for bit (the eager executor runs the program's own ops)."""
    import fusegraph.jax as fj

    w, x = _args(1)
    fused = fj.jit(keras_router, options={"executor": "eager"})  # the weight a parameter
    got = fused(w, x)
    c = fused.last
    assert c.fallback is None and c.verified
    want = jax.jit(keras_router)(w, x)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    matches = [m for m in c.report().to_dict()["matches"] if m["pattern"] == "fusegraph.moe_router"]
    assert [m["variant"] for m in matches] == ["rounded[normalize=True]/bfloat16"], matches


def keras_moe_bf16(params, x):
    """keras-hub's ``MixtralSparseMoeBlock`` under a bf16 policy: the router above, ``one_hot`` dense routing,
    every expert on every token with Keras's bf16 SiLU (``convert``, silu in fp32, ``convert``), and the sum over
    experts (``jnp.sum`` of bf16: accumulated in fp32, rounded once)."""
    top_p, top_i = keras_router(params["router"], x)
    one_hot = jax.nn.one_hot(top_i, params["gate"].shape[0], dtype=top_p.dtype)
    routing_full = jnp.sum(one_hot * top_p[..., None], axis=1).T
    gate = jax.nn.silu(jnp.einsum("th,ehm->etm", x, params["gate"]).astype(jnp.float32)).astype(x.dtype)
    hidden = jnp.einsum("th,ehm->etm", x, params["up"]) * gate
    out = jnp.einsum("eti,eih->eth", hidden, params["down"])
    return jnp.sum(out * routing_full[:, :, None], axis=0)


def test_keras_bf16_moe_block_is_hf_router_and_experts():
    """The whole bf16 block: the router as moe_router's ``rounded`` variant, the dense experts (expert sum in
    fp32, rounded once) as HF's bf16 batched_mm ``moe_experts``, within a bf16 ulp of JAX's value."""
    import ml_dtypes

    import fusegraph.jax as fj

    rng = np.random.default_rng(3)
    E, H, I = 8, 32, 16
    params = {"router": rng.normal(size=(H, E)) * 0.5, "gate": rng.normal(size=(E, H, I)) * 0.3,
              "up": rng.normal(size=(E, H, I)) * 0.3, "down": rng.normal(size=(E, I, H)) * 0.3}
    params = {k: jnp.asarray(v.astype(ml_dtypes.bfloat16)) for k, v in params.items()}
    x = jnp.asarray(rng.normal(size=(3, H)).astype(ml_dtypes.bfloat16))
    fused = fj.jit(keras_moe_bf16, options={"executor": "eager"})
    out = np.asarray(fused(params, x), np.float32)
    c = fused.last
    assert c.fallback is None and c.verified
    want = np.asarray(jax.jit(keras_moe_bf16)(params, x), np.float32)
    np.testing.assert_allclose(out, want, rtol=0, atol=np.abs(want).max() * 2 ** -7)
    counts = c.report().to_dict()["pattern_counts"]
    assert counts.get("fusegraph.moe_router") == 1 and counts.get("fusegraph.moe_experts") == 1, counts
    ops = [str(n.target) for n in c.imported.gm.graph.nodes if n.op == "call_function"]
    assert ops.count("aten.bmm.default") == 2  # the chosen experts only, not E dense products
