"""Interpreter faithfulness to the documented hardware behaviour (issue 11, items 14-22).

Each test runs a small kernel of its own; the docstring of every test names the official source of the
behaviour it pins down (see docs/interpreter.md, "Faithfulness notes").
"""


import ml_dtypes
import numpy as np
import pytest

from fusegraph import nkisim
from fusegraph.nkisim import NkiSimError
from fusegraph.nkisim.targets import get_target

from inline_kernels import build, expect  # noqa: E402

RNG = np.random.default_rng(11)


# ------------------------------------------------------------------ 14: float -> int saturation, affine_select


def test_float_to_int32_and_uint32_saturates_at_the_bounds_and_infinities():
    """Out-of-range floats saturate (interpreter rule; hardware mode unpublished): 2^31 and +inf are INT_MAX,
    not INT_MIN; values >= 2^32 and +inf are UINT_MAX, not 0."""
    k, _ = build("""
    @nki.jit
    def k(x):
        o32 = nl.ndarray((1, 8), dtype=nl.int32, buffer=nl.shared_hbm)
        ou = nl.ndarray((1, 8), dtype=nl.uint32, buffer=nl.shared_hbm)
        t = nl.ndarray((1, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        i = nl.ndarray((1, 8), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=i, src=t)
        u = nl.ndarray((1, 8), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=u, src=t)
        nisa.dma_copy(dst=o32, src=i)
        nisa.dma_copy(dst=ou, src=u)
        return o32, ou
    """)
    x = np.array([[2.0**31, 3e9, np.inf, -np.inf, 5e9, -2.5, 2.0**32, -3e9]], dtype=np.float32)
    i32, u32 = k(x)
    imax, imin, umax = 2**31 - 1, -(2**31), 2**32 - 1
    np.testing.assert_array_equal(i32, [[imax, imax, imax, imin, imax, -2, imax, imin]])
    np.testing.assert_array_equal(u32, [[2**31, 3000000000, umax, 0, umax, 0, umax, 0]])


def test_affine_select_int32_in_and_out_is_bit_exact():
    """affine_select stub: only when on_true_tile and dst dtypes differ are selected elements cast via FP32;
    int32 -> int32 keeps values above 2^24 exact."""
    k, _ = build("""
    @nki.jit
    def k(x):
        out = nl.ndarray((2, 4), dtype=nl.int32, buffer=nl.shared_hbm)
        t = nl.ndarray((2, 4), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        m = nl.ndarray((2, 4), dtype=nl.int32, buffer=nl.sbuf)
        nisa.affine_select(dst=m, pattern=[[-1, 4]], channel_multiplier=1, on_true_tile=t, on_false_value=-7.0,
                           cmp_op=nl.greater_equal)
        nisa.dma_copy(dst=out, src=m)
        return out
    """)
    x = np.array([[2**24 + 1, 2**30 + 3, 2**31 - 1, -(2**31) + 1],
                  [2**25 + 1, 16777217, -16777217, 123456789]], dtype=np.int32)
    p = np.arange(2)[:, None]
    j = np.arange(4)[None, :]
    np.testing.assert_array_equal(k(x), np.where(p - j >= 0, x, -7))


# ------------------------------------------------------------------ 15: activation valid input ranges

_ACT = """
@nki.jit
def k(x):
    out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.activation(dst=t, op={op}, data=t, scale={scale})  # <-
    nisa.dma_copy(dst=out, src=t)
    return out
"""


@pytest.mark.parametrize("op,value,scale", [
    ("nl.sin", 4.0, 1.0),            # [-pi, pi], no range reduction
    ("nl.sin", 1.0, 4.0),            # the range applies to data * scale + bias
    ("nl.rsqrt", 0.0, 1.0),          # [2^-87, 2^97]
    ("nl.log", 1e-30, 1.0),          # [2^-64, 2^64]
    ("nl.arctan", 2.0, 1.0),         # [-pi/2, pi/2]
    ("nl.sqrt", 2.0**119, 1.0),      # [2^-116, 2^118]
    ("nl.reciprocal", 0.0, 1.0),     # +-[2^-42, 2^42]
    ("nl.reciprocal", -(2.0**43), 1.0),
])
def test_activation_outside_its_valid_input_range_is_flagged(op, value, scale):
    """nki.api.shared.rst "Supported Activation Functions": outside the Valid Input Range the Scalar Engine
    generates invalid output; the interpreter raises instead of returning the exact value."""
    x = np.full((2, 4), 0.5, dtype=np.float32)
    x[1, 2] = value
    e = expect("activation-range", _ACT.format(op=op, scale=scale), x)
    assert op in str(e) and "partition 1" in str(e)


