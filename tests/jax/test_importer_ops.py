"""The StableHLO importer, op by op: each JAX function is lowered by JAX, imported, run through PyTorch and
compared with JAX's own result (JAX is the numerical reference). Also the idioms it turns into one ATen op."""
import numpy as np
import pytest

pytest.importorskip("jaxlib")  # not "jax": tests/jax itself would satisfy that
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from jax_helpers import aten_ops, check_against_jax  # noqa: E402

rng = np.random.default_rng(0)
X = jnp.asarray(rng.normal(size=(3, 4, 8)).astype(np.float32))
Y = jnp.asarray(rng.normal(size=(3, 4, 8)).astype(np.float32))
POS = jnp.asarray(np.abs(rng.normal(size=(3, 4, 8))).astype(np.float32) + 0.1)
I = jnp.asarray(rng.integers(-20, 20, size=(3, 4)).astype(np.int32))
J = jnp.asarray(rng.integers(1, 7, size=(3, 4)).astype(np.int32))

BINARY = {
    "add": jnp.add, "subtract": jnp.subtract, "multiply": jnp.multiply, "divide": jnp.divide,
    "maximum": jnp.maximum, "minimum": jnp.minimum, "remainder": lambda a, b: lax.rem(a, b),
    "atan2": jnp.arctan2,
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary(name):
    check_against_jax(BINARY[name], X, Y)


def test_power():
    check_against_jax(lambda a, b: lax.pow(a, b), POS, Y, rtol=1e-5)


UNARY = {
    "negate": jnp.negative, "exponential": jnp.exp, "log": lambda x: jnp.log(jnp.abs(x) + 1), "sqrt": lambda x: jnp.sqrt(jnp.abs(x)),
    "rsqrt": lambda x: lax.rsqrt(jnp.abs(x) + 0.5), "tanh": jnp.tanh, "logistic": lax.logistic, "sine": jnp.sin,
    "cosine": jnp.cos, "abs": jnp.abs, "floor": jnp.floor, "ceil": jnp.ceil, "sign": jnp.sign, "expm1": jnp.expm1,
    "log1p": lambda x: jnp.log1p(jnp.abs(x)), "round": jnp.round, "erf": lax.erf, "square": jnp.square,
    "is_finite": jnp.isfinite, "tan": lambda x: jnp.tan(x * 0.3), "cbrt": jnp.cbrt,
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name):
    check_against_jax(UNARY[name], X, rtol=1e-5, atol=1e-6)


def test_integer_arithmetic_and_compare_select():
    def f(i, j):
        return lax.div(i, j), lax.rem(i, j), jnp.where(i > 0, i * j, -i), i == j, jnp.logical_not(i < j)

    check_against_jax(f, I, J)


def test_clamp_convert_and_bool_ops():
    def f(x, y):
        b = (x > 0) & (y < 0) | (x > y)
        return jnp.clip(x, -0.5, 0.5), x.astype(jnp.int32), b.astype(jnp.float32), x.astype(jnp.bfloat16)

    check_against_jax(f, X, Y)


def test_layout_ops():
    def f(x):
        a = jnp.transpose(x, (2, 0, 1))
        b = x.reshape(12, 8)[:, 2:7:2]
        c = jnp.concatenate([x, x * 2], axis=1)
        d = jnp.pad(x, ((1, 0), (0, 2), (0, 0)), constant_values=3.0)
        e = jnp.flip(x, axis=(0, 2))
        f_ = jnp.broadcast_to(x[:, None], (3, 5, 4, 8))
        return a, b, c, d, e, f_, jnp.arange(7) * 2, lax.broadcasted_iota(jnp.int32, (3, 4), 1)

    check_against_jax(f, X)


def test_dot_general_forms():
    w = jnp.asarray(rng.normal(size=(8, 6)).astype(np.float32))
    w3 = jnp.asarray(rng.normal(size=(8, 2, 3)).astype(np.float32))

    def f(x, y, w, w3):
        linear = x @ w  # x[..., K] @ W[K, N]
        linear_t = x @ w.T.T  # the same through transposes
        batched = jnp.matmul(x, jnp.swapaxes(y, 1, 2))  # [3,4,8] x [3,8,4]
        general = jnp.einsum("bqd,bkd->bqk", x, y)
        einsum_dense = jnp.einsum("bqm,muh->bquh", x, w3)
        other = jnp.einsum("bqd,qd->bq", x, y[0])
        return linear, linear_t, batched, general, einsum_dense, other

    check_against_jax(f, X, Y, w, w3, rtol=1e-5, atol=1e-5)


def test_weights_become_linear_on_the_transposed_weight():
    """``x @ W`` on a parameter: the program receives ``W.T`` and computes ``linear`` (HF's layout and ops)."""
    w = jnp.asarray(rng.normal(size=(8, 6)).astype(np.float32))
    w3 = jnp.asarray(rng.normal(size=(8, 2, 3)).astype(np.float32))
    imported, _ = check_against_jax(lambda w, w3, x: (x @ w, jnp.einsum("bqm,muh->bquh", x, w3)), w, w3, X,
                                    arg_kinds=["weight", "weight", "step"], rtol=1e-5, atol=1e-5)
    specs = imported.inputs
    assert specs[0].transpose and specs[0].shape == (6, 8)
    assert specs[1].transpose and specs[1].shape == (6, 8) and specs[1].contract == 1
    assert aten_ops(imported).count("aten.mm.default") == 2 and aten_ops(imported).count("aten.t.default") == 2


def test_reductions():
    def f(x, b):
        return (x.sum(axis=(0, 2)), x.max(axis=1), x.min(axis=-1), jnp.prod(x[:, :2, :3], axis=1),
                jnp.all(b, axis=1), jnp.any(b, axis=0), jnp.argmax(x, axis=-1), jnp.argmin(x, axis=1),
                jnp.sum(x, axis=-1, keepdims=True))

    check_against_jax(f, X, X > 0, rtol=1e-5)


def test_idioms_mean_softmax_silu_square():
    """jnp.mean / jax.nn.softmax / jax.nn.silu / x*x become the single ATen ops captured PyTorch code has."""
    def f(x):
        return (jnp.mean(jnp.square(x), axis=-1, keepdims=True), jax.nn.softmax(x, axis=-1), jax.nn.silu(x),
                x * x, jax.nn.sigmoid(x))

    imported, _ = check_against_jax(f, X, rtol=1e-5)
    ops = aten_ops(imported)
    for op in ("aten.mean.dim", "aten._softmax.default", "aten.silu.default", "aten.pow.Tensor_Scalar",
               "aten.sigmoid.default"):
        assert op in ops, (op, ops)
    assert "aten.exp.default" not in ops and "aten.amax.default" not in ops


def test_gather_embedding_and_general():
    table = jnp.asarray(rng.normal(size=(10, 8)).astype(np.float32))
    tok = jnp.asarray([[1, 9], [0, 3], [-1, 4]], dtype=jnp.int32)  # -1: JAX's negative index wraps
    idx = jnp.asarray(rng.integers(0, 8, size=(3, 4, 2)).astype(np.int32))

    def f(table, tok, x, idx):
        return table[tok], jnp.take_along_axis(x, idx, axis=-1), x[:, 1], x[jnp.asarray([2, 0])]

    imported, _ = check_against_jax(f, table, tok, X, idx)
    assert "aten.embedding.default" in aten_ops(imported)


def test_dynamic_slice_and_update_slice():
    cache = jnp.asarray(rng.normal(size=(2, 3, 16, 4)).astype(np.float32))
    new = jnp.asarray(rng.normal(size=(2, 3, 1, 4)).astype(np.float32))
    new2 = jnp.asarray(rng.normal(size=(2, 1, 2, 4)).astype(np.float32))

    def f(cache, new, new2, p):
        a = lax.dynamic_update_slice(cache, new, (0, 0, p, 0))  # the KV-cache write
        b = lax.dynamic_update_slice(cache, new2, (0, p % 3, p, 0))  # two moving dims
        c = lax.dynamic_slice(cache, (0, 1, p, 0), (2, 2, 3, 4))
        d = lax.dynamic_update_slice(cache, new, (0, 0, 40, 0))  # clamped to the last row, as StableHLO does
        return a, b, c, d

    for p in (0, 5, 15):
        imported, _ = check_against_jax(f, cache, new, new2, jnp.asarray(p, jnp.int32))
    assert "aten.index_copy.default" in aten_ops(imported)


def test_sort_and_top_k():
    x = jnp.asarray(rng.permutation(24).reshape(3, 8).astype(np.float32))

    def f(x):
        v, i = lax.top_k(x, 3)
        s = jnp.sort(x, axis=-1)
        a = jnp.argsort(-x, axis=-1)
        return v, i, s, a

    check_against_jax(f, x)


def test_private_functions_are_inlined_with_the_callers_scope():
    def f(x):
        with jax.named_scope("layers.3"):
            return jnp.where(x > 0, x, 0.0) + jax.nn.silu(x)

    imported, text = check_against_jax(f, X)
    assert "func.func private" in text
    layers = {n.meta["nn_module_stack"].popitem()[0] for n in imported.gm.graph.nodes if n.op == "call_function"
              and "nn_module_stack" in n.meta and len(n.meta["nn_module_stack"]) > 1}
    assert layers == {"L['self'].layers.3"}


def test_bf16():
    xb, yb = X.astype(jnp.bfloat16), Y.astype(jnp.bfloat16)
    check_against_jax(lambda a, b: (jax.nn.softmax(a.astype(jnp.float32)).astype(jnp.bfloat16) * b + 0.5,
                                    jnp.mean(a * b, axis=-1)), xb, yb, rtol=1e-2, atol=1e-2)


def test_more_elementwise_and_barrier():
    def f(x):
        y = lax.optimization_barrier(x)
        return (lax.erf_inv(jnp.tanh(y) * 0.9), lax.lgamma(jnp.abs(y) + 0.5), lax.digamma(jnp.abs(y) + 0.5),
                lax.round(y * 3, lax.RoundingMethod.AWAY_FROM_ZERO), lax.round(y * 3, lax.RoundingMethod.TO_NEAREST_EVEN))

    check_against_jax(f, X, rtol=1e-4, atol=1e-5)


def test_every_handled_op_is_listed():
    from fusegraph.stablehlo.emit import supported_ops

    ops = supported_ops()
    for name in ("stablehlo.dot_general", "stablehlo.broadcast_in_dim", "stablehlo.reduce", "stablehlo.rsqrt",
                 "stablehlo.logistic", "stablehlo.dynamic_update_slice", "stablehlo.gather", "stablehlo.sort",
                 "chlo.top_k", "func.call"):
        assert name in ops
