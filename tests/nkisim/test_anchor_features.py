"""What the published anchor kernels (nki-library's TKG kernels, the hand-written Qwen3 megakernel) needed from the
interpreter (issue 14 item 1), each shown on a small kernel of our own; the official source of every behaviour is
in docs/interpreter.md ("Anchor kernels").
"""

import logging
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from fusegraph import nkisim
from fusegraph.nkisim.apiversion import use_api_version

from inline_kernels import build, expect  # noqa: E402

RNG = np.random.default_rng(14)


# ------------------------------------------------------------------ nisa.tensor_partition_reduce

_PR = """
@nki.jit
def k(x):
    out = nl.ndarray((1, 6), dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray((64, 6), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    r = nl.ndarray((1, 6), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_partition_reduce(dst=r, op=nl.{op}, data=t)
    nisa.dma_copy(dst=out, src=r)
    return out
"""


@pytest.mark.parametrize("op,ref", [("add", np.sum), ("maximum", np.max)])
def test_tensor_partition_reduce_reduces_across_partitions(op, ref):
    """2.29 stub: "Apply a reduction operation across partitions of an input data tile using GpSimd Engine";
    its SDK example reduces (128, 32, 4) into (1, 32, 4)."""
    x = RNG.standard_normal((64, 6)).astype(np.float32)
    k, _ = build(_PR.format(op=op))
    np.testing.assert_allclose(k(x), ref(x, axis=0, keepdims=True), rtol=1e-6)


def test_tensor_partition_reduce_bitwise_or_on_integers():
    x = RNG.integers(0, 2 ** 20, (64, 6)).astype(np.int32)
    k, _ = build(_PR.format(op="bitwise_or"))
    np.testing.assert_array_equal(k(x), np.bitwise_or.reduce(x, axis=0, keepdims=True))


@pytest.mark.parametrize("dst,buf,op,rule", [
    ("(2, 6)", "nl.sbuf", "nl.add", "shape"),      # the result has one partition
    ("(1, 6)", "nl.psum", "nl.add", "engine"),     # GpSimd cannot access PSUM
    ("(1, 6)", "nl.sbuf", "nl.multiply", "op"),    # add, max, bitwise_or, bitwise_and only
])
def test_tensor_partition_reduce_checks(dst, buf, op, rule):
    expect(rule, f"""
    @nki.jit
    def k(x):
        t = nl.ndarray((64, 6), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        r = nl.ndarray({dst}, dtype=nl.float32, buffer={buf})
        nisa.tensor_partition_reduce(dst=r, op={op}, data=t)  # <-
        return x
    """, np.zeros((64, 6), np.float32))


# ------------------------------------------------------------------ nisa.local_gather

_LG = """
@nki.jit
def k(src, idx):
    out = nl.ndarray((32, {valid} * {k}), dtype=src.dtype, buffer=nl.shared_hbm)
    s = nl.ndarray((32, 40), dtype=src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=s, src=src)
    i = nl.ndarray((32, 3), dtype=nl.uint16, buffer=nl.sbuf)
    nisa.dma_copy(dst=i, src=idx)
    g = nl.ndarray((32, {valid} * {k}), dtype=src.dtype, buffer=nl.sbuf)
    nisa.local_gather(dst=g, src_buffer=s, index=i, num_elem_per_idx={k}, num_valid_indices={valid})  # <-
    nisa.dma_copy(dst=out, src=g)
    return out
"""


