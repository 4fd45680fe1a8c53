"""Shape-only runs give the data run's counters; assumptions for data-dependent indices; the profile."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fusegraph import nkisim
from fusegraph.nkisim import Abstract, AssumeRequest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pair(fn, *args, **kw):
    fn(*args, **kw) if not kw else nkisim.run(fn, *args, **kw)
    data = nkisim.last_profile()
    abstract = [Abstract(a.shape, a.dtype) if isinstance(a, np.ndarray) else a for a in args]
    out = nkisim.run(fn, *abstract, shape_only=True, **kw)
    return data, nkisim.last_profile(), out


def test_shape_only_counters_equal_data_run(K):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((64, 4), dtype=np.float32)
    kc = rng.standard_normal((256, 64), dtype=np.float32)
    vc = rng.standard_normal((256, 64), dtype=np.float32)
    data, shape, out = _pair(K.decode_attention, q, kc, vc, np.array([[0]], np.int32), 0.125)
    assert data.counters() == shape.counters()
    assert isinstance(out, Abstract) and out.shape == (64, 4)
    assert shape.shape_only and not data.shape_only

    xT = rng.standard_normal((256, 128), dtype=np.float32)
    w = rng.standard_normal((256, 512), dtype=np.float32)
    data, shape, _ = _pair(K.tiled_matmul, xT, w)
    assert data.counters() == shape.counters()

    x = rng.standard_normal((512, 64), dtype=np.float32)
    K.lnc_scale_rows[2](x)
    d2 = nkisim.last_profile()
    nkisim.run(K.lnc_scale_rows, Abstract((512, 64), "float32"), lnc=2, shape_only=True)
    assert d2.counters() == nkisim.last_profile().counters()


def test_real_arrays_are_ignored_in_shape_only_mode(K):
    x = np.full((512, 64), np.nan, dtype=np.float32)
    out = nkisim.run(K.lnc_scale_rows, x, shape_only=True)
    assert isinstance(out, Abstract)


def test_default_assumption_distinct_in_range_indices(K):
    seen = []

    def spy(req: AssumeRequest):
        seen.append(req)
        return None  # default rule

    x = Abstract((128, 4), "bfloat16")
    w = Abstract((8, 128, 256), "bfloat16")
    ids = Abstract((1, 3), "int32")
    nkisim.run(K.expert_gather_matmul, x, w, ids, shape_only=True, assume=spy)
    assert [r.name for r in seen] == ["expert_ids"] * 3
    assert [int(r.positions[0]) for r in seen] == [0, 1, 2]  # -> experts 0, 1, 2 (distinct)
    assert all(r.limit == 8 and r.kind == "scalar" and r.target == "w" for r in seen)
    assert nkisim.last_profile().hbm_by_tensor["w"].read_bytes == 3 * 128 * 256 * 2


def test_assume_dict_and_out_of_range(K):
    cache = Abstract((64, 32), "float32")
    row = Abstract((1, 32), "float32")
    pos = Abstract((1, 1), "int32")
    nkisim.run(K.kv_write, cache, row, pos, shape_only=True, assume={"position": 63})
    with pytest.raises(nkisim.NkiValidationError, match="runtime scalar_offset value 64"):
        nkisim.run(K.kv_write, cache, row, pos, shape_only=True, assume={"position": 64})


def test_huge_abstract_tensors_cost_nothing(K):
    cache = Abstract((2**24, 2048), "bfloat16")  # 64 GiB
    assert cache.nbytes == 64 * 2**30
    out = nkisim.run(K.kv_write, cache, Abstract((1, 2048), "bfloat16"), Abstract((1, 1), "int32"),
                     shape_only=True, assume={"position": 2**24 - 1})
    assert isinstance(out, Abstract) and out.shape == cache.shape
    assert nkisim.last_profile().hbm_by_tensor["cache"].write_bytes == 4096


def test_profile_contents_and_json(K):
    rng = np.random.default_rng(1)
    xT = rng.standard_normal((256, 128), dtype=np.float32)
    w = rng.standard_normal((256, 1024), dtype=np.float32)
    K.tiled_matmul(xT, w)
    p = nkisim.last_profile()
    d = json.loads(json.dumps(p.to_dict()))
    assert d["kernel"] == "tiled_matmul" and d["target"] == "trn2"
    assert p.engines["tensor"].instructions == 4 and p.engines["tensor"].elements == 4 * 128 * 512
    assert p.hbm_by_tensor["xT"].read_bytes == 2 * xT.nbytes  # reloaded for each of the 2 N tiles
    assert p.hbm_by_tensor["w"].read_bytes == w.nbytes
    out_label = [k for k, v in p.hbm_by_tensor.items() if v.kind == "output"]
    assert len(out_label) == 1 and p.hbm_by_tensor[out_label[0]].write_bytes == 128 * 1024 * 4
    assert p.hbm_read_bytes == 2 * xT.nbytes + w.nbytes
    wdma = [x for x in p.dmas if x.src_tensor == "w"][0]
    assert wdma.count == 4 and wdma.partitions == 128 and wdma.bytes_per_partition == 2048
    assert wdma.descriptors == 4 * 128 and wdma.dst_buffer == "sbuf" and wdma.src_buffer == "private_hbm"
    assert p.peak_sbuf_bytes_per_partition > 0 and p.peak_psum_bytes_per_partition == 2048
    mm = [s for s in p.sites if s.opcode == "nc_matmul"][0]
    assert mm.count == 4 and mm.file.endswith("nki_kernels.py") and mm.engine == "tensor"
    assert mm.dtypes == ["float32"] and mm.input_dtypes == {"moving": ["float32"], "stationary": ["float32"]}
    assert wdma.indirect == "" and wdma.queue == "auto" and wdma.dge_mode == "unknown"
    dmm = [s for s in d["sites"] if s["opcode"] == "nc_matmul"][0]
    assert dmm["input_dtypes"] == {"moving": ["float32"], "stationary": ["float32"]}
    assert {x["indirect"] for x in d["dmas"]} == {""}
    assert p.records[0].opcode == "dma_copy" and p.records_dropped == 0
    nkisim.run(K.tiled_matmul, xT, w, max_records=3)
    p = nkisim.last_profile()
    assert len(p.records) == 3 and p.records_dropped == p.instructions - 3


def test_profile_operand_dtypes_and_indirect_dmas(K):
    x = Abstract((128, 4), "bfloat16")
    w = Abstract((8, 128, 256), "bfloat16")
    nkisim.run(K.expert_gather_matmul, x, w, Abstract((1, 3), "int32"), shape_only=True)
    d = json.loads(json.dumps(nkisim.last_profile().to_dict()))
    mm = [s for s in d["sites"] if s["opcode"] == "nc_matmul"][0]
    assert mm["dtypes"] == ["float32"]  # the PSUM output
    assert mm["input_dtypes"] == {"moving": ["bfloat16"], "stationary": ["bfloat16"]}
    copy = [s for s in d["sites"] if s["opcode"] == "tensor_copy"][0]
    assert copy["input_dtypes"] == {"src": ["float32"]}
    by_src = {x["src_tensor"]: x for x in d["dmas"] if x["src_buffer"] != "sbuf"}
    assert by_src["w"]["indirect"] == "scalar" and by_src["w"]["count"] == 3  # expert weights by runtime id
    assert by_src["x"]["indirect"] == "" and by_src["expert_ids"]["indirect"] == ""

    src = """import nki
