"""Hardware loops (``nl.dynamic_range``) as the NKI docs describe them (fusegraph.perf.hwloops): the body's tiles
are allocated once and reused (SDK 2.29 ``nki/deep-dives/nki-dynamic-loops.rst``, "Register Allocation
Implications") and every iteration ends with a drain and a barrier across the engines (the NKI control-flow page,
``nki/deep-dives/nki-control-flow.rst``: 7.5 us unrolled vs 17.9 us as a dynamic loop); docs/performance.md,
"Hardware loops: sourced entry". So iterations never overlap, each pays its DMAs' fixed latency and a barrier,
and register instructions (``register_move`` too) cost an instruction's fixed overhead."""
import pytest

from fusegraph.perf.costmodel import REGISTER_OPS, Work, estimate, instruction_time, line_work, schedule
from fusegraph.perf.hwloops import BARRIER_KIND, MAX_COPIES, trip_count, unroll_hardware_loops
from fusegraph.perf.kernelview import KernelLine, hardware_loops
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


def _drained(trips: int, barrier: float):
    hw = load_params("trn2")
    unrolled, buffers, allocs = unroll_hardware_loops(_body(trips), BUFFERS, ALLOCS, {LOOP}, barrier=barrier)
    return hw, unrolled, schedule(unrolled, hw, buffers=buffers, allocs=allocs)


def test_trip_count_from_the_body_counts():
    assert trip_count(_body(24), LOOP) == 24
    odd = _body(24)
    odd[1].count = 25  # no common trip count: not unrolled
    assert trip_count(odd, LOOP) <= 1


@pytest.mark.parametrize("trips", [24, 128])
def test_iterations_are_drained_and_conserve_cost(trips):
    """Every copy's work starts after the previous copy's barrier ended (no overlap across iterations), and the
    copies carry the lines' busy time and bytes."""
    works = _body(trips)
    hw, unrolled, s = _drained(trips, 0.31e-6)
    copies = min(trips, MAX_COPIES)
    assert len(unrolled) == 6 * copies  # five body lines and a barrier per copy
    for k in range(5):
        assert sum(w.busy for w in unrolled if w.index == k) == pytest.approx(works[k].busy)
        assert sum(w.nbytes for w in unrolled if w.index == k) == pytest.approx(works[k].nbytes, rel=1e-3)
    barriers = [i for i, w in enumerate(unrolled) if w.kind == BARRIER_KIND]
    assert len(barriers) == copies
    for prev, nxt in zip(barriers, barriers[1:]):
        starts = [s.start[i] for i in range(prev + 1, nxt)]
        assert min(starts) >= s.ready[prev]  # the next iteration waits for the drain and the barrier
        assert s.start[prev] >= max(s.ready[i] for i in range(prev))  # the drain waits for everything issued


@pytest.mark.parametrize("trips", [24, 128])
def test_loop_time_is_trips_times_one_drained_iteration(trips):
    """A drained loop takes T x (one iteration's critical path + the barrier): the chain load -> a -> b -> c -> acc
    with the DMA's fixed latency and the semaphores paid every iteration -- far above the old pipelined model's
    bound (the busiest resource, 2 us per iteration). Copies standing for several iterations (T > MAX_COPIES)
    scale the latencies with them."""
    barrier = 0.31e-6
    one = _drained(1, barrier)[2].makespan
    _, _, s = _drained(trips, barrier)
    assert s.makespan == pytest.approx(trips * one, rel=0.05)
    assert s.makespan > 2.5 * trips * 2e-6


def test_a_dynamic_loop_is_slower_than_the_unrolled_body():
    """The docs' comparison (7.5 us unrolled vs 17.9 us as a dynamic loop): the same iterations with their own
    buffers and no barrier (what an unrolled loop gives the scheduler) overlap their engines; the hardware loop
    does not."""
    trips = 16
    hw = load_params("trn2")
    unrolled = []
    allocs = {}
    for c in range(trips):  # fully unrolled: per-iteration tiles, no hardware loop
        for w in _body(1):
            ren = {v: f"{v}{c}" for v in ("kt", "s", "s2", "p")}
            if w.index in ALLOCS:
                allocs[len(unrolled)] = [ren[v] for v in ALLOCS[w.index]]
            unrolled.append(Work(**{**w.__dict__, "loops": (), "reads": tuple(ren.get(v, v) for v in w.reads),
                                    "writes": tuple(ren.get(v, v) for v in w.writes)}))
    flat = schedule(unrolled, hw, buffers=BUFFERS, allocs=allocs).makespan
    looped = _drained(trips, hw.loop_iteration_barrier)[2].makespan
    assert looped > 1.5 * flat


