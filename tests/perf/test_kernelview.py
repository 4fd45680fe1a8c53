"""Kernel source + profile -> ordered lines with counters, dependencies and regions."""
from fusegraph.perf.kernelview import parse_source, region_of

SRC = '''
import nki
import nki.language as nl
import nki.isa as nisa


@nki.jit
def k(w, x_hbm):
    x = nl.ndarray(shape=(128, 4), dtype=nl.bfloat16, buffer=nl.sbuf, name="x")
    nisa.dma_copy(dst=x, src=x_hbm, name="L0.q_proj.linear.x")
    wbuf0 = nl.ndarray(shape=(128, 2, 128), dtype=nl.bfloat16, buffer=nl.sbuf, name="L0.q_proj.linear.w0")
    nisa.dma_copy(dst=wbuf0, src=w[:, 0:2, :], name="L0.q_proj.linear.w0")
    out = nl.ndarray(shape=(128, 2, 1), dtype=nl.bfloat16, buffer=nl.sbuf, name="L0.q_proj.linear.out")
    for j in range(2):
        ps = nl.ndarray(shape=(128, 1), dtype=nl.float32, buffer=nl.psum, name="L0.q_proj.linear.ps")
        nisa.nc_matmul(dst=ps, stationary=wbuf0[:, j, :], moving=x[:, 0:1], name="L0.q_proj.linear.mm")
        nisa.tensor_copy(dst=out[:, j, :], src=ps, name="L0.q_proj.linear.evict")
    return out
'''


def test_region_of_names():
    assert region_of("L3.q_proj.linear.mm") == ("L3.q_proj.linear", 3)
    assert region_of("L12.experts.experts.t0k3.gu.w0") == ("L12.experts.experts", 12)
    assert region_of("top.lm_head.linear.w4") == ("top.lm_head.linear", None)
    assert region_of("const.s_ones") == ("prologue", None)
    assert region_of("") == ("prologue", None)


def test_parse_source_reads_writes_loops():
    lines, buffers, allocs = parse_source(SRC)
    assert [ln.opcode for ln in lines] == ["dma_copy", "dma_copy", "nc_matmul", "tensor_copy"]
    mm, ev = lines[2], lines[3]
    assert set(mm.reads) == {"wbuf0", "x"} and mm.writes == ("ps",)
    assert ev.reads == ("ps",) and ev.writes == ("out",) and ev.partial_write
    assert mm.loops == ev.loops and len(mm.loops) == 1
    assert buffers["ps"] == "psum" and buffers["wbuf0"] == "sbuf" and buffers["w"] == "hbm"
    assert lines[1].reads == ("w",) and mm.region == "L0.q_proj.linear" and mm.layer == 0
    assert "ps" in allocs[2]  # the PSUM tile is (re)allocated just before the matmul


def test_view_matches_the_profile(tiny_builds):
    b = tiny_builds["trn2"]
    p = b.profile
    view = b.view
    assert view.unmatched_sites == 0
    assert sum(d["bytes"] for ln in view.lines for d in ln.dmas) == p["dma_bytes"]
    assert sum(d["count"] for ln in view.lines for d in ln.dmas) == p["dma_count"]
    assert sum(s["count"] for ln in view.lines for s in ln.sites) == p["instructions"]
    regions = view.regions()
    assert "L0.experts.experts" in regions and "L1.gate.router" in regions and "top.lm_head.linear" in regions
    # every weight chunk DMA is attributed to the instruction that uses it
    chunk = next(ln for ln in view.lines if ln.name.startswith("L1.q_proj.linear.w"))
    src = chunk.dmas[0]["src_tensor"]
    assert chunk.region == "L1.q_proj.linear" and src.startswith("l1_") and src.endswith("q_proj_weight"), src
    expert = next(ln for ln in view.lines if ln.region == "L0.experts.experts" and ln.dmas)
    assert expert.indirect == "scalar"  # the expert id is a runtime offset (the profile's dmas[].indirect)
    assert all(d["indirect"] == "scalar" for d in expert.dmas)
    assert chunk.indirect is None
    # operand dtypes come from the profile: a matmul's stationary/moving inputs, not only its fp32 PSUM output
    mm = next(ln for ln in view.lines if ln.opcode == "nc_matmul")
    assert set(mm.input_dtypes) == {"stationary", "moving"} and mm.sites[0]["dtypes"] == ["float32"]