import nki.language as nl
import nki.isa as nisa


@nki.jit
def k(data, idx, table):
    i = nl.ndarray(shape=(4, 1), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=i, src=idx)
    g = nl.ndarray(shape=(4, 16), dtype=data.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=g, src=data.ap(pattern=[[16, 4], [1, 16]], vector_offset=i, indirect_dim=0))
    nisa.dma_copy(dst=table.ap(pattern=[[16, 4], [1, 16]], vector_offset=i, indirect_dim=0), src=g,
                  dge_mode=nisa.dge_mode.swdge)
    return table
"""
    fn = nkisim.load_kernel_source(src, "/virtual/gather_scatter.py", target="trn2")["k"]
    nkisim.run(fn, Abstract((64, 16), "bfloat16"), Abstract((4, 1), "uint32"), Abstract((64, 16), "bfloat16"),
               shape_only=True)
    dmas = {x.line: x for x in nkisim.last_profile().dmas}
    assert dmas[9].indirect == "" and dmas[11].indirect == "vector" and dmas[11].dge_mode == "unknown"
    assert dmas[12].indirect == "vector" and dmas[12].dge_mode == "swdge" and dmas[12].queue == "gpsimd"


def test_cli_runs_a_kernel_file_with_its_own_harness(tmp_path):
    f = tmp_path / "third_party_kernel.py"
    f.write_text(textwrap.dedent("""
        import sys
        import numpy as np
        import nki
        import nki.language as nl
        import nki.isa as nisa

        @nki.jit
        def add_one(x):
            out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
            t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x)
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
            nisa.dma_copy(dst=out, src=t)
            return out

        if __name__ == "__main__":
            x = np.zeros((128, 64), dtype=np.float32)
            assert (add_one(x) == 1).all()
            assert nl.num_programs is not None
            print("OK", sys.argv[1:], nisa.get_nc_version())
    """))
    prof_path = tmp_path / "p.json"
    cmd = [sys.executable, "-c", "import sys; from fusegraph.nkisim.cli import main; sys.exit(main(sys.argv[1:]))",
           str(f), "--target", "trn3", "--lnc", "2", "--profile", str(prof_path), "--", "a", "b"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "OK ['a', 'b'] nc_version.gen4" in r.stdout
    profiles = json.loads(prof_path.read_text())["profiles"]
    assert len(profiles) == 1 and profiles[0]["lnc"] == 2 and profiles[0]["target"] == "trn3"


def test_cli_reports_kernel_errors(tmp_path):
    from fusegraph.nkisim.cli import main

    f = tmp_path / "bad_kernel.py"
    f.write_text("import nki\nimport nki.isa as nisa\nimport nki.language as nl\n"
                 "@nki.jit\ndef k(x):\n    nl.ndarray((300, 1), dtype=nl.float32)\n    return x\n"
                 "import numpy as np\nk(np.zeros(4, np.float32))\n")
    assert main([str(f)]) == 1
    assert "nki" not in sys.modules


def test_profile_named_executions_and_dmas():
    """``Profile.named`` / ``executions`` / ``named_dmas``: the instructions that ran, by ``name=`` suffix and opcode
    (what tests assert instead of substrings of a kernel's source)."""
    src = """import nki
import nki.language as nl
import nki.isa as nisa


@nki.jit
def k(x):
    t = nl.ndarray(shape=(128, 8), dtype=nl.float32, buffer=nl.sbuf)
    out = nl.ndarray(shape=(128, 8), dtype=nl.float32, buffer=nl.shared_hbm)
    for i in range(3):
        nisa.dma_copy(dst=t, src=x, name="L0.a.load")
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0, name="L0.a.scale")
    # nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0, name="L0.a.never")
    nisa.dma_copy(dst=out, src=t, name="L0.a.store")
    return out
"""
    fn = nkisim.load_kernel_source(src, "/virtual/named_sites.py", target="trn2")["k"]
    nkisim.run(fn, np.ones((128, 8), np.float32))
    p = nkisim.last_profile()
    assert p.executions(".scale") == 3 and p.executions(".scale", "tensor_scalar") == 3
    assert p.executions(".scale", "dma_copy") == 0 and p.executions(".never") == 0  # a comment runs nothing
    assert p.executions(opcode="dma_copy") == 4 and p.executions() == p.instructions
    assert [s.line for s in p.named(".load")] == [11] and p.named(".a.load", "tensor_scalar") == []
    (load,) = p.named_dmas(".load")
    assert load.count == 3 and load.bytes == 3 * 128 * 8 * 4 and load.src_tensor == "x"
    assert p.named_dmas(".scale") == []  # no DMA on that line