def test_activation_at_the_range_bounds_and_full_range_functions_pass():
    """The documented bounds are inclusive; functions with range [-inf, inf] are never flagged."""
    pi = float(np.float32(np.pi))
    cases = {
        "nl.sin": [-pi, pi, 0.0],
        "nl.arctan": [-pi / 2, pi / 2, 0.0],
        "nl.rsqrt": [2.0**-87, 2.0**97, 1.0],
        "nl.log": [2.0**-64, 2.0**64, 1.0],
        "nl.sqrt": [2.0**-116, 2.0**118, 4.0],
        "nl.reciprocal": [2.0**-42, -(2.0**42), -2.0],
        "nl.exp": [-1e30, 80.0, 0.0],
        "nl.tanh": [np.inf, -np.inf, 0.0],
    }
    for op, vals in cases.items():
        k, _ = build(_ACT.format(op=op, scale=1.0))
        x = np.array([vals], dtype=np.float32)
        out = k(x)
        assert out.shape == x.shape, op


# ------------------------------------------------------------------ 16: scalar_offset on compute operands


def test_tensor_copy_with_dynamic_src_and_dst_offsets():
    """0.3.0 update guide: tensor_copy_dynamic_src/dst are replaced by tensor_copy with .ap(scalar_offset=);
    the dynamic offset moves the access within each partition (register or 1x1 SBUF tensor)."""
    k, _ = build("""
    @nki.jit
    def k(x, off):
        out1 = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        out2 = nl.ndarray((4, 32), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((4, 32), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        o = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=o, src=off)
        d = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=d, src=t.ap(pattern=[[32, 4], [1, 8]], scalar_offset=o, indirect_dim=1))
        nisa.dma_copy(dst=out1, src=d)
        reg = nisa.register_alloc()
        nisa.register_load(reg, o)
        z = nl.ndarray((4, 32), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=z, value=0.0)
        nisa.tensor_scalar(dst=z.ap(pattern=[[32, 4], [1, 8]], scalar_offset=reg, indirect_dim=1), data=d,
                           op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(dst=out2, src=z)
        return out1, out2
    """)
    x = RNG.standard_normal((4, 32)).astype(np.float32)
    for off in (0, 5, 24):
        o1, o2 = k(x, np.array([[off]], dtype=np.int32))
        np.testing.assert_array_equal(o1, x[:, off:off + 8])
        ref = np.zeros((4, 32), np.float32)
        ref[:, off:off + 8] = 2 * x[:, off:off + 8]
        np.testing.assert_array_equal(o2, ref)
    # shape-only: the offset comes from `assume`; default and explicit values both run
    nkisim.run(k, nkisim.Abstract((4, 32)), nkisim.Abstract((1, 1), "int32"), shape_only=True)
    nkisim.run(k, nkisim.Abstract((4, 32)), nkisim.Abstract((1, 1), "int32"), shape_only=True, assume=24)


_DYN = """
@nki.jit
def k(x, off):
    t = nl.ndarray((4, 32), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    o = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=o, src=off)
    d = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=d, src=t.ap(pattern=[[32, 4], [1, 8]], scalar_offset=o, indirect_dim={dim}))  # <-
    return x
"""


def test_dynamic_compute_offset_out_of_partition_raises():
    """A runtime offset that moves the access past the end of its partition is an out-of-bounds access."""
    x = np.zeros((4, 32), np.float32)
    expect("out-of-bounds", _DYN.format(dim=1), x, np.array([[25]], np.int32), match="partition")
    expect("out-of-bounds", _DYN.format(dim=1), x, np.array([[-1]], np.int32), match="partition")


