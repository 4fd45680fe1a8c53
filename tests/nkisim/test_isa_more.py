"""Numeric checks of the less common implemented instructions against NumPy."""

import numpy as np
import pytest

from fusegraph import nkisim
from fusegraph.nkisim import load_kernel_source

HDR = "import nki\nimport nki.language as nl\nimport nki.isa as nisa\n"
RNG = np.random.default_rng(42)


def run(body: str, *args, name: str = "k", **kw):
    ns = load_kernel_source(HDR + body, f"/virtual/isa_more_{abs(hash(body))}.py", target="trn2")
    return nkisim.run(ns[name], *args, **kw)


def test_vector_offset_gather_and_scatter():
    data = RNG.standard_normal((64, 16)).astype(np.float32)
    idx = np.array([5, 0, 63, 7], dtype=np.uint32).reshape(4, 1)
    out = run("""
@nki.jit
def k(data, idx, table):
    out = nl.ndarray(shape=(4, 16), dtype=data.dtype, buffer=nl.shared_hbm)
    i = nl.ndarray(shape=(4, 1), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=i, src=idx)
    g = nl.ndarray(shape=(4, 16), dtype=data.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=g, src=data.ap(pattern=[[16, 4], [1, 16]], vector_offset=i, indirect_dim=0))
    nisa.dma_copy(dst=out, src=g)
    nisa.dma_copy(dst=table.ap(pattern=[[16, 4], [1, 16]], vector_offset=i, indirect_dim=0), src=g,
                  dge_mode=nisa.dge_mode.swdge)
    return out, table
""", data, idx, np.zeros((64, 16), np.float32))
    np.testing.assert_array_equal(out[0], data[idx[:, 0]])
    ref = np.zeros((64, 16), np.float32)
    ref[idx[:, 0]] = data[idx[:, 0]]
    np.testing.assert_array_equal(out[1], ref)


def test_vector_offset_needs_swdge():
    with pytest.raises(nkisim.NkiValidationError, match="software DGE"):
        run("""
@nki.jit
def k(data, idx):
    i = nl.ndarray(shape=(4, 1), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=i, src=idx)
    g = nl.ndarray(shape=(4, 16), dtype=data.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=g, src=data.ap(pattern=[[16, 4], [1, 16]], vector_offset=i, indirect_dim=0),
                  dge_mode=nisa.dge_mode.hwdge)
    return data
""", np.zeros((64, 16), np.float32), np.zeros((4, 1), np.uint32))


def test_dma_transpose_and_dma_compute():
    x = RNG.standard_normal((64, 32)).astype(np.float32)
    y = RNG.standard_normal((32, 64)).astype(np.float32)
    out = run("""
@nki.jit
def k(x, y):
    out = nl.ndarray(shape=(32, 64), dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(shape=(32, 64), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_transpose(dst=t, src=x)
    u = nl.ndarray(shape=(32, 64), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=u, src=y)
    nisa.dma_compute(dst=t, srcs=[t, u], reduce_op=nl.add)
    nisa.dma_copy(dst=out, src=t)
    return out
""", x, y)
    np.testing.assert_allclose(out, x.T + y, rtol=1e-6)


def test_activation_reduce_and_tensor_scalar_reduce_and_accumulating_activation():
    x = RNG.standard_normal((16, 40)).astype(np.float32)
    outs = run("""
@nki.jit
def k(x):
    o1 = nl.ndarray(shape=(16, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    o2 = nl.ndarray(shape=(16, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    o3 = nl.ndarray(shape=(16, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.load(x)
    e = nl.ndarray(shape=(16, 40), dtype=nl.float32, buffer=nl.sbuf)
    r1 = nl.ndarray(shape=(16, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation_reduce(dst=e, op=nl.exp, data=t, reduce_op=nl.maximum, reduce_res=r1, scale=0.5)
    r2 = nl.ndarray(shape=(16, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar_reduce(dst=e, data=t, op0=nl.add, operand0=1.0, reduce_op=nl.add, reduce_res=r2)
    # accumulate a sum over two activation instructions in the ScalarE registers
    r3 = nl.ndarray(shape=(16, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=e[:, 0:20], op=nl.copy, data=t[:, 0:20], reduce_op=nl.add,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.activation(dst=e[:, 20:40], op=nl.copy, data=t[:, 20:40], reduce_op=nl.add, reduce_res=r3,
                    reduce_cmd=nisa.reduce_cmd.reduce)
    nisa.dma_copy(dst=o1, src=r1)
    nisa.dma_copy(dst=o2, src=r2)
    nisa.dma_copy(dst=o3, src=r3)
    return o1, o2, o3
""", x)
    np.testing.assert_allclose(outs[0][:, 0], np.exp(0.5 * x).max(axis=1), rtol=1e-6)
    np.testing.assert_allclose(outs[1][:, 0], (x + 1).sum(axis=1), rtol=1e-5)
    np.testing.assert_allclose(outs[2][:, 0], x.sum(axis=1), rtol=1e-5, atol=1e-5)


