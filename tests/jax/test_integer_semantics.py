"""XLA's integer semantics through ``fusegraph.jax.jit``: every case is compared with ``jax.jit`` on the same
inputs, exactly (values and dtype), on a first call (verified against JAX: it must pass, not fall back) and on
later calls of a step verified on harmless inputs (those calls are not checked: fusegraph must be right by
itself). ``i32`` computes as PyTorch int64 (docs/jax.md): products and sums that overflow must still wrap at 32
bits where a compare, a division or a convert reads them; float -> int converts saturate; integer division by
zero and ``MIN / -1`` give XLA's values instead of raising."""
import subprocess
import sys
import warnings

import numpy as np
import pytest

pytest.importorskip("jaxlib")  # not "jax": tests/jax itself would satisfy that
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import fusegraph.jax as fj  # noqa: E402
from jax_helpers import aten_ops, import_jax  # noqa: E402

MIN32, MAX32 = -2 ** 31, 2 ** 31 - 1


def _arr(values, dtype):
    return jnp.asarray(np.array(values, dtype=dtype))


def _same(got, expected):
    g, e = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)
    assert len(g) == len(e)
    for a, b in zip(g, e):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        np.testing.assert_array_equal(a, b)


def _step(f):
    return fj.jit(f, params_argnums=(), options={"executor": "nkisim"})


def _harmless(args):
    return [jnp.ones_like(a) for a in args]


def check(f, *args, refused=None):
    """``f(*args)`` through fusegraph equals ``jax.jit`` on the first call and on later (unverified) calls."""
    ref = jax.jit(f)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _step(f)
        _same(first(*args), ref(*args))  # the verified first call
        later = _step(f)
        _same(later(*_harmless(args)), ref(*_harmless(args)))
        for _ in range(2):  # calls after the verified one are not compared with JAX
            _same(later(*args), ref(*args))
    fused = [str(w.message) for w in caught if "fusegraph" in str(w.message)]
    if refused is None:
        assert first.last.fallback is None and later.last.fallback is None, (first.last.reason, later.last.reason)
        assert first.last.verified and later.last.verified
        assert not fused, fused
    else:  # an op fusegraph cannot compute exactly is not lowered: one warning naming it, JAX runs
        assert first.last.fallback is not None and refused in first.last.reason, first.last.reason
        assert any(refused in m for m in fused), fused
    return first


# ---- int32 wraps at 32 bits ---------------------------------------------------------------------------------
BIG_A = _arr([100000, 3, 65536, -70000, MAX32, MIN32], np.int32)
BIG_B = _arr([50000, 4, 65536, 80000, 2, 3], np.int32)

WRAPPING = {
    "product_then_divide": lambda a, b: (a * b) // 7,  # the robustness sweep's case
    "product_then_trunc_divide": lambda a, b: lax.div(a * b, jnp.int32(13)),
    "product_then_remainder": lambda a, b: lax.rem(a * b, jnp.int32(1000)),
    "sum_then_compare": lambda a, b: (a + b) < 0,
    "difference_then_compare": lambda a, b: (a - b) > a,
    "product_then_max": lambda a, b: jnp.maximum(a * b, jnp.int32(0)),
    "product_then_min_of_tensors": lambda a, b: jnp.minimum(a * b, b),
    "product_then_float": lambda a, b: (a * b).astype(jnp.float32),
    "product_then_clip": lambda a, b: jnp.clip(a * b, -5, 5),
    "product_then_index": lambda a, b: jnp.arange(10, dtype=jnp.int32)[jnp.clip(a * b, 0, 9)],
    "negate_min_then_compare": lambda a, b: -a > 0,
    "abs_min_as_result": lambda a, b: (jnp.abs(a), -a),  # not compared: LLVM takes abs(MIN) for poison
    "chained_products": lambda a, b: (a * b * a * b + 1) // 3,
    "reduced_sum_then_compare": lambda a, b: jnp.sum(a * b) > 0,
    "product_then_xor_then_compare": lambda a, b: ((a * b) ^ b) < 0,
    "product_then_narrowing_convert": lambda a, b: (a * b).astype(jnp.int8),
    "product_as_result": lambda a, b: a * b,
    "product_then_sign": lambda a, b: jnp.sign(a * b),
    "product_then_sort": lambda a, b: jnp.sort(a * b),
    "product_then_argmax": lambda a, b: jnp.argmax(a * b),
}


@pytest.mark.parametrize("name", sorted(WRAPPING))
def test_int32_arithmetic_wraps_like_xla(name):
    check(WRAPPING[name], BIG_A, BIG_B)