def test_dynamic_compute_offset_on_the_partition_dim_is_rejected():
    """Engine operands take their dynamic offset within each partition (tensor_copy_dynamic_src stub); a
    runtime partition offset (indirect_dim=0) is rejected with a named rule, in data and shape-only runs."""
    x = np.zeros((4, 32), np.float32)
    expect("dynamic-offset", _DYN.format(dim=0), x, np.array([[0]], np.int32), match="indirect_dim")
    expect("dynamic-offset", _DYN.format(dim=0), nkisim.Abstract((4, 32)), nkisim.Abstract((1, 1), "int32"),
           shape_only=True)


# ------------------------------------------------------------------ 17: DMA with a partition-strided .ap


def test_dma_with_partition_strided_sbuf_ap_is_rejected():
    """Access-pattern guide ("Restriction on SBUF/PSUM Tensors"): the partition step of an .ap on an on-chip
    tensor must be the element count of its whole free dimension -- also for DMAs."""
    x = np.zeros((4, 16), np.float32)
    expect("partition-stride", """
    @nki.jit
    def k(x):
        t = nl.ndarray((8, 16), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t.ap(pattern=[[32, 4], [1, 16]]), src=x)  # <-
        return x
    """, x, match="partition")
    expect("partition-stride", """
    @nki.jit
    def k(x):
        out = nl.ndarray((4, 16), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((8, 16), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=1.0)
        nisa.dma_copy(dst=out, src=t.ap(pattern=[[0, 4], [1, 16]]))  # <-
        return out
    """, x)


def test_dma_with_contiguous_sbuf_ap_still_works():
    k, _ = build("""
    @nki.jit
    def k(x):
        out = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((4, 16), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.dma_copy(dst=out, src=t.ap(pattern=[[16, 4], [2, 8]], offset=1))
        return out
    """)
    x = RNG.standard_normal((4, 16)).astype(np.float32)
    np.testing.assert_array_equal(k(x), x[:, 1::2])


# ------------------------------------------------------------------ 18: nc_matmul accumulate per instruction

_MM = """
@nki.jit
def k(a, b):
    out = nl.ndarray((8, 16), dtype=nl.float32, buffer=nl.shared_hbm)
    s = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
    m = nl.ndarray((4, 16), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=s, src=a)
    nisa.dma_copy(dst=m, src=b)
    ps = nl.ndarray((8, 16), dtype=nl.float32, buffer=nl.psum)
{body}
    r = nl.ndarray((8, 16), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=r, src=ps)
    nisa.dma_copy(dst=out, src=r)
    return out
"""
A = RNG.standard_normal((4, 8)).astype(np.float32)
B = RNG.standard_normal((4, 16)).astype(np.float32)


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_accumulate_none_on_a_partly_accumulating_dst_is_rejected(target):
    """nc_matmul stub: accumulate=None auto-detects overwrite vs. accumulate; one instruction has one flag, so a
    dst that is half inside an accumulation group and half fresh has no hardware meaning."""
    body = ("    nisa.nc_matmul(dst=ps[:, 0:8], stationary=s, moving=m[:, 0:8])\n"
            "    nisa.nc_matmul(dst=ps, stationary=s, moving=m)  # <-")
    expect("matmul-accumulate", _MM.format(body=body), A, B, target=target, match="accumulate=None")


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_accumulate_true_on_never_written_psum_is_rejected(target):
    """accumulate=True adds to the existing PSUM content; PSUM never written since allocation is undefined."""
    body = "    nisa.nc_matmul(dst=ps, stationary=s, moving=m, accumulate=True)  # <-"
    expect("matmul-accumulate", _MM.format(body=body), A, B, target=target, match="never written")


def test_accumulate_none_decides_per_instruction():
    """A full accumulation group (None, None) accumulates; an explicit overwrite restarts it; accumulate=True
    continues it."""
    body = ("    nisa.nc_matmul(dst=ps, stationary=s, moving=m)\n"
            "    nisa.nc_matmul(dst=ps, stationary=s, moving=m)\n"
            "    nisa.nc_matmul(dst=ps[:, 0:8], stationary=s, moving=m[:, 0:8], accumulate=False)\n"
            "    nisa.nc_matmul(dst=ps[:, 0:8], stationary=s, moving=m[:, 0:8], accumulate=True)")
    k, _ = build(_MM.format(body=body))
    ref = A.T @ B
    want = 2 * ref
    np.testing.assert_allclose(k(A, B), want, rtol=1e-5)