def test_exponential_with_running_sum_on_trn3():
    x = RNG.standard_normal((8, 32)).astype(np.float32)
    out = run("""
@nki.jit
def k(x):
    o = nl.ndarray(shape=(8, 33), dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.load(x)
    m = nl.ndarray(shape=(8, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=m, op=nl.maximum, data=t, axis=1)
    r = nl.ndarray(shape=(8, 33), dtype=nl.float32, buffer=nl.sbuf)
    nisa.exponential(dst=r[:, 0:32], src=t, max_value=m, reduce_res=r[:, 32:33],
                     reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.dma_copy(dst=o, src=r)
    return o
""", x, target="trn3")
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out[:, :32], e, rtol=1e-6)
    np.testing.assert_allclose(out[:, 32], e.sum(axis=1), rtol=1e-5)


def test_select_range_select_predicated_copy_match_replace():
    x = RNG.standard_normal((4, 16)).astype(np.float32)
    pred = (RNG.random((4, 16)) > 0.5).astype(np.uint8)
    outs = run("""
@nki.jit
def k(x, pred):
    o1 = nl.ndarray(shape=(4, 17), dtype=nl.float32, buffer=nl.shared_hbm)
    o2 = nl.ndarray(shape=(4, 17), dtype=nl.float32, buffer=nl.shared_hbm)
    o3 = nl.ndarray(shape=(4, 16), dtype=nl.float32, buffer=nl.shared_hbm)
    o4 = nl.ndarray(shape=(4, 16), dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.load(x)
    p = nl.load(pred)
    r1 = nl.ndarray(shape=(4, 17), dtype=nl.float32, buffer=nl.sbuf)
    nisa.select_reduce(dst=r1[:, 0:16], predicate=p, on_true=t, on_false=-100.0, reduce_res=r1[:, 16:17],
                       reduce_cmd=nisa.reduce_cmd.reset_reduce)
    b0 = nl.full((4, 1), 3.0, dtype=nl.float32)
    b1 = nl.full((4, 1), 10.0, dtype=nl.float32)
    r2 = nl.ndarray(shape=(4, 17), dtype=nl.float32, buffer=nl.sbuf)
    nisa.range_select(dst=r2[:, 0:16], on_true_tile=t, comp_op0=nl.greater_equal, comp_op1=nl.less, bound0=b0,
                      bound1=b1, reduce_res=r2[:, 16:17])
    r3 = nl.zeros((4, 16), dtype=nl.float32)
    nisa.tensor_copy_predicated(dst=r3, src=t, predicate=p, reverse_pred=True)
    top = nl.ndarray(shape=(4, 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.max8(dst=top, src=t)
    r4 = nl.ndarray(shape=(4, 16), dtype=nl.float32, buffer=nl.sbuf)
    nisa.nc_match_replace8(dst=r4, data=t, vals=top, imm=-1e9)
    nisa.dma_copy(dst=o1, src=r1)
    nisa.dma_copy(dst=o2, src=r2)
    nisa.dma_copy(dst=o3, src=r3)
    nisa.dma_copy(dst=o4, src=r4)
    return o1, o2, o3, o4
""", x, pred)
    sel = np.where(pred != 0, x, -100.0)
    np.testing.assert_array_equal(outs[0][:, :16], sel)
    np.testing.assert_array_equal(outs[0][:, 16], sel.max(axis=1))
    j = np.arange(16)
    rs = np.where((j >= 3) & (j < 10), x, np.finfo(np.float32).min)
    np.testing.assert_array_equal(outs[1][:, :16], rs)
    np.testing.assert_array_equal(outs[1][:, 16], rs.max(axis=1))
    np.testing.assert_array_equal(outs[2], np.where(pred == 0, x, 0.0))
    ref = x.copy()
    for p in range(4):
        ref[p, np.argsort(-x[p])[:8]] = -1e9
    np.testing.assert_array_equal(outs[3], ref)


