"""Per-instruction costs and the list schedule, on hand-built work items (numbers follow from the data file)."""
import pytest

from fusegraph.perf.costmodel import (Breakdown, Work, classify, dma_efficiency, dma_issue, dma_transfer, estimate,
                                      instruction_time, schedule)
from fusegraph.perf.params import load_params

HW = load_params("trn3")


def test_matmul_initiation_interval():
    t, _ = instruction_time(HW, "tensor", "nc_matmul", 128, 1)
    assert t == pytest.approx(64 / 2.4e9)  # decode: one token moving -> the 64-cycle floor
    t, _ = instruction_time(HW, "tensor", "nc_matmul", 128, 512)
    assert t == pytest.approx(512 / 2.4e9)
    t32, _ = instruction_time(HW, "tensor", "nc_matmul", 128, 512, fp32_inputs=True)
    assert t32 == pytest.approx(4 * 512 / 2.4e9)


def test_vector_scalar_costs():
    t, ii = instruction_time(HW, "vector", "tensor_tensor", 128, 0)
    assert t == pytest.approx(100 / 1.2e9) and ii == pytest.approx(264 / 1.2e9)
    # two inputs, 256 elements/cycle over 128 lanes: 2 * 512 / 2 cycles
    t, _ = instruction_time(HW, "vector", "tensor_tensor", 128, 512, ["float32"])
    assert t == pytest.approx((100 + 512) / 1.2e9)
    # perf mode for 16-bit tensor_copy: 512 elements/cycle
    t, _ = instruction_time(HW, "vector", "tensor_copy", 128, 512, ["bfloat16"])
    assert t == pytest.approx((100 + 128) / 1.2e9)
    # trn3 ScalarE is 256 wide for bf16, 128 for fp32
    t16, _ = instruction_time(HW, "scalar", "activation", 128, 256, ["bfloat16"])
    t32, _ = instruction_time(HW, "scalar", "activation", 128, 256, ["float32"])
    assert t16 < t32


def test_dma_efficiency_and_transfer():
    assert dma_efficiency(HW, 512) == pytest.approx(0.5)
    assert dma_efficiency(HW, 2048) == pytest.approx(0.8)
    big = dma_transfer(HW, 128 * 16384, 1, 128, 128)  # 16 KiB contiguous per partition
    assert big["efficiency"] > 0.96
    assert big["occupancy"] == pytest.approx(128 * 16384 / (528e9 * big["efficiency"]))
    # one partition can use only one DMA engine (8 partitions each): own time >> bandwidth share
    small = dma_transfer(HW, 4096, 1, 1, 1)
    assert small["own"] > small["occupancy"] * 10


def test_dma_issue_engines():
    assert dma_issue(HW, "swdge", "gpsimd", None) == ("gpsimd", 31e-9)
    assert dma_issue(HW, "unknown", "auto", "vector") == ("gpsimd", 31e-9)
    assert dma_issue(HW, "hwdge", "scalar", None) == ("scalar", 0.538e-6)
    assert dma_issue(HW, "unknown", "auto", None) == ("sync", 0.538e-6)  # dma_default_trigger = hwdge_sync


def _dma(i, nbytes, writes, region="r", reads=(), parts=128):
    tr = dma_transfer(HW, nbytes, 1, parts, parts)
    return Work(i, "dma", "sync", "dma_copy", 1, HW.dma_issue_hwdge, region, 0, f"{region}.w{i}", reads=reads,
                writes=writes, nbytes=nbytes, occupancy=tr["occupancy"], own=tr["own"], latency=HW.dma_fixed_latency,
                ideal=tr["ideal"], hbm_read=nbytes)


def _comp(i, engine, busy, reads=(), writes=(), region="r"):
    return Work(i, "compute", engine, "op", 1, busy, region, 0, f"{region}.c{i}", reads=reads, writes=writes)


def test_independent_dma_and_compute_overlap():
    w = [_dma(0, 128 * 16384, ("a",)), _comp(1, "tensor", 5e-6, writes=("b",))]
    s = schedule(w, HW)
    dma_end = HW.dma_issue_hwdge + HW.dma_fixed_latency + w[0].own
    assert s.makespan == pytest.approx(max(dma_end, 5e-6))


def test_dependent_compute_waits_for_the_transfer():
    w = [_dma(0, 128 * 16384, ("a",)), _comp(1, "tensor", 5e-6, reads=("a",), writes=("b",))]
    s = schedule(w, HW)
    assert s.makespan == pytest.approx(HW.dma_issue_hwdge + HW.dma_fixed_latency + w[0].own + 5e-6)
    assert sum(s.exposure) == pytest.approx(s.makespan)