# ------------------------------------------------------------------ 19: fp8 TensorE transpose on trn2

_T8 = """
@nki.jit
def k(x):
    out = nl.ndarray((8, {w}), dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray((4, 8), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    ps = nl.ndarray((8, {w}), dtype=x.dtype, buffer=nl.psum)
    nisa.memset(dst=ps, value=0.0)
    nisa.{call}  # <-
    o = nl.ndarray((8, {w}), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=o, src=ps)
    nisa.dma_copy(dst=out, src=o)
    return out
"""
_CALLS = [
    "nc_transpose(dst=ps[:, 0:4], data=t)",
    "nc_matmul(dst=ps[:, 0:4], stationary=t, moving=ident[0:4, 0:4], is_transpose=True)",
]


def _t8_src(call: str, w: int) -> str:
    src = _T8.format(w=w, call=call)
    if "ident" in call:
        src = src.replace("    nisa.memset(dst=ps", "    ident = nl.shared_identity_matrix(n=4, dtype=x.dtype)\n"
                          "    nisa.memset(dst=ps")
    return src


@pytest.mark.parametrize("call", _CALLS)
def test_fp8_tensor_engine_transpose_writes_16_bit_elements_on_trn2(call):
    """trainium2_arch.rst: "NeuronCore-v3 TensorE transpose mode for FP8 input data produces 16-bit output
    elements in PSUM, with the upper 8 bits filled with zeros"."""
    x = RNG.uniform(0.5, 4.0, (4, 8)).astype(ml_dtypes.float8_e4m3)
    k, _ = build(_t8_src(call, 8), target="trn2")
    raw = np.asarray(k(x)).view(np.uint8)
    np.testing.assert_array_equal(raw[:, 0::2], x.T.view(np.uint8))
    np.testing.assert_array_equal(raw[:, 1::2], 0)
    k3, _ = build(_t8_src(call, 8), target="trn3")  # not documented for NeuronCore-v4: packed bytes
    raw3 = np.asarray(k3(x)).view(np.uint8)
    np.testing.assert_array_equal(raw3[:, 0:4], x.T.view(np.uint8))
    np.testing.assert_array_equal(raw3[:, 4:], 0)


@pytest.mark.parametrize("call", _CALLS)
def test_fp8_transpose_into_a_dst_without_room_for_16_bit_elements_is_rejected(call):
    x = np.ones((4, 8), dtype=ml_dtypes.float8_e4m3)
    expect("partition-bounds", _t8_src(call, 4).replace("ps[:, 0:4]", "ps"), x, match="16-bit")


# ------------------------------------------------------------------ 20: indirect dma_transpose

_IT = """
@nki.jit
def k(table, idx):
    out = nl.ndarray(({f}, {p}), dtype=table.dtype, buffer=nl.shared_hbm)
    i = nl.ndarray({ishape}, dtype={idt}, buffer=nl.sbuf)
    nisa.dma_copy(dst=i, src=idx)
    d = nl.ndarray(({f}, {p}), dtype=table.dtype, buffer=nl.sbuf)
    nisa.dma_transpose(dst=d, src=table.ap(pattern=[[{f}, {p}], [1, {f}]], vector_offset=i, indirect_dim=0))  # <-
    nisa.dma_copy(dst=out, src=d)
    return out
"""


@pytest.mark.parametrize("p,ishape", [(16, (16, 1)), (16, (32, 1)), (256, (128, 2))])
def test_indirect_dma_transpose_gathers_rows_in_documented_order(p, ishape):
    """dma_transpose stub: flat_indices = indices.T.flatten()[:src.shape[0]]; dst = src[flat_indices, :].T."""
    f = 32
    table = RNG.standard_normal((300, f)).astype(ml_dtypes.bfloat16)
    idx = RNG.integers(0, 300, ishape).astype(np.uint32)
    k, _ = build(_IT.format(f=f, p=p, ishape=ishape, idt="nl.uint32"))
    flat = idx.T.reshape(-1)[:p]
    np.testing.assert_array_equal(np.asarray(k(table, idx)).view(np.uint16), table[flat].T.view(np.uint16))


