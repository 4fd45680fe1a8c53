"""Views share storage; sentinels; low-precision storage with rounding on write; element-wise semantics."""

import ml_dtypes
import numpy as np
import pytest

from fusegraph import nkisim
from fusegraph.nkisim import load_kernel_source

HDR = "import nki\nimport nki.language as nl\nimport nki.isa as nisa\n"


def kernel(body: str, name: str = "k"):
    return load_kernel_source(HDR + body, f"/virtual/views_{name}_{abs(hash(body))}.py", target="trn2")[name]


def test_views_alias_storage_slicing_reshape_view_ap():
    k = kernel("""
@nki.jit
def k(x):
    out = nl.ndarray((8, 16), dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((8, 16), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    # write through a strided view, a negative-step view, nl.ds, a reshape and an .ap view
    nisa.memset(dst=t[:, 0:16:2], value=-1.0)
    nisa.memset(dst=t[:, nl.ds(1, 1)], value=7.0)
    r = t.reshape((8, 4, 4))
    nisa.memset(dst=r[:, 3, :], value=3.0)
    nisa.memset(dst=t.ap(pattern=[[16, 8], [1, 1]], offset=15), value=9.0)
    nisa.dma_copy(dst=out, src=t)
    return out
""")
    x = np.arange(128, dtype=np.float32).reshape(8, 16)
    out = k(x)
    ref = x.copy()
    ref[:, 0:16:2] = -1
    ref[:, 1] = 7
    ref.reshape(8, 4, 4)[:, 3, :] = 3
    ref[:, 15] = 9
    np.testing.assert_array_equal(out, ref)


def test_hbm_views_negative_index_ellipsis_and_int_drop():
    k = kernel("""
@nki.jit
def k(x):
    out = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[-1, ...])
    assert x[-1].shape == (4, 8) and x[1, :, 2].shape == (4,)
    assert t[1].shape == (1, 8) and t[:, 3].shape == (4, 1)
    nisa.dma_copy(dst=out, src=t)
    return out
""")
    x = np.arange(3 * 4 * 8, dtype=np.float32).reshape(3, 4, 8)
    np.testing.assert_array_equal(k(x), x[-1])


def test_view_dtype_reinterprets_bits():
    k = kernel("""
@nki.jit
def k(x):
    out = nl.ndarray((4, 16), dtype=nl.uint16, buffer=nl.shared_hbm)
    t = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.dma_copy(dst=out, src=t.view(nl.uint16), dge_mode=nisa.dge_mode.hwdge)
    return out
""")
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_array_equal(k(x), x.view(np.uint16))


def test_fresh_allocations_hold_sentinels():
    k = kernel("""
@nki.jit
def k(x):
    out_f = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.shared_hbm)
    out_i = nl.ndarray((4, 8), dtype=nl.int32, buffer=nl.shared_hbm)
    f = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
    i = nl.ndarray((4, 8), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=out_f, src=f)
    nisa.dma_copy(dst=out_i, src=i)
    return out_f, out_i
""")
    f, i = k(np.zeros(1, np.float32))
    assert np.isnan(f).all()
    assert (i == 4).all()


def test_bf16_rounding_on_write_and_fp32_compute():
    k = kernel("""
@nki.jit
def k(x):
    out = nl.ndarray(x.shape, dtype=nl.bfloat16, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    b = nl.ndarray(x.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=b, data=t, op0=nl.add, operand0=1.0)
    nisa.dma_copy(dst=out, src=b)
    return out
""")
    x = np.array([[1e-3, 3.14159265, 1000.1, -2.5e-5]], dtype=np.float32)
    out = k(x)
    assert out.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out, (x + 1).astype(ml_dtypes.bfloat16))


def test_tfloat32_and_fp8_storage():
    k = kernel("""
@nki.jit
def k(x):
    o1 = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    o2 = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=nl.tfloat32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    f8 = nl.ndarray(x.shape, dtype=nl.float8_e4m3, buffer=nl.sbuf)
    nisa.tensor_copy(dst=f8, src=t)
    nisa.dma_copy(dst=o1, src=t)
    nisa.dma_copy(dst=o2, src=f8)
    return o1, o2
""")
    x = np.array([[1.0 + 2**-12, 300.0, 1.0 + 2**-10]], dtype=np.float32)
    tf32, f8 = k(x)
    np.testing.assert_array_equal(tf32, [[1.0, 300.0, 1.0 + 2**-10]])
    assert f8[0, 1] in (240.0, np.inf)  # legacy float8_e4m3 (max 240) saturates / overflows
    assert f8[0, 0] == 1.0


