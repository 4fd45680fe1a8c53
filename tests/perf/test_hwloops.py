"""Hardware loops are scheduled iteration by iteration (fusegraph.perf.hwloops): why -- a line-by-line schedule of
a long loop body holds an engine for a line's whole loop while it waits for its producer's last iteration, which
serializes the body's engines; in-order engines working on consecutive iterations overlap instead."""
import pytest

from fusegraph.perf.costmodel import Work, schedule
from fusegraph.perf.hwloops import MAX_COPIES, trip_count, unroll_hardware_loops
from fusegraph.perf.kernelview import hardware_loops
from fusegraph.perf.params import load_params

LOOP = 7  # the loop header's line number


def _body(trips: int) -> list[Work]:
    """load (DMA) -> a (Vector) -> b (Vector) -> c (Scalar) -> acc (GpSimd, loop-carried), ``trips`` iterations."""
    kw = dict(region="L0.attn", layer=0, loops=(LOOP,))
    return [
        Work(0, "dma", "sync", "dma_copy", trips, trips * 0.1e-6, name="load", reads=("k_hbm",), writes=("kt",),
             nbytes=trips * 1 << 20, occupancy=trips * 2e-6, own=trips * 2e-6, latency=1e-6, **kw),
        Work(1, "compute", "vector", "tensor_copy", trips, trips * 0.8e-6, name="a", reads=("kt",), writes=("s",), **kw),
        Work(2, "compute", "vector", "tensor_tensor", trips, trips * 0.8e-6, name="b", reads=("s",), writes=("s2",),
             **kw),
        Work(3, "compute", "scalar", "activation", trips, trips * 0.8e-6, name="c", reads=("s2",), writes=("p",), **kw),
        Work(4, "compute", "gpsimd", "tensor_tensor", trips, trips * 0.2e-6, name="acc", reads=("p", "acc"),
             writes=("acc",), **kw),
    ]


ALLOCS = {0: ["kt"], 1: ["s"], 2: ["s2"], 3: ["p"]}  # allocated in the body; acc before the loop
BUFFERS = {"k_hbm": "hbm", "kt": "sbuf", "s": "sbuf", "s2": "sbuf", "p": "sbuf", "acc": "sbuf"}


def test_trip_count_from_the_body_counts():
    assert trip_count(_body(24), LOOP) == 24
    odd = _body(24)
    odd[1].count = 25  # no common trip count: not unrolled
    assert trip_count(odd, LOOP) <= 1


@pytest.mark.parametrize("trips", [24, 128])
def test_unrolled_loop_overlaps_its_engines(trips):
    hw = load_params("trn2")
    works = _body(trips)
    lines = schedule(works, hw, buffers=BUFFERS, allocs=ALLOCS).makespan
    unrolled, buffers, allocs = unroll_hardware_loops(works, BUFFERS, ALLOCS, {LOOP})
    assert len(unrolled) == 5 * min(trips, MAX_COPIES)
    # cost is conserved: the copies carry the lines' busy time and bytes
    for k in range(5):
        assert sum(w.busy for w in unrolled if w.index == k) == pytest.approx(works[k].busy)
        assert sum(w.nbytes for w in unrolled if w.index == k) == pytest.approx(works[k].nbytes, rel=1e-3)
    pipelined = schedule(unrolled, hw, buffers=buffers, allocs=allocs).makespan
    bound = trips * 2e-6  # the busiest resource: the loads (Vector a + b 1.6 us, Scalar 0.8 us per iteration)
    assert pipelined < lines
    assert pipelined < 1.25 * bound + 10e-6  # close to the busiest resource plus one iteration's fill
    assert lines > 1.3 * bound  # the line-by-line schedule chains the Vector lines after the loads' last iteration


def test_body_tiles_double_buffered_last_copy_keeps_the_names():
    unrolled, buffers, allocs = unroll_hardware_loops(_body(8), BUFFERS, ALLOCS, {LOOP})
    loads = [w for w in unrolled if w.name == "load"]
    assert [w.writes[0] for w in loads] == ["kt#1", "kt"] * 4  # copy k and k + 2 share a buffer
    accs = [w for w in unrolled if w.name == "acc"]
    assert all(w.writes == ("acc",) for w in accs)  # allocated before the loop: carried from copy to copy
    assert buffers["kt#1"] == "sbuf"
    assert {v for vs in allocs.values() for v in vs} == {"kt", "s", "s2", "p", "kt#1", "s#1", "s2#1", "p#1"}


def test_one_trip_loop_and_other_loops_stay_lines():
    once = _body(1)
    assert unroll_hardware_loops(once, BUFFERS, ALLOCS, {LOOP})[0] == once  # a dynamic_range guard
    many = _body(16)
    assert unroll_hardware_loops(many, BUFFERS, ALLOCS, set())[0] == many  # not a hardware loop


def test_hardware_loops_are_the_dynamic_range_headers():
    src = (
        "def k(a, b):\n"
        "    for j in range(3):\n"
        "        nisa.memset(dst=b, value=0.0)\n"
        "    for i in nl.dynamic_range(start=0, stop=8, step=2):\n"
        "        for u in nl.affine_range(2):\n"
        "            nisa.memset(dst=b, value=0.0)\n"
    )
    assert hardware_loops(src) == frozenset({4})