def test_cross_engine_dependency_pays_a_semaphore():
    w = [_comp(0, "tensor", 1e-6, writes=("a",)), _comp(1, "vector", 1e-6, reads=("a",))]
    s = schedule(w, HW)
    assert s.makespan == pytest.approx(2e-6 + HW.semaphore_cross_engine)
    same = [_comp(0, "vector", 1e-6, writes=("a",)), _comp(1, "vector", 1e-6, reads=("a",))]
    assert schedule(same, HW).makespan == pytest.approx(2e-6)


def test_ring_buffer_write_after_read():
    # the second load into buffer "w" must wait until the compute that reads the first load is done
    w = [_dma(0, 128 * 1024, ("w",)), _comp(1, "tensor", 20e-6, reads=("w",), writes=("o",)),
         _dma(2, 128 * 1024, ("w",)), _comp(3, "tensor", 1e-6, reads=("w",), writes=("o2",))]
    s = schedule(w, HW, buffers={"w": "sbuf"})
    assert s.start[2] >= s.ready[1]
    free = schedule(w, HW, buffers={"w": "psum"})  # no WAR hazard modeled for PSUM tiles
    assert free.start[2] < s.start[2]


def test_barriers_serialize_regions_and_pay_the_boundary():
    w = [_dma(0, 128 * 16384, ("a",), region="k1"), _comp(1, "tensor", 5e-6, reads=("a",), region="k1"),
         _dma(2, 128 * 16384, ("b",), region="k2"), _comp(3, "tensor", 5e-6, reads=("b",), region="k2")]
    one = schedule(w, HW)
    two = schedule(w, HW, barriers=True)
    assert two.barriers == 1 and two.barrier_time == pytest.approx(HW.boundary_sync)
    assert two.makespan > one.makespan + HW.boundary_sync  # the second kernel's load cannot be prefetched


def test_classify_and_breakdown():
    assert classify({"compute": 1, "memory": 3, "dma-overhead": 2, "sync": 0}) == "memory"
    assert classify({"compute": 0, "memory": 0, "dma-overhead": 0, "sync": 0}) == "none"
    w = [_dma(i, 128 * 64, (f"a{i}",)) for i in range(50)]  # tiny DMAs: issue-bound
    est = estimate(w, HW)
    assert est.total.bound() == "dma-overhead"
    big = estimate([_dma(0, 128 * 65536, ("a",))], HW)
    assert big.total.bound() == "memory"
    b = Breakdown()
    b.add(w[0], 1e-6)
    assert b.dma_count == 1 and b.wall == 1e-6


def _line(opcode, sites=(), dmas=()):
    from fusegraph.perf.kernelview import KernelLine

    return KernelLine(0, 10, opcode, "L0.q_proj.linear.mm", "L0.q_proj.linear", 0, ("a",), ("b",), False, (),
                      list(sites), list(dmas))


def test_line_costs_use_the_profiled_operand_dtypes_and_indirection():
    from fusegraph.perf.costmodel import line_work

    def mm(inputs):
        site = {"engine": "tensor", "opcode": "nc_matmul", "count": 2, "elements": 2 * 128 * 512,
                "max_partitions": 128, "dtypes": ["float32"]}  # the PSUM output is fp32 either way
        if inputs is not None:
            site["input_dtypes"] = {"moving": [inputs], "stationary": [inputs]}
        return line_work(HW, _line("nc_matmul", [site]), 0)

    assert mm("float32").busy == pytest.approx(4 * mm("bfloat16").busy)
    assert mm(None).busy == pytest.approx(mm("bfloat16").busy)  # profiles without input dtypes: not fp32

    def dma(indirect):
        d = {"file": "k.py", "line": 10, "opcode": "dma_copy", "src_buffer": "private_hbm", "dst_buffer": "sbuf",
             "src_tensor": "w", "dst_tensor": "wbuf", "queue": "auto", "dge_mode": "unknown", "count": 1,
             "bytes": 65536, "descriptors": 128, "partitions": 128, "bytes_per_partition": 512, "max_bytes": 65536}
        if indirect is not None:
            d["indirect"] = indirect
        ln = _line("dma_copy", dmas=[d])
        return ln.indirect, line_work(HW, ln, 0).engine

    assert dma("vector") == ("vector", "gpsimd")  # vector-offset gathers are software DGE
    assert dma("scalar") == ("scalar", "sync")
    assert dma("") == (None, "sync") and dma(None) == (None, "sync")