def test_int_arithmetic_and_bitvec():
    k = kernel("""
@nki.jit
def k(x, y):
    out = nl.ndarray(x.shape, dtype=nl.int32, buffer=nl.shared_hbm)
    a = nl.ndarray(x.shape, dtype=nl.int32, buffer=nl.sbuf)
    b = nl.ndarray(x.shape, dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=a, src=x)
    nisa.dma_copy(dst=b, src=y)
    c = nl.ndarray(x.shape, dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=c, data1=a, data2=b, op=nl.add)
    nisa.tensor_scalar(dst=c, data=c, op0=nl.bitwise_and, operand0=0xFFFF, op1=nl.right_shift, operand1=1)
    nisa.dma_copy(dst=out, src=c)
    return out
""")
    x = np.array([[2**24 + 1, 5, -1]], dtype=np.int32)
    y = np.array([[2**24, 7, 0]], dtype=np.int32)
    np.testing.assert_array_equal(k(x, y), ((x + y) & 0xFFFF) >> 1)


@pytest.mark.parametrize("op,ref", [
    ("nl.exp", np.exp), ("nl.tanh", np.tanh), ("nl.sigmoid", lambda v: 1 / (1 + np.exp(-v))),
    ("nl.silu", lambda v: v / (1 + np.exp(-v))), ("nl.gelu_apprx_tanh", None), ("nl.gelu", None),
    ("nl.relu", lambda v: np.maximum(v, 0)), ("nl.square", np.square), ("nl.abs", np.abs),
    ("nl.sqrt", lambda v: np.sqrt(np.abs(v))), ("nl.copy", lambda v: v),
])
def test_activation_functions(op, ref):
    src_op = op
    k = kernel(f"""
@nki.jit
def k(x):
    out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.activation(dst=t, op={src_op}, data=t)
    nisa.dma_copy(dst=out, src=t)
    return out
""")
    x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(4, 16)
    if op == "nl.sqrt":
        x = np.abs(x)
    out = k(x)
    if ref is None:
        import torch

        approx = "tanh" if "tanh" in op else "none"
        ref = lambda v: torch.nn.functional.gelu(torch.from_numpy(v), approximate=approx).numpy()  # noqa: E731
    np.testing.assert_allclose(out, ref(x), rtol=1e-5, atol=1e-6)


def test_iota_affine_select_and_tensor_reduce_axes():
    k = kernel("""
@nki.jit
def k(x):
    o1 = nl.ndarray((4, 6), dtype=nl.float32, buffer=nl.shared_hbm)
    o2 = nl.ndarray((4, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    i = nl.ndarray((4, 6), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=i, pattern=[[1, 6]], offset=10, channel_multiplier=100)
    m = nl.ndarray((4, 6), dtype=nl.float32, buffer=nl.sbuf)
    nisa.affine_select(dst=m, pattern=[[-1, 6]], channel_multiplier=1, on_true_tile=i, on_false_value=-5.0,
                       cmp_op=nl.greater_equal)
    r = nl.ndarray((4, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=r, op=nl.add, data=m.reshape((4, 2, 3)), axis=(1, 2))
    nisa.dma_copy(dst=o1, src=m)
    nisa.dma_copy(dst=o2, src=r)
    return o1, o2
""")
    m, r = k(np.zeros(1, np.float32))
    p = np.arange(4)[:, None]
    j = np.arange(6)[None, :]
    ref = np.where(p - j >= 0, 10 + 100 * p + j, -5.0)
    np.testing.assert_array_equal(m, ref)
    np.testing.assert_array_equal(r, ref.sum(axis=1, keepdims=True))


def test_tensor_reduce_rejects_partition_axis_and_non_trailing_axes():
    k = kernel("""
@nki.jit
def k(x):
    t = nl.zeros((4, 2, 3), dtype=nl.float32)
    r = nl.ndarray((4, 3), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=r, op=nl.add, data=t, axis=1)
    return x
""")
    with pytest.raises(nkisim.NkiValidationError, match="last contiguous free dims"):
        k(np.zeros(1, np.float32))


def test_high_level_language_ops():
    k = kernel("""
@nki.jit
def k(x):
    out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.load(x)
    y = nl.add(nl.multiply(t, 2.0), nl.exp(t))
    s = nl.sum(y, axis=1, keepdims=True)
    z = nl.subtract(y, nl.broadcast_to(s, shape=x.shape))
    nl.store(out, z)
    return out
""")
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    y = 2 * x + np.exp(x)
    np.testing.assert_allclose(k(x), y - y.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-5)


