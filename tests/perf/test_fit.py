"""The calibration fit (``fusegraph.perf.fit``) on a recorded trace of a small kernel of our own: the fit re-costs
the trace (never re-runs the interpreter), recovers parameters the figures determine, stays inside its bounds,
changes only low-confidence parameters, and held-out errors come from figures the fit did not use."""
import textwrap

import pytest

from fusegraph import nkisim
from fusegraph.perf import fit as F
from fusegraph.perf.costmodel import Schedule, union_length
from fusegraph.perf.kernelview import view_from_trace
from fusegraph.perf.params import FITTABLE, FITTABLE_JOINT, load_params

HW = load_params("trn3")

KERNEL = """
import nki
import nki.isa as nisa
import nki.language as nl


def layer(x_sb, w_hbm, b_hbm, i):
    w = nl.ndarray((128, 4, 128), dtype=nl.bfloat16, buffer=nl.sbuf, name=f"w{i}")
    nisa.dma_copy(dst=w, src=w_hbm)
    b = nl.ndarray((128, 1), dtype=nl.bfloat16, buffer=nl.sbuf, name=f"b{i}")
    nisa.dma_copy(dst=b, src=b_hbm)
    ps = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.psum)
    for k in range(4):
        nisa.nc_matmul(dst=ps, stationary=w[:, k, :], moving=x_sb)
    h = nl.ndarray((128, 1), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.activation(dst=h, op=nl.relu, data=ps)
    nisa.tensor_tensor(dst=x_sb, data1=h, data2=b, op=nl.add)


def body(x, ws, bs, n):
    out = nl.ndarray((128, 1), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    x_sb = nl.ndarray((128, 1), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb, src=x)
    for li in range(n):
        layer(x_sb, ws[li], bs[li], li)
    nisa.dma_copy(dst=out, src=x_sb)
    return out


@nki.jit
def three_layers(x, w0, w1, w2, b0, b1, b2):
    return body(x, (w0, w1, w2), (b0, b1, b2), 3)
"""


@pytest.fixture(scope="module")
def view(tmp_path_factory):
    """The recorded trace (3 layers: weight + bias DMAs, 4 matmuls, Scalar -> Vector chain) as a kernel view."""
    import sys

    import ml_dtypes

    from fusegraph.nkisim import Abstract

    d = tmp_path_factory.mktemp("fitk")
    (d / "fit_small_kernel.py").write_text(textwrap.dedent(KERNEL))
    sys.path.insert(0, str(d))
    try:
        with nkisim.as_nki():
            import fit_small_kernel as mod
        bf = ml_dtypes.bfloat16
        args = ([Abstract((128, 1), bf)] + [Abstract((128, 4, 128), bf)] * 3 + [Abstract((128, 1), bf)] * 3)
        nkisim.run(mod.three_layers, *args, shape_only=True, target="trn3", trace=True, trace_layer="body:li")
    finally:
        sys.path.remove(str(d))
    return view_from_trace(nkisim.last_profile().trace[(0, 0)])


def test_union_and_dma_active_count_overlaps_once():
    assert union_length([(0, 2), (1, 3), (5, 6)]) == pytest.approx(4.0)
    assert union_length([]) == 0.0
    s = Schedule([], [], [], [], 0.0, {}, dma_windows={0: (0.0, 1.0), 3: (0.5, 2.0), 7: (4.0, 4.5)})
    assert s.dma_active() == pytest.approx(2.5) and s.dma_active([0, 7]) == pytest.approx(1.5)


def test_layer_figures_of_the_recorded_trace(view):
    figs = F.evaluate(view, HW)
    assert set(figs) == set(F.FIGURES)
    # per layer: 2 Sync-issued DMAs, 4 matmuls of N=1 at the 64-cycle floor
    assert figs["sync"] == pytest.approx(2 * HW.dma_issue_hwdge, rel=1e-6)
    assert figs["tensor"] == pytest.approx(4 * HW.pe_min_cycles / HW.pe_clock, rel=1e-6)
    # DMA active counts the fixed latency of a transfer in flight, so it exceeds the bandwidth occupancy
    assert figs["dma_active"] > figs["dma_occupancy"] > 0
    assert figs["wall"] > figs["dma_active"] * 0.5


