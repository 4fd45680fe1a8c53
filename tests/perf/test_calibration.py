"""Calibration rows and the goal verdict, on given strategy summaries."""
import pytest

from fusegraph.perf.calibration import Row, calibrate, goal
from fusegraph.perf.params import load_params

HW = load_params("trn3")


def _summary(label, per_layer_us, per_token_ms, busy):
    return {"label": label, "seconds_per_layer": per_layer_us * 1e-6, "seconds_per_token": per_token_ms * 1e-3,
            "per_layer_busy_s": {k: v * 1e-6 for k, v in busy.items()}}


def test_rows_and_errors():
    s = {"per_op": _summary("per-op", 300, 14.37 * 1.1, {}),
         "xla_nki_moe": _summary("xla+moe", 165.26 * 2, 9.43, {"sync": 53.52, "dma": 91.99 / 2, "tensor": 48.86}),
         "megakernel": _summary("mk", 100.0, 4.0, {"sync": 19.05, "dma": 66.5, "tensor": 48.15})}
    rows = calibrate(s, HW, 48)
    by = {(r.quantity, r.strategy): r for r in rows}
    assert by[("ms/token", "per-op")].error == pytest.approx(0.10)
    assert by[("per-layer wall", "xla+moe")].error == pytest.approx(1.0)
    assert by[("DMA active per layer", "xla+moe")].error == pytest.approx(-0.5)
    assert by[("Sync engine busy per layer", "mk")].error == pytest.approx(0.0)
    cc = by[("per-layer wall + measured AllReduce", "mk")]
    assert cc.modeled == pytest.approx(100.0 + 27.77) and cc.published == 134.47
    assert all(r.source and "perf_anchors.md" in r.source for r in rows)
    assert Row("q", "s", 1.0, None, "us", "src").error is None


@pytest.mark.parametrize("per_layer,met,met_cc", [(100.0, True, True), (120.0, True, False), (140.0, False, False)])
def test_goal(per_layer, met, met_cc):
    s = {"megakernel": _summary("mk", per_layer, 48 * per_layer / 1e3, {})}
    limit = {"seconds_per_token": 1.254e-3, "seconds_per_layer": 23.5e-6}
    g = goal(s, HW, limit)
    assert g["met"] is met and g["met_with_cc"] is met_cc
    assert g["distance_to_limit_ms_per_token"] == pytest.approx(48 * per_layer / 1e3 - 1.254)
    assert g["fraction_of_limit"] == pytest.approx(1.254 / (48 * per_layer / 1e3))
