"""Bad input never crashes: ops the importer does not translate run the JAX function as is, with one warning
naming the op; a fused step whose result differs from JAX's falls back to JAX."""
import warnings

import numpy as np
import pytest

pytest.importorskip("jaxlib")  # not "jax": tests/jax itself would satisfy that
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import fusegraph.jax as fj  # noqa: E402
from fusegraph.warnings import FusegraphWarning, reset_warnings  # noqa: E402


def _calls(fn, *args, n=2, **kw):
    reset_warnings()
    fused = fj.jit(fn, options={"executor": "eager"}, **kw)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        outs = [fused(*args) for _ in range(n)]
    messages = [str(x.message) for x in w if issubclass(x.category, FusegraphWarning)]
    return fused, outs, messages


CASES = {
    "stablehlo.while": lambda x: lax.fori_loop(0, 3, lambda i, v: v * 2 + i, x),
    "stablehlo.scatter": lambda x: x.at[jnp.asarray([0, 2])].multiply(2.0),  # set and add are translated
    "stablehlo.custom_call": lambda x: jnp.linalg.cholesky(x @ x.T + 4 * jnp.eye(4)),
    "stablehlo.rng_bit_generator": lambda x: x + jax.random.uniform(jax.random.key(0, impl="rbg"), x.shape),
}


@pytest.mark.parametrize("op", sorted(CASES))
def test_unsupported_op_runs_jax_with_one_warning(op):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32))
    fn = CASES[op]
    fused, outs, messages = _calls(fn, x, params_argnums=())
    expected = np.asarray(jax.jit(fn)(x))
    for out in outs:
        np.testing.assert_array_equal(np.asarray(out), expected)
    assert len(messages) == 1, messages
    assert op in messages[0] and "running the JAX function as is" in messages[0]
    assert fused.last.fallback is not None


def test_mismatch_against_jax_falls_back(monkeypatch):
    """Verification of the first call: a translation that computes something else is caught, warned about,
    and JAX's result is returned (here: the importer is made to translate tanh as sigmoid)."""
    import torch

    from fusegraph.stablehlo import emit

    monkeypatch.setitem(emit._UNARY, "stablehlo.tanh", torch.sigmoid)
    x = jnp.linspace(-2, 2, 16, dtype=jnp.float32).reshape(4, 4)
    fused, outs, messages = _calls(jnp.tanh, x, params_argnums=())
    for out in outs:
        np.testing.assert_allclose(np.asarray(out), np.tanh(np.asarray(x)), rtol=1e-6)
    assert len(messages) == 1 and "differs from jax.jit" in messages[0]


def test_a_failing_call_falls_back_for_that_call_only(monkeypatch):
    """A fused call that fails at run time (here: the runner made to raise on chosen calls) returns JAX's result
    for that call only; the next call runs fused again. Three failing calls in a row retire the fused step."""
    fn = lambda x: jnp.tanh(x) * 2 + 1  # noqa: E731
    x = jnp.linspace(-2, 2, 16, dtype=jnp.float32).reshape(4, 4)
    reset_warnings()
    fused = fj.jit(fn, options={"executor": "eager"}, params_argnums=())
    fused(x)
    c = fused.last
    real = c.runner
    fail_on = {1, 3, 4, 5}
    calls = {"n": 0}

    def flaky(inputs):
        calls["n"] += 1
        if calls["n"] in fail_on:
            raise RuntimeError("injected run-time failure")
        return real(inputs)

    c.runner = flaky
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for k in range(1, 7):
            np.testing.assert_allclose(np.asarray(fused(x)), np.asarray(jax.jit(fn)(x)), rtol=1e-6)
            assert (c.fallback is not None) == (k >= 5), k
    messages = [str(m.message) for m in w if issubclass(m.category, FusegraphWarning)]
    assert any("this call runs the JAX function" in m for m in messages), messages
    assert any("3 calls in a row" in m for m in messages), messages
    assert calls["n"] == 5  # call 6 ran JAX without trying the fused step