def test_latency_overlap_parameter_moves_only_dma_starts(view):
    full = F.evaluate(view, HW)
    none = F.evaluate(view, HW, {"dma_latency_overlap": 0.0})
    assert none["sync"] == pytest.approx(full["sync"]) and none["tensor"] == pytest.approx(full["tensor"])
    assert none["wall"] >= full["wall"]


def test_fit_recovers_known_parameters_from_figures_they_produced(view):
    truth = {"pe_min_cycles": 190.0, "dma_issue_hwdge": 0.41e-6, "dma_fixed_latency": 2.0e-6}
    measured = F.evaluate(view, HW, truth)
    targets = {k: measured[k] for k in F.O1_FIGURES}
    calls = []

    def counting(values):
        calls.append(dict(values))
        return F.evaluate(view, HW, values)

    r = F.fit(view, HW, targets, params=tuple(truth), evaluator=counting, prior=0.0, max_evaluations=300)
    for k, v in truth.items():
        assert r.values[k] == pytest.approx(v, rel=0.03), (k, r.values)
    assert r.max_error() < 0.01
    assert r.evaluations == len(calls) <= 300
    # started from the sourced values, which miss the figures
    assert r.start == {k: getattr(HW, k) for k in truth}
    assert max(abs(e) for e in r.errors(r.start_modeled).values()) > 0.2


def test_fit_stays_in_bounds_and_fits_only_low_confidence_parameters(view):
    targets = {"tensor": 50 * F.evaluate(view, HW)["tensor"]}  # unreachable: needs pe_min far above 512
    r = F.fit(view, HW, targets, params=("pe_min_cycles",))
    assert r.values["pe_min_cycles"] == pytest.approx(F.BOUNDS["pe_min_cycles"].hi)
    assert r.at_bound == ["pe_min_cycles"]
    with pytest.raises(ValueError, match="not low-confidence"):
        F.fit(view, HW, targets, params=("dma_bandwidth_core",))
    with pytest.raises(ValueError, match="unknown figures"):
        F.fit(view, HW, {"wal": 1e-6}, params=("pe_min_cycles",))
    assert set(F.BOUNDS) == set(FITTABLE_JOINT) and set(FITTABLE) < set(FITTABLE_JOINT)
    for name, b in F.BOUNDS.items():
        assert b.lo <= getattr(HW, name) <= b.hi, name  # the sourced value is inside its range


def test_held_out_refuses_figures_the_fit_used(view):
    measured = F.evaluate(view, HW, {"pe_min_cycles": 150.0})
    r = F.fit(view, HW, {"tensor": measured["tensor"]}, params=("pe_min_cycles",),
              sources={"tensor": "megakernel_tensor_us_per_layer"})
    assert r.used() == {"tensor", "megakernel_tensor_us_per_layer"}
    with pytest.raises(ValueError, match="megakernel_tensor_us_per_layer"):
        F.held_out(r, [F.HeldOut("megakernel_tensor_us_per_layer", 1.0, 1.0, "us", "O1", "same")])
    rows = F.held_out(r, [F.HeldOut("megakernel_ms_per_token", 7.0, (6.45, 8.15), "ms", "O2", "bounded"),
                          F.HeldOut("hybrid_us_per_layer", 198.3, 165.26, "us", "O1", "another kernel")])
    assert rows[0].error == 0.0  # inside the bound the source gives
    assert F.HeldOut("x", 9.0, (6.45, 8.15), "ms", "s", "c").error == pytest.approx(9.0 / 8.15 - 1)
    assert rows[1].error == pytest.approx(198.3 / 165.26 - 1)


def test_sensitivity_scales_each_parameter(view):
    rows = F.sensitivity(view, HW, params=("pe_min_cycles", "dma_latency_overlap"), factors=(0.5, 1.5))
    assert [(r["parameter"], r["factor"]) for r in rows] == [("pe_min_cycles", 0.5), ("pe_min_cycles", 1.5),
                                                            ("dma_latency_overlap", 0.5),
                                                            ("dma_latency_overlap", 1.5)]
    assert rows[1]["figures_s"]["tensor"] == pytest.approx(3 * rows[0]["figures_s"]["tensor"])
    assert rows[3]["value"] == 1.0  # a fraction is clipped to its range
