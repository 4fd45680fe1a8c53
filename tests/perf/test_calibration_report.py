"""``fusegraph.modelperf.calibrate.run`` end to end on a small recorded trace of our own standing in for both
kernels (the real ones need the anchor checkouts and minutes: benchmarks/bench_calibration.py, slow tests): the
fit, both parameter sets, the ratio, the held-out rows and the sensitivity table."""
import types

import pytest

from fusegraph.modelperf import calibrate
from fusegraph.perf.fit import HeldOut
from fusegraph.perf.params import FITTABLE

from .test_fit import view  # noqa: F401 - the recorded-trace fixture


def test_run_and_report_on_a_recorded_trace(view, monkeypatch):  # noqa: F811
    monkeypatch.setattr(calibrate, "hand_kernel_view", lambda layers, spec_ref=calibrate.HAND_SPEC: (view, None, 0.0))
    monkeypatch.setattr(calibrate, "generated_shard", lambda layers=None, cache_len=640: types.SimpleNamespace(view=view))
    seen = {}

    def fake_held_out(result, hw, est, build, layers, hand_profile=None):
        seen.setdefault("sets", []).append(hw.parameter_set)
        return [HeldOut("hybrid_us_per_layer", 100.0, 165.26, "us", "O1", "another kernel")]

    monkeypatch.setattr(calibrate, "held_out_rows", fake_held_out)
    monkeypatch.setattr(calibrate, "tp_rank_view", lambda layers=None, cache_len=640: (view, "a TP rank"))
    r = calibrate.run(layers=3, fit_layers=3, factors=(0.5, 2.0))
    assert r["fusegraph_tp_side"] == "a TP rank"
    assert r["parameter_set"] == calibrate.CALIBRATION and seen["sets"] == [calibrate.CALIBRATION, "sourced"]
    for name in ("sourced", "calibrated"):
        assert r["sides"][name]["ratio"] == pytest.approx(1.0)  # the same trace on both sides
        assert r["sides"][name]["ratio_tp"] == pytest.approx(1.0)
    assert {s["parameter"] for s in r["sensitivity"]} == set(FITTABLE) and len(r["sensitivity"]) == 2 * len(FITTABLE)
    assert all(s["ratio"] == pytest.approx(1.0) and s["ratio_tp"] == pytest.approx(1.0) for s in r["sensitivity"])
    assert set(r["fit"]["targets_s"]) == {"wall", "sync", "dma_active", "tensor"}
    assert r["held_out"][0]["sourced_error"] == pytest.approx(100 / 165.26 - 1)
    text = calibrate.format_report(r)
    for needle in ("Calibration on the hand-written megakernel", "Held out", "hybrid_us_per_layer",
                   "calibrated model", "shard 1.00x", "TP rank (collectives in its kernel) 1.00x", "Sensitivity",
                   "ratio (TP)", "x2"):
        assert needle in text, needle
