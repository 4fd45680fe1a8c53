"""Hand-written NKI kernels against NumPy references, in fp32 and bf16."""

import ml_dtypes
import numpy as np
import pytest

from fusegraph import nkisim

BF16 = ml_dtypes.bfloat16
DTYPES = [np.float32, BF16]
TOL = {np.float32: 1e-4, BF16: 3e-2}


def rnd(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)


def f32(a):
    return np.asarray(a, dtype=np.float32)


def close(actual, expected, dtype, scale=1.0):
    actual = f32(actual)
    expected = f32(expected)
    assert actual.shape == expected.shape
    assert not np.isnan(actual).any(), "kernel read uninitialised (sentinel NaN) memory"
    err = np.abs(actual - expected).max()
    assert err <= TOL[dtype] * max(1.0, np.abs(expected).max()) * scale, err


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiled_matmul(K, dtype):
    rng = np.random.default_rng(0)
    xT = rnd(rng, (384, 256), dtype)  # K=384 (3 tiles), M=256 (2 tiles)
    w = rnd(rng, (384, 1024), dtype)  # N=1024 (2 PSUM-bank tiles)
    out = K.tiled_matmul(xT, w)
    assert out.dtype == np.dtype(dtype)
    close(out, f32(xT).T @ f32(w), dtype, scale=4)
    prof = nkisim.last_profile()
    assert prof.engines["tensor"].instructions == 2 * 2 * 3
    assert prof.peak_psum_bytes_per_partition == 2048


def test_matmul_psum_accumulation_is_per_element(K):
    """accumulate=None: the first matmul write overwrites (the NaN sentinel never leaks into the result)."""
    rng = np.random.default_rng(1)
    xT = rnd(rng, (256, 128), np.float32)
    w = rnd(rng, (256, 512), np.float32)
    out = K.tiled_matmul(xT, w)
    np.testing.assert_allclose(out, xT.T @ w, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm(K, dtype):
    rng = np.random.default_rng(2)
    x = rnd(rng, (64, 512), dtype)
    g = rnd(rng, (1, 512), dtype)
    out = K.rmsnorm(x, g, 1e-6)
    xf = f32(x)
    ref = xf / np.sqrt((xf * xf).mean(axis=1, keepdims=True) + 1e-6) * f32(g)
    close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax(K, dtype):
    rng = np.random.default_rng(3)
    x = rnd(rng, (32, 1000), dtype, scale=3.0)
    out = K.softmax(x)
    xf = f32(x)
    e = np.exp(xf - xf.max(axis=1, keepdims=True))
    close(out, e / e.sum(axis=1, keepdims=True), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope(K, dtype):
    rng = np.random.default_rng(4)
    d, T = 128, 16
    x = rnd(rng, (d, T), dtype)
    ang = rng.uniform(-3, 3, size=(d // 2, T)).astype(np.float32)
    c, s = np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)
    out = K.rope(x, c, s)
    xf, cf, sf = f32(x), f32(c), f32(s)
    h = d // 2
    ref = np.concatenate([xf[:h] * cf - xf[h:] * sf, xf[h:] * cf + xf[:h] * sf])
    close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_by_runtime_expert_id(K, dtype):
    rng = np.random.default_rng(5)
    x = rnd(rng, (128, 4), dtype)
    w = rnd(rng, (8, 128, 256), dtype)
    ids = np.array([[5, 2, 7]], dtype=np.int32)
    out = K.expert_gather_matmul(x, w, ids)
    ref = np.stack([f32(x).T @ f32(w[i]) for i in ids[0]])
    close(out, ref, dtype, scale=4)
    # the DMA reads exactly three experts' weights
    prof = nkisim.last_profile()
    assert prof.hbm_by_tensor["w"].read_bytes == 3 * 128 * 256 * np.dtype(dtype).itemsize


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_cache_row_write_at_runtime_position(K, dtype):
    rng = np.random.default_rng(6)
    cache = rnd(rng, (64, 32), dtype)
    orig = cache.copy()
    row = rnd(rng, (1, 32), dtype)
    out = K.kv_write(cache, row, np.array([[17]], dtype=np.int32))
    assert out is cache  # the returned input is the caller's array, updated in place
    np.testing.assert_array_equal(f32(cache[17]), f32(row[0]))
    np.testing.assert_array_equal(f32(np.delete(cache, 17, 0)), f32(np.delete(orig, 17, 0)))
    assert nkisim.last_profile().hbm_by_tensor["cache"].write_bytes == 32 * np.dtype(dtype).itemsize


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pos", [0, 127, 200, 255])
def test_decode_attention_over_cache(K, dtype, pos):
    rng = np.random.default_rng(7 + pos)
    d, H, S = 64, 4, 256
    q = rnd(rng, (d, H), dtype)
    kc = rnd(rng, (S, d), dtype)
    vc = rnd(rng, (S, d), dtype)
    out = K.decode_attention(q, kc, vc, np.array([[pos]], dtype=np.int32), 0.125)
    qf, kf, vf = f32(q), f32(kc), f32(vc)
    s = (qf.T @ kf[: pos + 1].T) * 0.125
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    close(out, (p @ vf[: pos + 1]).T, dtype, scale=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lnc2_splits_rows_by_program_id(K, dtype):
    rng = np.random.default_rng(8)
    x = rnd(rng, (512, 64), dtype)
    out = K.lnc_scale_rows[2](x)
    close(out, 2 * f32(x) + 1, dtype)
    prof = nkisim.last_profile()
    assert prof.lnc == 2
    assert [p["program"] for p in prof.peak_by_program] == [0, 1]
    # each program processed half the rows: 2 tiles each, 2 DMAs + 1 tensor_scalar per tile
    assert prof.engines["vector"].instructions == 4
    # nki.simulate form is equivalent
    import fusegraph.nkisim.api as api

    out2 = api.namespaces()["nki"]["simulate"](K.lnc_scale_rows[2])(x)
    close(out2, 2 * f32(x) + 1, dtype)


def test_lnc2_sendrecv_and_core_barrier(K):
    rng = np.random.default_rng(9)
    x = rnd(rng, (2, 128, 64), np.float32)
    out = K.lnc_exchange_sum[2](x)
    np.testing.assert_allclose(out, x.sum(axis=0), rtol=1e-6)


def test_lnc1_program_queries(K):
    x = np.ones((256, 8), dtype=np.float32)
    out = K.lnc_scale_rows(x)  # one program does everything
    np.testing.assert_array_equal(out, 3 * x)


def test_all_reduce_over_simulated_ranks(K):
    rng = np.random.default_rng(10)
    x = rnd(rng, (128, 64), np.float32)
    outs = nkisim.run(K.tp_all_reduce, x, ranks=2, rank_args=[(x,), (2 * x,)])
    np.testing.assert_allclose(outs[0], 3 * x, rtol=1e-6)
    np.testing.assert_allclose(outs[1], 3 * x + 1, rtol=1e-6)
    # default: every rank gets its own copy of the arguments
    outs = nkisim.run(K.tp_all_reduce, x, ranks=2)
    np.testing.assert_allclose(outs[0], 2 * x, rtol=1e-6)


def test_topk(K):
    rng = np.random.default_rng(11)
    logits = rnd(rng, (4, 64), np.float32)
    vals, idx = K.topk_experts(logits)
    np.testing.assert_array_equal(vals, -np.sort(-logits, axis=1)[:, :8])
    np.testing.assert_array_equal(idx, np.argsort(-logits, axis=1)[:, :8])
    assert idx.dtype == np.uint32