def test_the_sweeps_product_wraps():
    """The sweep's numbers: 100000 * 50000 wraps to 705032704 in int32; divided by 7 that is 100718957 (fusegraph
    gave 714285714, the quotient of the unwrapped product)."""
    a, b = _arr([100000], np.int32), _arr([50000], np.int32)
    assert int(check(lambda a, b: (a * b) // 7, a, b)(a, b)[0]) == 705032704 // 7


def test_the_index_wrap_idiom_adds_no_ops():
    """JAX's negative-index wrap ``select(i < 0, i + n, i)`` cannot overflow: nothing is wrapped there (the Llama
    step's cache index stays the ops the patterns and the report expect); a value that may overflow is."""
    cache = jnp.zeros((4, 8), jnp.float32)
    imported, _ = import_jax(lambda c, i: lax.dynamic_slice_in_dim(c, i, 1, 1), cache, jnp.int32(3))
    assert "aten.bitwise_and.Scalar" not in aten_ops(imported), aten_ops(imported)
    where = jax.jit(lambda p, a, b: jnp.where(p, a, b))  # a func.call, as Keras's ops.where lowers

    def wrapped_index(c, i):
        return lax.dynamic_slice_in_dim(c, where(i < 0, i + 8, i), 1, 1)

    imported, text = import_jax(wrapped_index, cache, jnp.int32(3))
    assert "func.call" in text or "call @" in text, text
    assert "aten.bitwise_and.Scalar" not in aten_ops(imported), aten_ops(imported)
    check(wrapped_index, cache, jnp.int32(-3))
    imported, _ = import_jax(lambda a, b: (a * b) < 0, BIG_A, BIG_B)
    assert "aten.bitwise_and.Scalar" in aten_ops(imported), aten_ops(imported)


# ---- float -> integer converts saturate ---------------------------------------------------------------------
FLOATS = [0.0, -0.0, 1.5, -1.5, 0.9, -0.9, 127.9, -128.9, 200.0, -200.0, 255.9, 256.0, 40000.0, -40000.0, 1e10,
          -1e10, 2147483520.0, 2147483648.0, -2147483648.0, -2147483904.0, np.inf, -np.inf, np.nan]


@pytest.mark.parametrize("src", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("dst", ["int8", "int16", "int32", "uint8"])
def test_float_to_int_convert_matches_xla(src, dst):
    x = jnp.asarray(np.array(FLOATS, np.float32)).astype(src)
    check(lambda x: x.astype(dst), x)


def test_float_to_int_of_a_constant_is_folded_like_xla():
    x = jnp.asarray(np.array([1, 2], np.int32))
    check(lambda x: x + jnp.asarray(np.float32(3e9)).astype(jnp.int32) + jnp.float32(-300.7).astype(jnp.int8), x)


def test_float_to_bool_and_int_to_float():
    x = jnp.asarray(np.array([np.nan, np.inf, -0.0, 0.0, 1e-30], np.float32))
    check(lambda x: x.astype(bool), x)
    check(lambda a, b: (a * b).astype(jnp.float32) + (a + b).astype(jnp.bfloat16).astype(jnp.float32), BIG_A, BIG_B)


@pytest.mark.parametrize("dst", ["uint16", "uint32"])
def test_unsigned_wider_than_8_bits_is_not_lowered(dst):
    x = jnp.asarray(np.array(FLOATS, np.float32))
    check(lambda x: x.astype(dst), x, refused="convert")


# ---- division and remainder ---------------------------------------------------------------------------------
DIVIDEND = [-7, 7, -7, 7, 0, 5, -5, "min", "min", "min", 3]
DIVISOR = [2, -2, -2, 2, 0, 0, 0, -1, 0, 1, -1]


def _operands(dtype):
    lo = np.iinfo(dtype).min
    a = [lo if v == "min" else v for v in DIVIDEND]
    if np.iinfo(dtype).min == 0:
        a, b = [abs(v) for v in a], [abs(v) for v in DIVISOR]
    else:
        b = DIVISOR
    return _arr(a, dtype), _arr(b, dtype)


DIVISIONS = {
    "div": lambda a, b: lax.div(a, b),  # stablehlo.divide: toward zero
    "rem": lambda a, b: lax.rem(a, b),  # the dividend's sign
    "floor_divide": lambda a, b: a // b,  # jnp's floor division is built from divide and remainder
    "mod": lambda a, b: a % b,
    "divmod_then_compare": lambda a, b: (lax.div(a, b) < 0, lax.rem(a, b) >= 0),
}


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.int16, np.uint8])
@pytest.mark.parametrize("name", sorted(DIVISIONS))
def test_integer_division_matches_xla(name, dtype):
    """Negative operands, division by zero (x / 0 == -1 or the unsigned maximum, x % 0 == x) and MIN / -1."""
    check(DIVISIONS[name], *_operands(dtype))


def test_division_by_constants():
    a = _arr([-7, 7, MIN32, MAX32, 0], np.int32)
    check(lambda a: (lax.div(a, jnp.int32(0)), lax.rem(a, jnp.int32(0)), lax.div(a, jnp.int32(-1)),
                     lax.rem(a, jnp.int32(-1)), a // -3, a % -3, lax.div(jnp.int32(7), a + 1)), a)


def test_int64_min_divided_by_minus_one_does_not_crash():
    """With x64 enabled: PyTorch's int64 ``MIN / -1`` is a SIGFPE (the process dies); XLA gives MIN, and
    ``MIN % -1 == 0``. Run in a child process so a crash is a failure, not the end of the test run."""
    code = r"""
import jax
jax.config.update("jax_enable_x64", True)
import warnings, numpy as np, jax.numpy as jnp
from jax import lax
import fusegraph.jax as fj
warnings.simplefilter("error")
a = jnp.asarray(np.array([np.iinfo(np.int64).min, 7, -7, 5], np.int64))
b = jnp.asarray(np.array([-1, 0, 2, -1], np.int64))
f = lambda a, b: (lax.div(a, b), lax.rem(a, b), a * b + 1)
step = fj.jit(f, params_argnums=(), options={"executor": "nkisim"})
step(jnp.ones_like(a), jnp.ones_like(b))
for got, want in zip(step(a, b), jax.jit(f)(a, b)):
    assert got.dtype == want.dtype and np.array_equal(np.asarray(got), np.asarray(want)), (got, want)
assert step.last.fallback is None, step.last.reason
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.returncode, out.stderr[-2000:])


# ---- min/max, unsigned and narrow types, shifts -------------------------------------------------------------
def test_integer_min_max_and_clamp():
    a, b = _arr([-7, 7, MIN32, MAX32, 0], np.int32), _arr([2, -2, MAX32, MIN32, 0], np.int32)
    check(lambda a, b: (jnp.maximum(a, b), jnp.minimum(a, b), jnp.max(a), jnp.min(b), jnp.clip(a, -3, b)), a, b)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.uint8])
def test_narrow_types_wrap(dtype):
    info = np.iinfo(dtype)
    a = _arr([info.max, info.min, info.max // 2 + 3, 3], dtype)
    b = _arr([2, 3, 5, info.max], dtype)
    check(lambda a, b: (a + b, a - b, a * b, (a * b) < a, -a, jnp.abs(a), jnp.maximum(a * b, b)), a, b)


def test_mixed_width_converts():
    a = _arr([MAX32, MIN32, 300, -300, 255], np.int32)
    u = _arr([255, 0, 128, 7, 200], np.uint8)
    check(lambda a, u: (a.astype(jnp.int8), a.astype(jnp.uint8), u.astype(jnp.int8),
                        (u.astype(jnp.int32) * a).astype(jnp.int16), (a * 3).astype(jnp.int8) < 0), a, u)


@pytest.mark.parametrize("fn", [lax.shift_left, lax.shift_right_arithmetic, lax.shift_right_logical])
def test_shifts_are_not_lowered(fn):
    """Shifts (out-of-range counts are defined in XLA, not in PyTorch) are refused: JAX runs, one warning."""
    a, b = _arr([1, -8, 5, MIN32], np.int32), _arr([31, 2, 40, 1], np.int32)
    check(lambda a, b: fn(a, b), a, b, refused="shift")


def test_integer_arithmetic_stays_off_the_kernel():
    """The kernel computes in floats: integer activations never join a region (patterns and generic pieces are
    float-only), so the host's PyTorch ops, with the semantics above, compute them."""
    a = _arr([[2 ** 30 + 1, 7] * 64] * 4, np.int32)
    b = _arr([[1, 2 ** 29 + 3] * 64] * 4, np.int32)
    step = check(lambda a, b: ((a + b) * 3 + a, (a + b) - b), a, b)
    data = step.report().to_dict()
    assert not data["regions"] and not data["pattern_counts"], data["regions"]


def test_a_rotary_tables_start_index_is_wrapped():
    """keras-hub's rotary tables are an idiom that reads its start index from the environment: an overflowing
    int32 start (65536 * 65536 wraps to 0) is the wrapped value there (the convert to f32 that reads it first
    replaced it)."""
    from test_keras_idioms import B, D, H, T, keras_table_rope

    def f(x, a, b):
        return keras_table_rope(x, a * b)

    x = jnp.asarray(np.random.default_rng(6).normal(size=(B, T, H, D)).astype(np.float32))
    fused = fj.jit(f, params_argnums=(), options={"executor": "eager"})
    for a, b in ((1, 3), (65536, 65536), (65536, 65537)):
        args = (x, jnp.int32(a), jnp.int32(b))
        for g, e in zip(fused(*args), jax.jit(f)(*args)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5)
    assert fused.last.fallback is None and fused.last.verified
    assert fused.last.report().to_dict()["pattern_counts"].get("fusegraph.rope_tables") == 1