def test_body_tiles_allocated_once_and_barriers_counted():
    unrolled, buffers, allocs = unroll_hardware_loops(_body(8), BUFFERS, ALLOCS, {LOOP}, barrier=0.5e-6)
    loads = [w for w in unrolled if w.name == "load"]
    assert [w.writes[0] for w in loads] == ["kt"] * 8  # one buffer, reused by every iteration
    assert sorted(v for vs in allocs.values() for v in vs) == ["kt", "p", "s", "s2"]  # allocated once
    assert max(allocs) < 5  # before the first copy's lines
    est = estimate(unrolled, load_params("trn2"), buffers=buffers, allocs=allocs)
    assert est.total.loop_barriers == 8
    assert est.total.busy["loop"] == pytest.approx(8 * 0.5e-6)
    assert est.total.to_dict()["loop_barriers"]["count"] == 8


def test_one_trip_loop_pays_a_drain_other_loops_stay_lines():
    once = _body(1)
    out = unroll_hardware_loops(once, BUFFERS, ALLOCS, {LOOP}, barrier=0.31e-6)[0]
    assert [w.name for w in out] == ["load", "a", "b", "c", "acc", "L0.attn.loop_barrier"]  # a dynamic_range guard
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


def _register_line(opcode: str, count: int = 4) -> KernelLine:
    """A profile line as the interpreter records register instructions: GpSimd, one partition, one element
    (synthetic: does not depend on the interpreter recording ``register_move``)."""
    site = {"file": "k.py", "line": 3, "opcode": opcode, "engine": "gpsimd", "count": count, "elements": count,
            "max_partitions": 1, "max_free": 1, "dtypes": ["int32"], "names": [], "input_dtypes": {}}
    return KernelLine(0, 3, opcode, "", "L0.attn.x", 0, (), (), False, (), [site])


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_register_instructions_cost_the_fixed_overhead(target):
    """register_move, register_load and register_store: ``engine_fixed_cycles`` each on their engine (an assumed
    cost, labelled in costmodel.REGISTER_OPS: no register-instruction cost is documented), nothing per element."""
    hw = load_params(target)
    assert "register_move" in REGISTER_OPS
    moves = line_work(hw, _register_line("register_move"), 0)
    loads = line_work(hw, _register_line("register_load"), 0)
    assert moves.busy == pytest.approx(4 * hw.engine_fixed_cycles / hw.pool_clock)
    assert moves.busy == pytest.approx(loads.busy) and moves.busy > 0
    per, _ = instruction_time(hw, "gpsimd", "tensor_copy", 1, 1)
    assert per > moves.busy / 4  # a data instruction of one element still pays its element


TRACE_SRC = '''
import nki
import nki.language as nl
import nki.isa as nisa

@nki.jit
def k(a, out):
    t = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
    for i in nl.dynamic_range(0, 4):
        nisa.dma_copy(dst=t, src=a)
        for h in range(2):
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
        nisa.dma_copy(dst=out, src=t)
    nisa.dma_copy(dst=out, src=t)
'''


def test_trace_view_drains_each_iteration():
    """A per-instruction trace view (the TP rows' ``perf.analysis.profile_program0``, ``bench --against``) has no
    loop lines: with the kernel source, the end of every hardware-loop iteration is found (the trace leaves the body
    or returns to an earlier direct statement; a Python loop inside the body is not an iteration) and drained."""
    import numpy as np

    from fusegraph import nkisim
    from fusegraph.perf.costmodel import estimate_kernel
    from fusegraph.perf.kernelview import view_from_trace

    ns = nkisim.load_kernel_source(TRACE_SRC, "<fusegraph:k>", target="trn2")
    a = np.zeros((128, 512), np.float32)
    nkisim.run(ns["k"], a, np.zeros_like(a), target="trn2", trace=True)
    prof = nkisim.last_profile()
    events = prof.trace[min(prof.trace)]
    view = view_from_trace(events, source=TRACE_SRC, source_file="<fusegraph:k>")
    body = [i for i, ln in enumerate(view.lines) if 10 <= ln.line <= 13]
    assert len(body) == 16 and sorted(view.iteration_ends) == body[3::4]  # 4 iterations of 4 instructions
    assert set(view.iteration_ends.values()) == {9}
    hw = load_params("trn2")
    est = estimate_kernel(view, hw)
    assert est.total.loop_barriers == 4
    plain = estimate_kernel(view_from_trace(events), hw)  # without the source: no loop known, no drain
    assert plain.total.loop_barriers == 0 and est.seconds > plain.seconds
