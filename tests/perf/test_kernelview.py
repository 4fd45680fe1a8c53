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


LOOPS = '''
import nki
import nki.language as nl
import nki.isa as nisa


@nki.jit
def k(x, idx):
    for t in range(3):
        r = nisa.register_alloc()
        nisa.register_load(dst=r, src=idx[0:1, t:t + 1])
        for g in range(1, 5, 2):
            if t == 0:
                for _ in nl.dynamic_range(start=r, stop=256, step=256):
                    nisa.memset(dst=x, value=0.0, name="L0.a.guarded")
        for pos in nl.dynamic_range(256, r, 128):
            nisa.memset(dst=x, value=1.0, name="L0.a.block")
    # for u in nl.dynamic_range(0, 8): (a comment is not a loop)
    return x
'''


def test_loops_kinds_bounds_and_nesting():
    from fusegraph.perf.kernelview import loops

    got = loops(LOOPS)
    assert [(lp.var, lp.kind, lp.start, lp.stop, lp.step) for lp in got] == [
        ("t", "range", 0, 3, 1), ("g", "range", 1, 5, 2), ("_", "dynamic_range", "r", 256, 256),
        ("pos", "dynamic_range", 256, "r", 128)]
    t, g, guard, blocks = got
    assert [lp.hardware for lp in got] == [False, False, True, True]
    assert (t.trips, g.trips, guard.trips) == (3, 2, None)
    assert guard.outer == (t.line, g.line) and blocks.outer == (t.line,) and t.outer == ()
    lines = {ln.name: ln for ln in parse_source(LOOPS)[0]}
    assert lines["L0.a.guarded"].loops == (t.line, g.line, guard.line)  # KernelLine.loops are Loop.line
    assert t.line < blocks.line <= blocks.end_line <= t.end_line
