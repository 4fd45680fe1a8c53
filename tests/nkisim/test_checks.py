"""Every hardware/API check trips with a message naming the rule and the kernel file:line."""

import textwrap

import numpy as np
import pytest

from fusegraph import nkisim
from fusegraph.nkisim import NkiSimError, NkiValidationError, load_kernel_source

import inline_kernels  # noqa: E402

HDR = inline_kernels.HDR + "import nki.collectives as nccl\n"


def build(body: str, name: str = "k"):
    return inline_kernels.build(body, name, header=HDR, prefix="check")


def expect(rule: str, body: str, *args, match: str = "", exc=NkiSimError, target: str = "trn2", **kw):
    return inline_kernels.expect(rule, body, *args, match=match, exc=exc, target=target, header=HDR, **kw)


X = np.zeros((128, 512), dtype=np.float32)


def test_partition_dim_limit():
    expect("partition-dim", """
    @nki.jit
    def k(x):
        t = nl.ndarray((256, 64), dtype=nl.float32, buffer=nl.sbuf)  # <-
        return x
    """, X, match="exceeds maximum 128")


def test_start_partition_rule():
    expect("start-partition", """
    @nki.jit
    def k(x):
        t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=0.0)
        u = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=u[16:48, :], src=t[16:48, :])  # <-
        return x
    """, X, match="starts at partition 16 with 32 partitions")


def test_start_partition_64_allows_0_and_64_only():
    expect("start-partition", """
    @nki.jit
    def k(x):
        t = nl.zeros((128, 64), dtype=nl.float32)
        nisa.tensor_copy(dst=t[32:96, :], src=t[32:96, :])  # <-
        return x
    """, X, match="33-64 at 0 or 64")


def test_inputs_must_be_partition_aligned():
    expect("partition-alignment", """
    @nki.jit
    def k(x):
        t = nl.zeros((128, 64), dtype=nl.float32)
        o = nl.ndarray((64, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=o, data1=t[0:64, :], data2=t[64:128, :], op=nl.add)  # <-
        return x
    """, X, match="must start on the same partition")


def test_cross_half_copy_is_allowed_but_not_above_64_partitions():
    k, _ = build("""
    @nki.jit
    def k(x):
        t = nl.zeros((128, 64), dtype=nl.float32)
        o = nl.ndarray((64, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o, src=t[64:128, :])
        return x
    """)
    nkisim.run(k, X)


def test_partition_stride_rejected_for_compute():
    expect("partition-stride", """
    @nki.jit
    def k(x):
        t = nl.zeros((128, 64), dtype=nl.float32)
        o = nl.ndarray((64, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o, src=t[0:128:2, :])  # <-
        return x
    """, X)


def test_free_access_must_stay_in_partition():
    expect("partition-bounds", """
    @nki.jit
    def k(x):
        t = nl.zeros((128, 64), dtype=nl.float32)
        o = nl.ndarray((64, 128), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o, src=t.ap(pattern=[[64, 64], [1, 128]], offset=0))  # <-
        return x
    """, X)


def test_access_pattern_at_most_4_free_dims():
    expect("access-pattern", """
    @nki.jit
    def k(x):
        t = nl.zeros((128, 1024), dtype=nl.float32)
        o = nl.ndarray((128, 32), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o, src=t.ap(pattern=[[1024, 128], [512, 2], [128, 2], [32, 2], [8, 2], [2, 2]]))  # <-
        return x
    """, X, match="free-dim access-pattern dims")


def test_matmul_operand_buffers():
    expect("buffer", """
    @nki.jit
    def k(x):
        a = nl.zeros((128, 128), dtype=nl.bfloat16)
        b = nl.zeros((128, 512), dtype=nl.float32, buffer=nl.psum)
        d = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=d, stationary=a, moving=b)  # <-
        return x
    """, X, match="moving must be in SBUF")


def test_matmul_fp32_must_pair_with_fp32():
    expect("dtype", """
    @nki.jit
    def k(x):
        a = nl.zeros((128, 128), dtype=nl.float32)
        b = nl.zeros((128, 512), dtype=nl.bfloat16)
        d = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=d, stationary=a, moving=b)  # <-
        return x
    """, X, match="fp32/tf32 inputs must pair")