@pytest.mark.parametrize("p,ishape,idt,rule,match", [
    (16, (16, 1), "nl.int32", "dtype", "uint32"),
    (16, (8, 2), "nl.uint32", "shape", "[16, 128]"),
    (16, (24, 1), "nl.uint32", "shape", "divisible by 16"),
    (32, (16, 2), "nl.uint32", "shape", "exactly 128"),
    (8, (16, 1), "nl.uint32", "shape", "src.shape[0]"),
    (32, (16, 1), "nl.uint32", "shape", ">= src.shape[0]"),
])
def test_indirect_dma_transpose_index_constraints(p, ishape, idt, rule, match):
    """dma_transpose stub, "DMA Indirect Transpose Constraints"."""
    table = np.zeros((300, 32), dtype=ml_dtypes.bfloat16)
    idx = np.zeros(ishape, dtype=np.uint32 if idt == "nl.uint32" else np.int32)
    expect(rule, _IT.format(f=32, p=p, ishape=ishape, idt=idt), table, idx, match=match)


# ------------------------------------------------------------------ 21: nl.* type promotion


@pytest.mark.parametrize("a,b,want", [
    ("float16", "bfloat16", np.float32),
    ("bfloat16", "float16", np.float32),
    ("float32", "bfloat16", np.float32),
    ("bfloat16", "float32", np.float32),
    ("float8_e4m3", "float16", np.float16),
    ("float8_e4m3", "bfloat16", ml_dtypes.bfloat16),
    ("float8_e4m3", "float8_e5m2", ml_dtypes.bfloat16),
    ("float8_e5m2", "float8_e4m3", ml_dtypes.bfloat16),
    ("int32", "float16", np.float16),
    ("uint16", "int32", np.int32),
    ("int8", "uint8", np.int16),
    ("uint8", "int8", np.int16),
    ("int8", "uint16", np.int32),
    ("int32", "uint32", np.float32),
    ("uint32", "int32", np.float32),
    ("int16", "int32", np.int32),
])
def test_high_level_type_promotion_is_symmetric_and_follows_the_table(a, b, want):
    """"NKI Type Promotion" (nki.api.shared.rst up to aws-neuron-sdk 77a1c5a8; the 2.29 nl docstrings still
    point to it): (fp16, bf16) -> fp32 whatever the operand order."""
    k, _ = build(f"""
    @nki.jit
    def k(x):
        u = nl.ndarray((2, 4), dtype=nl.{a}, buffer=nl.sbuf)
        nisa.memset(dst=u, value=1)
        v = nl.ndarray((2, 4), dtype=nl.{b}, buffer=nl.sbuf)
        nisa.memset(dst=v, value=2)
        r = nl.add(u, v)
        out = nl.ndarray(r.shape, dtype=r.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=r)
        return out
    """.replace("value=1)", "value=1)" if "int" in a else "value=1.0)").replace(
        "value=2)", "value=2)" if "int" in b else "value=2.0)"))
    out = k(np.zeros(1, np.float32))
    assert out.dtype == np.dtype(want)
    np.testing.assert_array_equal(out.astype(np.float32), 3.0)


# ------------------------------------------------------------------ 22: default target


def test_default_target_matches_nki_simulate(monkeypatch):
    """nki_simulator.rst: NEURON_PLATFORM_TARGET_OVERRIDE unset -> the detected chip, otherwise trn3 (no chip on a
    CPU host)."""
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    assert get_target(None).name == "trn3"
    body = """
    @nki.jit
    def k(x):
        out = nl.ndarray((2, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((2, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.exponential(dst=t, src=t)  # <-
        nisa.dma_copy(dst=out, src=t)
        return out
    """
    x = np.zeros((2, 4), np.float32)
    k, _ = build(body, target=None)
    np.testing.assert_array_equal(k(x), np.ones((2, 4), np.float32))
    with nkisim.as_nki():
        from fusegraph.nkisim import last_profile  # noqa: F401  (as_nki() without a target: trn3 too)
        k2, _ = build(body, target=None)
        k2(x)
    assert nkisim.last_profile().target == "trn3"
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    assert get_target(None).name == "trn2"
    k3, loc = build(body, target=None)
    with pytest.raises(NkiSimError) as ei:
        k3(x)
    assert ei.value.rule == "target" and loc in str(ei.value)