def test_unary_and_reverse_operands():
    k = kernel("""
@nki.jit
def k(x):
    out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.load(x)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.subtract, operand0=10.0, reverse0=True, op1=nl.abs, operand1=None)
    nisa.dma_copy(dst=out, src=t)
    return out
""")
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    np.testing.assert_array_equal(k(x), np.abs(10 - x))


def _erf(v):
    import math

    return np.vectorize(math.erf)(v)


_SIG = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
ACT_REFS = {
    "copy": lambda v: v, "square": np.square, "sigmoid": _SIG, "relu": lambda v: np.maximum(v, 0),
    "gelu": lambda v: 0.5 * v * (1 + _erf(v / np.sqrt(2))),
    "gelu_dx": lambda v: 0.5 * (1 + _erf(v / np.sqrt(2))) + v * np.exp(-v * v / 2) / np.sqrt(2 * np.pi),
    "gelu_apprx_tanh": lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3))),
    "gelu_apprx_sigmoid": lambda v: v * _SIG(1.702 * v),
    "gelu_apprx_sigmoid_dx": lambda v: _SIG(1.702 * v) * (1 + 1.702 * v * (1 - _SIG(1.702 * v))),
    "silu": lambda v: v * _SIG(v), "silu_dx": lambda v: _SIG(v) * (1 + v * (1 - _SIG(v))), "tanh": np.tanh,
    "softplus": lambda v: np.log1p(np.exp(v)), "mish": lambda v: v * np.tanh(np.log1p(np.exp(v))), "erf": _erf,
    "erf_dx": lambda v: 2 / np.sqrt(np.pi) * np.exp(-v * v), "exp": np.exp, "log": np.log, "sin": np.sin,
    "arctan": np.arctan, "sqrt": np.sqrt, "rsqrt": lambda v: 1 / np.sqrt(v), "reciprocal": lambda v: 1 / v,
    "sign": np.sign, "abs": np.abs,
}


def test_every_activation_function_of_the_table():
    from fusegraph.nkisim.opsdef import ACTIVATIONS

    assert set(ACT_REFS) == set(ACTIVATIONS)
    x3 = np.linspace(0.1, 3.0, 32, dtype=np.float32).reshape(2, 16)
    for name, ref in ACT_REFS.items():
        x = x3 / 2 if name == "arctan" else x3  # inside arctan's valid input range [-pi/2, pi/2]
        k = kernel(f"""
@nki.jit
def k(x):
    out = nl.ndarray(shape=x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.load(x)
    nisa.activation(dst=t, op=nl.{name}, data=t)
    nl.store(out, t)
    return out
""")
        np.testing.assert_allclose(k(x), ref(x.astype(np.float64)), rtol=2e-5, atol=2e-6, err_msg=name)


ALU_REFS = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum, "minimum": np.minimum,
    "equal": lambda a, b: (a == b) * 1.0, "not_equal": lambda a, b: (a != b) * 1.0,
    "greater": lambda a, b: (a > b) * 1.0, "greater_equal": lambda a, b: (a >= b) * 1.0,
    "less": lambda a, b: (a < b) * 1.0, "less_equal": lambda a, b: (a <= b) * 1.0,
    "logical_and": lambda a, b: ((a != 0) & (b != 0)) * 1.0, "logical_or": lambda a, b: ((a != 0) | (b != 0)) * 1.0,
    "logical_xor": lambda a, b: ((a != 0) ^ (b != 0)) * 1.0, "power": np.power,
}


def test_every_arithmetic_alu_operator():
    a = np.array([[0.0, 1.0, 2.0, 3.0, 0.5, 2.0, 1.5, 4.0]], dtype=np.float32)
    b = np.array([[0.0, 2.0, 2.0, 1.0, 0.0, 3.0, 0.5, 0.5]], dtype=np.float32)
    for name, ref in ALU_REFS.items():
        engine = ", engine=nisa.engine.gpsimd" if name == "power" else ""
        k = kernel(f"""
@nki.jit
def k(a, b):
    out = nl.ndarray(shape=a.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    x = nl.load(a)
    y = nl.load(b)
    nisa.tensor_tensor(dst=x, data1=x, data2=y, op=nl.{name}{engine})
    nl.store(out, x)
    return out
""")
        np.testing.assert_allclose(k(a, b), ref(a, b), rtol=1e-6, err_msg=name)
