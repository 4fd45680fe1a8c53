"""The per-op / hybrid baselines' kernel boundaries, costed as O1 measured them: a boundary is boundary_sync of
Sync time and boundary_wall of wall time (O1: 34.47 us of Sync and 30.80 us of wall per layer over ~98
boundaries), and that already includes storing and reloading the activations across it -- so those activation
DMAs pay no Sync trigger and no 1.3 us fixed latency of their own (they used to pay both: Sync counted twice per
boundary, 2 x 1.3 us of latency serial on every op). Weights and program inputs/outputs are real DMAs."""
import pytest
import torch

from fusegraph.matching.trace import trace_program
from fusegraph.perf.baselines import op_costs, op_works
from fusegraph.perf.costmodel import RegionIO, Work, dma_transfer, estimate, schedule
from fusegraph.perf.params import load_params

HW = load_params("trn3")


def _three_ops():
    def f(x, w):
        return torch.relu(x @ w) * 2.0

    prog, _ = trace_program(f, [torch.randn(1, 256), torch.randn(256, 256)], ["x", "w"])
    return op_costs(prog)


def test_activations_between_ops_are_boundary_traffic():
    costs = _three_ops()
    assert [(c.op, c.in_boundary, c.out_boundary) for c in costs] == [
        ("mm", (False, False), True), ("relu", (True,), True), ("mul", (True,), False)]
    works = op_works(costs, HW)
    dmas = [w for w in works if w.kind == "dma"]
    real = [w for w in dmas if w.name in ("mm load g0.arg0_1", "mm load g0.arg1_1", "mul store")]
    assert len(real) == 3 and all(w.busy == HW.dma_issue_hwdge and w.latency == HW.dma_fixed_latency for w in real)
    crossing = [w for w in dmas if w not in real]
    assert len(crossing) == 4 and all(w.busy == 0 and w.latency == 0 and w.nbytes == 1024 for w in crossing)


def test_sync_is_charged_once_per_boundary_and_the_wall_pays_boundary_wall():
    costs = _three_ops()
    est = estimate(op_works(costs, HW), HW, barriers=True)
    assert est.schedule.barriers == 2
    # 3 real DMAs (x, w, the result) + 2 boundaries; not 7 DMAs + 2 boundaries
    assert est.total.busy["sync"] == pytest.approx(3 * HW.dma_issue_hwdge + 2 * HW.boundary_sync)
    more_wall = HW.what_if("test", boundary_wall=HW.boundary_wall + 1e-6)
    more_sync = HW.what_if("test", boundary_sync=HW.boundary_sync + 1e-6)
    assert estimate(op_works(costs, more_wall), more_wall, barriers=True).seconds == pytest.approx(est.seconds + 2e-6)
    s = estimate(op_works(costs, more_sync), more_sync, barriers=True)
    assert s.seconds == pytest.approx(est.seconds)
    assert s.total.busy["sync"] == pytest.approx(est.total.busy["sync"] + 2e-6)


def test_hybrid_region_io_moves_bytes_without_a_second_trigger():
    tr = dma_transfer(HW, 128 * 4096, 1, 128, 128)

    def dma(i, region, writes):
        return Work(i, "dma", "sync", "dma_copy", 1, HW.dma_issue_hwdge, region, 0, f"{region}.d", writes=writes,
                    nbytes=128 * 4096, occupancy=tr["occupancy"], own=tr["own"], latency=HW.dma_fixed_latency,
                    ideal=tr["ideal"])

    w = [dma(0, "k1", ("a",)), Work(1, "compute", "tensor", "op", 1, 1e-6, "k1", 0, "c1", reads=("a",)),
         dma(2, "k2", ("b",)), Work(3, "compute", "tensor", "op", 1, 1e-6, "k2", 0, "c2", reads=("b",))]
    io = {"k1": RegionIO(stores=[(128 * 256, 128)]), "k2": RegionIO(loads=[(128 * 256, 128)])}
    s = schedule(w, HW, barriers=True, region_io=io)
    assert s.busy["sync"] == pytest.approx(2 * HW.dma_issue_hwdge + HW.boundary_sync)
    plain = schedule(w, HW, barriers=True)
    act = dma_transfer(HW, 128 * 256, 1, 128, 128)
    assert s.busy["dma"] == pytest.approx(plain.busy["dma"] + 2 * act["occupancy"])  # the bytes still move
