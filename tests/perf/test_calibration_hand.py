"""The calibration on the real hand-written Qwen3-30B-A3B megakernel (slow; skipped without the MK / NKILIB
checkouts, see shared/tools/prepare_anchors.sh): the fit reproduces O1 within 15%, the recorded calibrated set is
what the fit finds, and the held-out rows are figures the fit did not use."""
import os

import pytest

pytestmark = pytest.mark.slow


def _available() -> bool:
    mk, lib = os.environ.get("MK"), os.environ.get("NKILIB")
    return bool(mk and lib and os.path.exists(os.path.join(mk, "megakernels/qwen3_moe/transformer_qwen.py"))
                and os.path.isdir(os.path.join(lib, "nkilib")))


@pytest.fixture(scope="module")
def hand_run():
    if not _available():
        pytest.skip("set MK and NKILIB to the anchor checkouts (shared/tools/prepare_anchors.sh)")
    from fusegraph.modelperf.calibrate import hand_kernel_view

    view, prof, _ = hand_kernel_view(4)
    return view, prof


@pytest.fixture(scope="module")
def hand_view(hand_run):
    return hand_run[0]


def test_fit_reproduces_o1_and_the_recorded_set(hand_view):
    from fusegraph.modelperf.calibrate import CALIBRATION, fit_hand_kernel
    from fusegraph.perf.fit import evaluate, o1_targets
    from fusegraph.perf.params import calibrations, load_params

    r = fit_hand_kernel(hand_view)
    assert r.max_error() <= 0.15, r.errors()
    assert max(abs(e) for e in r.errors(r.start_modeled).values()) > 0.15  # the sourced model does not
    rec = calibrations("trn3")[CALIBRATION]
    for k, v in rec["values"].items():
        assert r.values[k] == pytest.approx(v, rel=0.02, abs=1e-12), k
    figs = evaluate(hand_view, load_params("trn3", CALIBRATION))
    for k, v in o1_targets().items():
        assert (figs[k] - v) / v == pytest.approx(rec["fitted_errors"][k], abs=0.01), k


def test_held_out_rows_are_not_fitted_figures(hand_view, hand_run):
    from fusegraph.modelperf.calibrate import CALIBRATION, fit_hand_kernel, held_out_rows
    from fusegraph.perf.costmodel import estimate_kernel
    from fusegraph.perf.params import load_params

    r = fit_hand_kernel(hand_view, max_evaluations=20)
    hw = load_params("trn3", CALIBRATION)
    rows = held_out_rows(r, hw, estimate_kernel(hand_view, hw), None, 4)
    assert [h.figure for h in rows] == ["allreduce_per_layer_megakernel"]
    assert rows[0].modeled == pytest.approx(15.62, abs=0.05) and rows[0].error == pytest.approx(15.62 / 27.77 - 1,
                                                                                              abs=0.01)
    # with the profile: both programs of the LNC=2 rank issue both all-reduces of a layer (the second reading)
    rows = held_out_rows(r, hw, estimate_kernel(hand_view, hw), None, 4, hand_profile=hand_run[1])
    assert [h.figure for h in rows] == ["allreduce_per_layer_megakernel",
                                        "allreduce_per_layer_megakernel (rank 0, both programs)"]
    assert rows[1].modeled == pytest.approx(31.24, abs=0.05) and rows[1].error == pytest.approx(31.24 / 27.77 - 1,
                                                                                              abs=0.01)