def _local_gather_ref(src: np.ndarray, idx: np.ndarray, k: int, valid: int) -> np.ndarray:
    """The NumPy semantics of the 2.29 example (test_nki_isa_local_gather.py), with element offsets."""
    out = np.empty((src.shape[0], valid, k), src.dtype)
    for c in range(src.shape[0] // 16):
        rows = slice(16 * c, 16 * c + 16)
        ids = idx[rows].flatten(order="F")[:valid]
        for j, e in enumerate(ids):
            out[rows, j, :] = src[rows, e:e + k]
    return out.reshape(src.shape[0], -1)


def test_local_gather_gathers_within_each_16_partition_core():
    src = RNG.standard_normal((32, 40)).astype(np.float32)
    idx = RNG.integers(0, 19, (32, 3)).astype(np.uint16) * 2
    k, _ = build(_LG.format(k=2, valid=40))
    np.testing.assert_array_equal(k(src, idx), _local_gather_ref(src, idx, 2, 40))


def test_local_gather_out_of_bound_index_is_undefined():
    src = np.zeros((32, 40), np.float32)
    idx = np.full((32, 3), 39, np.uint16)  # 39 + 2 elements leave the 40 of a partition
    expect("undefined", _LG.format(k=2, valid=40), src, idx, match="outside")


def test_local_gather_checks_its_constraints():
    src = np.zeros((32, 40), np.float32)
    idx = np.zeros((32, 3), np.uint16)
    expect("shape", _LG.format(k=3, valid=40), src, idx, match="num_elem_per_idx")
    expect("shape", _LG.format(k=1, valid=49), src, idx, match="num_valid_indices")
    expect("dtype", _LG.format(k=1, valid=40).replace("nl.uint16", "nl.int32"), src, idx.astype(np.int32),
           match="uint16")


# ------------------------------------------------------------------ raw dge_mode ints

_DGE = """
@nki.jit
def k(x):
    out = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    for i in range(3):
        nisa.dma_copy(dst=t, src=x, dge_mode={mode})
    nisa.dma_copy(dst=out, src=t)
    return out
"""


def test_raw_dge_mode_int_is_accepted_with_one_warning_per_site(caplog):
    """nki-library's 2.29 branch and the hand-written megakernel pass dge_mode=3 / dge_mode=0 in hardware-tested
    kernels: accepted as the member of that value, warned once per call site."""
    x = RNG.standard_normal((128, 64)).astype(np.float32)
    k, _ = build(_DGE.format(mode=3))
    with caplog.at_level(logging.WARNING, logger="fusegraph.nkisim.enums"):
        np.testing.assert_array_equal(k(x), x)
    msgs = [r.getMessage() for r in caplog.records if "raw dge_mode=3" in r.getMessage()]
    assert len(msgs) == 1 and "dge_mode.none" in msgs[0]
    assert nkisim.last_profile().dmas[0].dge_mode == "none"


@pytest.mark.parametrize("mode", ["7", "'none'", "True"])
def test_other_raw_dge_values_are_still_rejected(mode):
    expect("enum-arg", _DGE.format(mode=mode).replace("dge_mode=" + mode + ")", "dge_mode=" + mode + ")  # <-"),
           np.zeros((128, 64), np.float32))


# ------------------------------------------------------------------ .ap() on an on-chip column slice

def test_ap_partition_step_of_one_on_a_column_slice_addresses_consecutive_partitions():
    """Hardware APs address partitions: on a [P, 1] column of a wider tile, the partition step 1 (the view's free
    size) is the next partition (the hand kernel's ``qnw_sb.ap([[1, PMAX], [0, GQA]])``)."""
    k, _ = build("""
    @nki.jit
    def k(x):
        out = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 3), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        b = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=b, src=t[0:128, 1:2].ap([[1, 128], [0, 4]]))
        nisa.dma_copy(dst=out, src=b)
        return out
    """)
    x = RNG.standard_normal((128, 3)).astype(np.float32)
    with use_api_version("sdk-2.27"):  # the hand kernel's SDK; 0.3 rejects .ap on a slice (tests/nkisim/test_ap_views.py)
        np.testing.assert_array_equal(k(x), np.repeat(x[:, 1:2], 4, axis=1))


def test_ap_with_the_allocation_free_size_as_partition_step_still_works():
    k, _ = build("""
    @nki.jit
    def k(x):
        out = nl.ndarray((64, 2), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((64, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.dma_copy(dst=out, src=t.ap([[8, 64], [3, 2]], offset=1))
        return out
    """)
    x = RNG.standard_normal((64, 8)).astype(np.float32)
    np.testing.assert_array_equal(k(x), x[:, 1:5:3])


@pytest.mark.parametrize("use", [
    "nisa.tensor_copy(dst=b, src=t.ap([[6, 32], [0, 3]], offset=1))  # <-",   # every other partition
    "nisa.dma_copy(dst=b, src=t.ap([[6, 32], [1, 3]]))  # <-",                   # as a DMA endpoint too
])
def test_partition_skipping_ap_is_still_rejected(use):
    """Access-pattern guide: "the step of the leading dimension must be the element count of the entire free
    dimension of the tensor" -- partitions cannot be skipped."""
    expect("partition-stride", f"""
    @nki.jit
    def k(x):
        t = nl.ndarray((64, 3), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        b = nl.ndarray((32, 3), dtype=nl.float32, buffer=nl.sbuf)
        {use}
        return x
    """, np.zeros((64, 3), np.float32))


# ------------------------------------------------------------------ language semantics the kernels rely on

def test_a_tensor_in_a_condition_is_a_present_reference():
    """Language guide: conditions are resolved at specialization time on compile-time values; nki-library's
    moe_tkg writes ``if params.expert_params and params.expert_params.expert_index:``."""
    k, _ = build("""
    @nki.jit
    def k(x, y=None):
        out = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=y if y else x)
        nisa.dma_copy(dst=out, src=t)
        return out
    """)
    x, y = np.zeros((128, 4), np.float32), np.ones((128, 4), np.float32)
    np.testing.assert_array_equal(k(x, y), y)
    np.testing.assert_array_equal(k(x), x)


def test_nkiobject_fields_without_default_default_to_none():
    """Language guide, "Class Support": the compiler's default ``__init__`` of ``x: int; y: bool = False`` is
    ``__init__(self, x=None, y=False)`` and calls ``__post_init__``; nki-library's mlp_tkg omits a field."""
    k, _ = build("""
    from dataclasses import dataclass

    @dataclass
    class Dims(nl.NKIObject):
        rows: int
        cols: int
        scale: float = 2.0

        def __post_init__(self):
            self.cols = self.cols if self.cols is not None else 4

    @nki.jit
    def k(x):
        d = Dims(rows=128)
        out = nl.ndarray((d.rows, d.cols), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((d.rows, d.cols), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=d.scale)
        nisa.dma_copy(dst=out, src=t)
        return out
    """)
    x = RNG.standard_normal((128, 4)).astype(np.float32)
    np.testing.assert_array_equal(k(x), 2 * x)


def test_nested_jit_kernel_is_inlined():
    """Every call is inlined at specialization time; nki-library's @nki.jit attention_block_tkg calls the
    @nki.jit kernels qkv and output_projection_tkg."""
    k, _ = build("""
    @nki.jit
    def double(t):
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
        return t

    @nki.jit
    def k(x):
        out = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        double(t)
        nisa.dma_copy(dst=out, src=t)
        return out
    """)
    x = RNG.standard_normal((128, 4)).astype(np.float32)
    np.testing.assert_array_equal(k(x), 2 * x)
    assert nkisim.last_profile().engines["vector"].instructions == 1


def test_nc_version_is_ordered():
    """nki-library 2.29 (attention_tkg.py): ``nisa.get_nc_version() >= nisa.nc_version.gen4``."""
    k, _ = build("""
    @nki.jit
    def k(x):
        out = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        v = nisa.get_nc_version()
        if v >= nisa.nc_version.gen4 and v > 3 and not v < nisa.nc_version.gen3:
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
        nisa.dma_copy(dst=out, src=t)
        return out
    """)
    x = np.zeros((128, 4), np.float32)
    np.testing.assert_array_equal(nkisim.run(k, x, target="trn3"), x + 1)
    np.testing.assert_array_equal(nkisim.run(k, x, target="trn2"), x)


def test_direct_dma_transpose_accepts_dge_mode_none():
    """nki-library's mlp_tkg gate/up bias load: a direct dma_transpose with dge_mode=3 (none)."""
    k, _ = build("""
    @nki.jit
    def k(x):
        out = nl.ndarray((32, 16), dtype=nl.bfloat16, buffer=nl.shared_hbm)
        t = nl.ndarray((32, 16), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t, src=x, dge_mode=nisa.dge_mode.none)
        nisa.dma_copy(dst=out, src=t)
        return out
    """)
    x = RNG.standard_normal((16, 32)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(k(x), x.T)


# ------------------------------------------------------------------ the legacy neuronxcc.nki.typing namespace

def test_legacy_neuronxcc_typing_inside_as_nki(tmp_path, monkeypatch):
    """nki-library's router_topk annotates outputs with ``neuronxcc.nki.typing.mutable_tensor`` (the Beta 1
    namespace the SDK still ships); only typing is provided, and nothing stays in sys.modules afterwards."""
    (tmp_path / "legacy_kernel.py").write_text(textwrap.dedent("""
        import nki
        import nki.isa as nisa
        import nki.language as nl
        import neuronxcc.nki.typing as nt

        def k(x: nl.ndarray, out: nt.mutable_tensor):
            t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x)
            nisa.dma_copy(dst=out, src=t)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    with nkisim.as_nki():
        import legacy_kernel

        with pytest.raises(ModuleNotFoundError):
            import neuronxcc.nki.language  # noqa: F401 - the Beta 1 language is not provided
    assert "neuronxcc" not in sys.modules and "neuronxcc.nki.typing" not in sys.modules
    x = RNG.standard_normal((128, 4)).astype(np.float32)
    out = np.zeros_like(x)
    nkisim.run(legacy_kernel.k, x, out)
    np.testing.assert_array_equal(out, x)


# ------------------------------------------------------------------ DMA bytes of a converting copy

def test_converting_dma_counts_bytes_read_and_written():
    """A bf16 -> fp32 load reads 2 and writes 4 bytes per element; it moves their mean, not the larger size."""
    k, _ = build("""
    @nki.jit
    def k(x):
        out = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.dma_copy(dst=out, src=t)
        return out
    """)
    x = RNG.standard_normal((128, 64)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(k(x), x.astype(np.float32))
    p = nkisim.last_profile()
    load = next(d for d in p.dmas if d.src_tensor == "x")
    n = 128 * 64
    assert (load.read_bytes, load.write_bytes, load.bytes) == (2 * n, 4 * n, 3 * n)
    assert p.hbm_by_tensor["x"].read_bytes == 2 * n
    assert (p.dma_read_bytes, p.dma_write_bytes, p.dma_bytes) == (6 * n, 8 * n, 7 * n)


# ------------------------------------------------------------------ the per-instruction trace

def test_trace_records_program_order_dependencies_and_layer(tmp_path, monkeypatch):
    """``run(trace=True, trace_layer=...)``: one event per instruction of each program, with the storages it read
    and wrote and the value of the layer loop variable -- across a helper in another file."""
    (tmp_path / "trace_helper.py").write_text(textwrap.dedent("""
        import nki.isa as nisa
        import nki.language as nl

        def scale(t, s):
            nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=s)
    """))
    (tmp_path / "trace_kernel.py").write_text(textwrap.dedent("""
        import nki
        import nki.isa as nisa
        import nki.language as nl
        from trace_helper import scale

        @nki.jit
        def k(x):
            out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
            t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x)
            for layer in range(3):
                scale(t, 2.0)
            nisa.dma_copy(dst=out, src=t)
            return out
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    with nkisim.as_nki():
        import trace_kernel
    x = RNG.standard_normal((128, 4)).astype(np.float32)
    np.testing.assert_array_equal(nkisim.run(trace_kernel.k, x, trace=True, trace_layer="k:layer"), 8 * x)
    p = nkisim.last_profile()
    ev = p.trace[(0, 0)]
    assert [e.opcode for e in ev] == ["dma_copy"] + ["tensor_scalar"] * 3 + ["dma_copy"]
    assert [e.layer for e in ev] == [None, 0, 1, 2, None]
    assert {e.file.rsplit("/", 1)[-1] for e in ev} == {"trace_kernel.py", "trace_helper.py"}
    t_key = ev[0].writes[0]
    assert all(e.reads == (t_key,) and e.writes == (t_key,) for e in ev[1:4]) and ev[4].reads == (t_key,)
    assert ev[0].dma["bytes"] == x.nbytes and ev[1].dma is None
    assert "trace" not in p.to_dict()
    nkisim.run(trace_kernel.k, x)
    assert nkisim.last_profile().trace is None