def test_matmul_dst_bf16_only_on_trn3():
    body = """
    @nki.jit
    def k(x):
        a = nl.zeros((128, 128), dtype=nl.bfloat16)
        b = nl.zeros((128, 512), dtype=nl.bfloat16)
        d = nl.ndarray((128, 512), dtype=nl.bfloat16, buffer=nl.psum)
        nisa.nc_matmul(dst=d, stationary=a, moving=b)  # <-
        return x
    """
    expect("dtype", body, X, match="dst must be float32 on trn2")
    k, _ = build(body)
    nkisim.run(k, X, target="trn3")


def test_matmul_moving_free_size_limit():
    e = expect("psum-bank", """
    @nki.jit
    def k(x):
        d = nl.ndarray((128, 1024), dtype=nl.float32, buffer=nl.psum)  # <-
        return x
    """, X, match="may not cross a 2048-byte bank")
    assert "trn2" in str(e)
    # trn3: a matmul may write a whole-PSUM [128, 4096] fp32 tile (8 banks)
    k, _ = build("""
    @nki.jit
    def k(x):
        a = nl.zeros((128, 128), dtype=nl.bfloat16)
        b = nl.zeros((128, 4096), dtype=nl.bfloat16)
        d = nl.ndarray((128, 4096), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=d, stationary=a, moving=b)
        return x
    """)
    nkisim.run(k, X, target="trn3")
    assert nkisim.last_profile().peak_psum_banks == 8


def test_matmul_dst_partition_must_match_pe_column():
    expect("matmul-tile", """
    @nki.jit
    def k(x):
        a = nl.zeros((128, 32), dtype=nl.bfloat16)
        b = nl.zeros((128, 512), dtype=nl.bfloat16)
        d = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=d[32:64, :], stationary=a, moving=b)  # <-
        return x
    """, X, match="tile_position=(row, 32)")
    k, _ = build("""
    @nki.jit
    def k(x):
        a = nl.zeros((128, 32), dtype=nl.bfloat16)
        b = nl.zeros((128, 512), dtype=nl.bfloat16)
        d = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=d[32:64, :], stationary=a, moving=b, tile_position=(0, 32), tile_size=(128, 32))
        nisa.nc_matmul(dst=d[64:96, :], stationary=a, moving=b, tile_position=(0, 64))
        return x
    """)
    nkisim.run(k, X)


def test_matmul_accumulate_onto_memset_psum_undefined_on_trn2():
    body = """
    @nki.jit
    def k(x):
        a = nl.zeros((128, 128), dtype=nl.bfloat16)
        b = nl.zeros((128, 512), dtype=nl.bfloat16)
        d = nl.zeros((128, 512), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=d, stationary=a, moving=b, accumulate=True)  # <-
        return x
    """
    expect("matmul-accumulate", body, X, match="undefined on trn2")
    k, _ = build(body)
    nkisim.run(k, X, target="trn3")