def test_stream_shuffle_n_gather_scan_bn_stats():
    x = RNG.standard_normal((32, 8)).astype(np.float32)
    idx = RNG.integers(0, 8, size=(32, 5)).astype(np.uint32)
    outs = run("""
@nki.jit
def k(x, idx):
    o1 = nl.ndarray(shape=(32, 8), dtype=nl.float32, buffer=nl.shared_hbm)
    o2 = nl.ndarray(shape=(32, 5), dtype=nl.float32, buffer=nl.shared_hbm)
    o3 = nl.ndarray(shape=(32, 8), dtype=nl.float32, buffer=nl.shared_hbm)
    o4 = nl.ndarray(shape=(32, 2), dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.load(x)
    s = nl.zeros((32, 8), dtype=nl.float32)
    nisa.nc_stream_shuffle(dst=s, src=t, shuffle_mask=[0] * 16 + [255] * 16)
    i = nl.load(idx)
    g = nl.ndarray(shape=(32, 5), dtype=nl.float32, buffer=nl.sbuf)
    nisa.nc_n_gather(dst=g, data=t, indices=i)
    c = nl.ndarray(shape=(32, 8), dtype=nl.float32, buffer=nl.sbuf)
    ones = nl.full((32, 8), 1.0, dtype=nl.float32)
    nisa.tensor_tensor_scan(dst=c, data0=ones, data1=t, initial=0.0, op0=nl.multiply, op1=nl.add)
    st = nl.ndarray(shape=(32, 6), dtype=nl.float32, buffer=nl.sbuf)
    nisa.bn_stats(dst=st, data=t)
    mv = nl.ndarray(shape=(32, 2), dtype=nl.float32, buffer=nl.sbuf)
    nisa.bn_aggr(dst=mv, data=st)
    nisa.dma_copy(dst=o1, src=s)
    nisa.dma_copy(dst=o2, src=g)
    nisa.dma_copy(dst=o3, src=c)
    nisa.dma_copy(dst=o4, src=mv)
    return o1, o2, o3, o4
""", x, idx)
    ref = np.zeros_like(x)
    ref[:16] = x[0]
    np.testing.assert_array_equal(outs[0], ref)
    np.testing.assert_array_equal(outs[1], np.take_along_axis(x, idx.astype(np.int64), axis=1))
    np.testing.assert_allclose(outs[2], np.cumsum(x, axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[3][:, 0], x.mean(axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[3][:, 1], x.var(axis=1), rtol=1e-5, atol=1e-6)


def test_registers_and_dynamic_range():
    out = run("""
@nki.jit
def k(n):
    o = nl.ndarray(shape=(1, 1), dtype=nl.int32, buffer=nl.shared_hbm)
    t = nl.ndarray(shape=(1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=n)
    r = nisa.register_alloc()
    nisa.register_load(r, t)
    acc = nl.zeros((1, 1), dtype=nl.float32)
    for i in nl.dynamic_range(r):
        nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=2.0)
    c = nisa.register_alloc(0)
    nisa.register_move(c, r)
    nisa.register_store(t, c)
    nisa.tensor_copy(dst=t, src=acc)
    nisa.dma_copy(dst=o, src=t)
    return o
""", np.array([[5]], np.int32))
    assert int(out[0, 0]) == 10


def test_high_level_matmul_transpose_and_identity():
    x = RNG.standard_normal((64, 32)).astype(np.float32)
    y = RNG.standard_normal((64, 48)).astype(np.float32)
    out = run("""
@nki.jit
def k(x, y):
    o1 = nl.ndarray(shape=(32, 48), dtype=nl.float32, buffer=nl.shared_hbm)
    o2 = nl.ndarray(shape=(32, 64), dtype=nl.float32, buffer=nl.shared_hbm)
    a = nl.load(x)
    b = nl.load(y)
    p = nl.matmul(a, b, transpose_x=True)
    s = nl.ndarray(shape=(32, 48), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=s, src=p)
    nl.store(o1, s)
    t = nl.transpose(a, dtype=nl.float32)
    eye = nl.shared_identity_matrix(n=32, dtype=nl.float32)
    q = nl.ndarray(shape=(32, 64), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=q, stationary=eye, moving=t, is_transpose=True)
    r = nl.ndarray(shape=(32, 64), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=r, src=q)
    nl.store(o2, r)
    return o1, o2
""", x, y)
    np.testing.assert_allclose(out[0], x.T @ y, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(out[1], x.T)


def test_double_row_fp8_matmul():
    import ml_dtypes

    a = RNG.standard_normal((128, 2, 16)).astype(ml_dtypes.float8_e4m3)
    b = RNG.standard_normal((128, 2, 64)).astype(ml_dtypes.float8_e4m3)
    out = run("""
@nki.jit
def k(a, b):
    o = nl.ndarray(shape=(16, 64), dtype=nl.float32, buffer=nl.shared_hbm)
    at = nl.load(a)
    bt = nl.load(b)
    p = nl.ndarray(shape=(16, 64), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=p, stationary=at, moving=bt, perf_mode=nisa.matmul_perf_mode.double_row)
    s = nl.ndarray(shape=(16, 64), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=s, src=p)
    nl.store(o, s)
    return o
""", a, b)
    af = a.astype(np.float32).transpose(1, 0, 2).reshape(256, 16)
    bf = b.astype(np.float32).transpose(1, 0, 2).reshape(256, 64)
    np.testing.assert_allclose(out, af.T @ bf, rtol=1e-5, atol=1e-4)