def test_psum_accumulate_none_resets_after_non_matmul_write():
    k, _ = build("""
    @nki.jit
    def k(a, b):
        out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
        at = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.sbuf)
        bt = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=at, src=a)
        nisa.dma_copy(dst=bt, src=b)
        d = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=d, stationary=at, moving=bt)           # overwrites the NaN sentinel
        nisa.nc_matmul(dst=d, stationary=at, moving=bt)           # accumulates
        nisa.nc_matmul(dst=d[:, 0:256], stationary=at, moving=bt[:, 0:256], accumulate=True)
        s = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=s, src=d)
        nisa.memset(dst=d[:, 256:512], value=0.0)                  # non-matmul write ends the group there
        nisa.nc_matmul(dst=d[:, 0:256], stationary=at, moving=bt[:, 0:256])      # still in a group: accumulates
        nisa.nc_matmul(dst=d[:, 256:512], stationary=at, moving=bt[:, 256:512])  # reset: overwrites
        nisa.tensor_tensor(dst=s, data1=s, data2=d, op=nl.add)
        nisa.dma_copy(dst=out, src=s)
        return out
    """)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((128, 128), dtype=np.float32)
    b = rng.standard_normal((128, 512), dtype=np.float32)
    out = nkisim.run(k, a, b)
    m = a.T @ b
    np.testing.assert_allclose(out[:, :256], 3 * m[:, :256] + 4 * m[:, :256], rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(out[:, 256:], 2 * m[:, 256:] + 1 * m[:, 256:], rtol=1e-4, atol=1e-3)


def test_memset_value_type_must_match_dtype():
    expect("dtype", """
    @nki.jit
    def k(x):
        t = nl.ndarray((128, 64), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=2.0)  # <-
        return x
    """, X, match="must be an integer literal")


def test_tensor_tensor_shape_mismatch():
    expect("shape", """
    @nki.jit
    def k(x):
        a = nl.zeros((128, 64), dtype=nl.float32)
        b = nl.zeros((128, 32), dtype=nl.float32)
        nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.add)  # <-
        return x
    """, X, match="elements per partition")


def test_gpsimd_cannot_access_psum():
    expect("engine", """
    @nki.jit
    def k(x):
        p = nl.zeros((128, 64), dtype=nl.float32, buffer=nl.psum)
        s = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=s, src=p, engine=nisa.engine.gpsimd)  # <-
        return x
    """, X, match="GpSimd engine cannot access PSUM")


@pytest.mark.parametrize(
    "call,match",
    [
        ("nisa.dma_copy(dst=t, src=x, oob_mode=0)", "oob_mode must be a oob_mode enum member"),
        ("nisa.dma_copy(dst=t, src=x, dge_mode='hwdge')", "dge_mode must be a dge_mode enum member"),
        ("nisa.tensor_tensor(dst=t, data1=t, data2=t, op='add')", "raw ints/strings are rejected"),
        ("nisa.activation(dst=t, op=nl.exp, data=t, reduce_cmd=0)", "reduce_cmd must be a reduce_cmd enum"),
    ],
)
def test_enum_args_must_be_objects(call, match):
    expect("enum-arg", f"""
    @nki.jit
    def k(x):
        t = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=0.0)
        {call}  # <-
        return x
    """, X, match=match)


def test_buffer_args_must_be_objects():
    expect("enum-arg", """
    @nki.jit
    def k(x):
        t = nl.ndarray((128, 512), dtype=nl.float32, buffer="sbuf")  # <-
        return x
    """, X, match="buffer must be a buffer object")


def test_kernel_outputs_must_be_shared_hbm():
    e = expect("kernel-output", """
    @nki.jit  # <-
    def k(x):
        out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.hbm)
        nisa.dma_copy(dst=out, src=x)
        return out
    """, X, match="must be allocated with buffer=nl.shared_hbm")
    assert "private_hbm" in str(e)
    expect("kernel-output", """
    @nki.jit  # <-
    def k(x):
        t = nl.zeros((128, 512), dtype=nl.float32)
        return t
    """, X)


def test_no_dma_from_psum():
    expect("dma-psum", """
    @nki.jit
    def k(x):
        p = nl.zeros((128, 512), dtype=nl.float32, buffer=nl.psum)
        nisa.dma_copy(dst=x, src=p)  # <-
        return x
    """, X, match="copy PSUM->SBUF with nisa.tensor_copy first")


def test_hwdge_requires_identical_dtypes():
    expect("dma-dtype", """
    @nki.jit
    def k(x):
        t = nl.ndarray((128, 512), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x, dge_mode=nisa.dge_mode.hwdge)  # <-
        return x
    """, X, match="use .view(dtype)")
    k, _ = build("""
    @nki.jit
    def k(x):
        out = nl.ndarray((128, 512), dtype=nl.bfloat16, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 512), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x, dge_mode=nisa.dge_mode.swdge)
        nisa.dma_copy(dst=out, src=t, dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.sync)
        return out
    """)
    out = nkisim.run(k, np.full((128, 512), 1.5, dtype=np.float32))
    assert float(out[3, 7]) == 1.5


def test_sbuf_capacity_and_budget():
    body = """
    @nki.jit
    def k(x):
        a = nl.ndarray((128, 28000), dtype=nl.float32, buffer=nl.sbuf)
        b = nl.ndarray((128, 28000), dtype=nl.float32, buffer=nl.sbuf)  # <-
        nisa.memset(dst=a, value=0.0)
        nisa.memset(dst=b, value=0.0)
        nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.add)
        return x
    """
    e = expect("sbuf-capacity", body, X, match="usable budget of 212992")
    assert isinstance(e, nkisim.NkiCapacityError)
    k, _ = build(body)
    nkisim.run(k, X, sbuf_budget=224 * 1024, shape_only=True)
    assert nkisim.last_profile().peak_sbuf_bytes_per_partition == 224000
    expect("sbuf-capacity", """
    @nki.jit
    def k(x):
        a = nl.ndarray((128, 62000), dtype=nl.float32, buffer=nl.sbuf)  # <-
        return x
    """, X, target="trn3")


def test_sbuf_overflow_compiler_mode_accepts_and_records_compiler_placed_tensors(monkeypatch):
    """neuronx-cc fits compiler-placed tensors whose live bytes exceed the partition (the runtime's device-memory page:
    the scratchpad holds intermediary SBUF data; nki-library's RoPE test rows need it). ``sbuf_overflow="compiler"``
    accepts them and records the over-budget demand; kernel-placed tensors beyond the budget stay errors."""
    k, _ = build("""
    @nki.jit
    def k(x):
        a = nl.ndarray((128, 28000), dtype=nl.float32, buffer=nl.sbuf)
        b = nl.ndarray((128, 28000), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=a, value=0.0)
        nisa.memset(dst=b, value=1.0)
        nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.add)
        out = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=a[:, 0:8])
        return out
    """)
    out = nkisim.run(k, X, sbuf_overflow="compiler")
    assert float(out[5, 3]) == 1.0
    prof = nkisim.last_profile()
    assert prof.sbuf_over_budget_bytes == 224000 > prof.sbuf_budget_bytes
    assert "SBUF over budget" in prof.summary()
    nkisim.run(k, X, sbuf_overflow="compiler", sbuf_budget=224 * 1024)
    assert nkisim.last_profile().sbuf_over_budget_bytes == 0
    monkeypatch.setenv("FUSEGRAPH_NKISIM_SBUF_OVERFLOW", "compiler")
    nkisim.run(k, X)
    assert nkisim.last_profile().sbuf_over_budget_bytes == 224000
    monkeypatch.setenv("FUSEGRAPH_NKISIM_SBUF_OVERFLOW", "spill-somewhere")
    with pytest.raises(ValueError, match="sbuf_overflow must be one of"):
        nkisim.run(k, X)
    monkeypatch.delenv("FUSEGRAPH_NKISIM_SBUF_OVERFLOW")
    with pytest.raises(nkisim.NkiCapacityError, match="sbuf_overflow='compiler'"):
        nkisim.run(k, X)
    placed, _ = build("""
    @nki.jit
    def k(x):
        a = nl.ndarray((128, 28000), dtype=nl.float32, buffer=nl.sbuf, address=(0, 150000))
        nisa.memset(dst=a, value=0.0)
        return x
    """)
    with pytest.raises(nkisim.NkiCapacityError, match="sbuf-capacity"):
        nkisim.run(placed, X, sbuf_overflow="compiler")


def test_sbuf_budget_env(monkeypatch):
    monkeypatch.setenv("FUSEGRAPH_SBUF_BUDGET", "4096")
    expect("sbuf-capacity", """
    @nki.jit
    def k(x):
        a = nl.ndarray((128, 2048), dtype=nl.float32, buffer=nl.sbuf)  # <-
        return x
    """, X, match="budget of 4096")


def test_liveness_frees_tiles_after_last_use():
    # 40 tiles of 64 KiB each, but only two are live at a time: fits easily
    k, _ = build("""
    @nki.jit
    def k(x):
        for i in nl.affine_range(40):
            t = nl.ndarray((128, 16384), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=t, value=0.0)
            u = nl.ndarray((128, 16384), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=u, src=t)
        return x
    """)
    nkisim.run(k, X, shape_only=True)
    assert nkisim.last_profile().peak_sbuf_bytes_per_partition == 2 * 65536


def test_psum_capacity_8_banks():
    e = expect("psum-capacity", """
    @nki.jit
    def k(x):
        tiles = []
        for i in nl.affine_range(9):
            p = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)  # <-
            nisa.memset(dst=p, value=0.0)
            tiles.append(p)
        for p in tiles:
            nisa.memset(dst=p, value=1.0)
        return x
    """, X, match="8 banks x 2048 B")
    assert isinstance(e, nkisim.NkiCapacityError)


def test_psum_small_tensors_share_banks():
    k, _ = build("""
    @nki.jit
    def k(x):
        tiles = [nl.zeros((128, 128), dtype=nl.float32, buffer=nl.psum) for i in range(32)]
        for p in tiles:
            nisa.memset(dst=p, value=1.0)
        return x
    """)
    nkisim.run(k, X)
    prof = nkisim.last_profile()
    assert prof.peak_psum_bytes_per_partition == 16384 and prof.peak_psum_banks == 8


def test_runtime_index_out_of_bounds_and_skip():
    body = """
    @nki.jit
    def k(w, ids):
        out = nl.ndarray((1, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        i = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=i, src=ids)
        t = nl.ndarray((1, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=-1.0)
        nisa.dma_copy(dst=t, src=w.ap(pattern=[[8, 1], [1, 8]], scalar_offset=i, indirect_dim=0), MODE)  # <-
        nisa.dma_copy(dst=out, src=t)
        return out
    """
    w = np.arange(32, dtype=np.float32).reshape(4, 8)
    expect("out-of-bounds", body.replace("MODE", "oob_mode=nisa.oob_mode.error"), w, np.array([[4]], np.int32),
           match="runtime scalar_offset value 4")
    k, _ = build(body.replace("MODE", "oob_mode=nisa.oob_mode.skip"))
    np.testing.assert_array_equal(nkisim.run(k, w, np.array([[4]], np.int32)), -np.ones((1, 8)))
    np.testing.assert_array_equal(nkisim.run(k, w, np.array([[2]], np.int32)), w[2:3])


def test_slice_out_of_bounds():
    expect("index", """
    @nki.jit
    def k(x):
        t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        u = t[:, nl.ds(32, 64)]  # <-
        return x
    """, X, match="out of bounds")


def test_exponential_is_trn3_only():
    body = """
    @nki.jit
    def k(x):
        t = nl.zeros((128, 64), dtype=nl.float32)
        nisa.exponential(dst=t, src=t)  # <-
        return x
    """
    expect("target", body, X, match="only available on NeuronCore-v4")
    k, _ = build(body)
    nkisim.run(k, X, target="trn3")


def test_sendrecv_needs_lnc2():
    expect("lnc", """
    @nki.jit
    def k(x):
        t = nl.zeros((128, 64), dtype=nl.float32)
        nisa.sendrecv(src=t, dst=t, send_to_rank=1, recv_from_rank=1, pipe_id=0)  # <-
        return x
    """, X)


def test_sendrecv_deadlock_is_reported(monkeypatch):
    monkeypatch.setenv("FUSEGRAPH_NKISIM_SYNC_TIMEOUT", "0.5")
    k, loc = build("""
    @nki.jit
    def k(x):
        t = nl.zeros((128, 64), dtype=nl.float32)
        if nl.program_id(axis=0) == 0:
            nisa.sendrecv(src=t, dst=t, send_to_rank=1, recv_from_rank=1, pipe_id=0)  # <-
        return x
    """)
    with pytest.raises(nkisim.NkiSyncError) as ei:
        k[2](X)
    assert ei.value.rule == "sync" and loc in str(ei.value) and "deadlock" in str(ei.value)


def test_peer_failure_aborts_the_other_program():
    k, loc = build("""
    @nki.jit
    def k(x):
        t = nl.zeros((128, 64), dtype=nl.float32)
        if nl.program_id(axis=0) == 1:
            bad = nl.ndarray((256, 1), dtype=nl.float32, buffer=nl.sbuf)  # <-
        nisa.sendrecv(src=t, dst=t, send_to_rank=1 - nl.program_id(axis=0), recv_from_rank=1 - nl.program_id(axis=0),
                      pipe_id=0)
        return x
    """)
    with pytest.raises(NkiValidationError) as ei:
        k[2](X)
    assert ei.value.rule == "partition-dim" and loc in str(ei.value)


def test_find_index_of_missing_value_is_undefined():
    expect("undefined", """
    @nki.jit
    def k(x):
        t = nl.zeros((128, 64), dtype=nl.float32)
        v = nl.full((128, 8), 5.0, dtype=nl.float32)
        i = nl.ndarray((128, 8), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.nc_find_index8(dst=i, data=t, vals=v)  # <-
        return x
    """, X)


def test_activation_op_must_be_activation_function():
    expect("op", """
    @nki.jit
    def k(x):
        t = nl.zeros((128, 64), dtype=nl.float32)
        nisa.activation(dst=t, op=nl.cos, data=t)  # <-
        return x
    """, X, match="not an activation function")


def test_tensor_scalar_operand_tensor_must_be_fp32():
    expect("dtype", """
    @nki.jit
    def k(x):
        t = nl.zeros((128, 64), dtype=nl.float32)
        s = nl.zeros((128, 1), dtype=nl.bfloat16)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=s)  # <-
        return x
    """, X, match="operand0 must be float32")


def test_nested_launch_with_another_grid_is_rejected():
    """A nested @nki.jit call is inlined (tests/nkisim/test_anchor_features.py); a different grid cannot be."""
    k, loc = build("""
    @nki.jit
    def inner(x):
        return x

    @nki.jit
    def k(x):
        inner[2](x)  # <-
        return x
    """)
    with pytest.raises(NkiValidationError) as ei:
        nkisim.run(k, X)
    assert ei.value.rule == "nested-jit" and loc in str(ei.value)


def test_unimplemented_official_function():
    k, loc = build("""
    @nki.jit
    def k(x):
        t = nl.zeros((128, 64), dtype=nl.float32)
        nisa.nonzero_with_count(dst=t, src=t)  # <-
        return x
    """)
    with pytest.raises(NotImplementedError,
                       match="nki.isa.nonzero_with_count is not implemented by fusegraph's interpreter"):
        nkisim.run(k, X)


def test_error_names_kernel_line_when_raised_in_a_helper_file():
    helper = load_kernel_source(
        HDR + "def helper(t):\n    nisa.memset(dst=t, value=1.5)\n", "/virtual/helper_file.py"
    )
    src = HDR + textwrap.dedent("""
    @nki.jit
    def k(x):
        t = nl.ndarray((128, 64), dtype=nl.int32, buffer=nl.sbuf)
        helper(t)  # <-
        return x
    """)
    ns = load_kernel_source(src, "/virtual/main_kernel.py")
    ns["helper"] = helper["helper"]
    line = [i + 1 for i, s in enumerate(src.splitlines()) if "# <-" in s][0]
    with pytest.raises(NkiValidationError) as ei:
        nkisim.run(ns["k"], X)
    msg = str(ei.value)
    assert f"/virtual/main_kernel.py:{line}" in msg and "/virtual/helper_file.py:6" in msg


def test_inputs_in_different_quadrants_allowed_for_at_most_32_partitions():
    # nki-library's qkv_tkg adds PSUM rows [32, 34) to SBUF rows [0, 2): quadrant moves are legal for <= 32
    k, _ = build("""
    @nki.jit
    def k(x):
        s = nl.zeros((128, 64), dtype=nl.float32)
        p = nl.zeros((128, 64), dtype=nl.float32, buffer=nl.psum)
        nisa.tensor_tensor(dst=s[0:2, :], data1=s[0:2, :], data2=p[32:34, :], op=nl.add)
        return x
    """)
    nkisim.run(k, X)


def test_lenient_enums_env_accepts_raw_values(monkeypatch):
    body = """
    @nki.jit
    def k(x):
        out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x, oob_mode=0)  # <-
        nisa.dma_copy(dst=out, src=t)
        return out
    """
    expect("enum-arg", body, X)
    monkeypatch.setenv("FUSEGRAPH_NKISIM_LENIENT_ENUMS", "1")
    k, _ = build(body)
    np.testing.assert_array_equal(nkisim.run(k, X + 1), X + 1)
