"""The collective figure (issue 14): O1's CC per layer (27.77 us) is not a like quantity for the collective
parameters, so nothing is fitted to it; the held-out table gives program 0's all-reduces and, as the second
reading, both programs of the LNC=2 rank (each issues both of a layer's all-reduces), with the reasons.
A one-layer kernel of our own with the hand kernel's two all-reduces per program stands in for it."""
import types

import pytest

from fusegraph import nkisim
from fusegraph.modelperf import calibrate
from fusegraph.perf.against import KernelSpec, _other_programs_collectives, compare, cost_spec, format_comparison
from fusegraph.perf.costmodel import estimate_kernel
from fusegraph.perf.fit import O1_SOURCES
from fusegraph.perf.kernelview import view_from_trace
from fusegraph.perf.params import FITTABLE, load_params

from .test_collectives_cost import KERNELS

US = 1e6


@pytest.fixture(scope="module")
def ns():
    return nkisim.load_kernel_source(KERNELS, "cc_held_out_kernels.py", target="trn3")


@pytest.fixture(scope="module")
def one_layer(ns):
    nkisim.run(ns["two_allreduces"], nkisim.Abstract((128, 16), "bfloat16"), lnc=2, target="trn3",
               shape_only=True, trace=True)
    prof = nkisim.last_profile()
    return prof, estimate_kernel(view_from_trace(prof.trace[(0, 0)]), load_params("trn3"))


def test_cc_is_held_out_with_both_readings_and_not_fitted(one_layer):
    prof, est = one_layer
    assert "cc_step_latency" not in FITTABLE
    fitted = types.SimpleNamespace(used=lambda: set(O1_SOURCES.values()))
    hw = load_params("trn3", calibrate.CALIBRATION)
    rows = {r.figure: r for r in calibrate.held_out_rows(fitted, hw, est, None, 1, hand_profile=prof)}
    one = rows["allreduce_per_layer_megakernel"]
    both = rows["allreduce_per_layer_megakernel (rank 0, both programs)"]
    assert one.modeled == pytest.approx(15.62, abs=0.01) and one.error == pytest.approx(15.62 / 27.77 - 1, abs=1e-3)
    assert both.modeled == pytest.approx(2 * one.modeled)  # the LNC partner issues the same two
    assert both.error == pytest.approx(2 * 15.62 / 27.77 - 1, abs=1e-3)  # +12.5%
    assert one.comparable.count("NOT like for like") == 1 and "slowest rank" in one.comparable
    assert "13.45 us" in one.comparable and "4 per layer recorded" not in one.comparable
    assert "4 per layer recorded by the interpreter" in both.comparable
    # without the profile (other callers), only program 0's row
    rows = [r.figure for r in calibrate.held_out_rows(fitted, hw, est, None, 1)]
    assert rows == ["allreduce_per_layer_megakernel"]


def test_against_reports_the_partner_programs_collectives(one_layer):
    prof, _ = one_layer
    other = _other_programs_collectives(prof, load_params("trn3"), 1)
    assert other["count"] == 2 and other["bytes"] == 6144
    assert other["modeled_s"] * US == pytest.approx(15.62, abs=0.01)


def test_against_table_says_the_partner_issues_its_own(ns):
    side = cost_spec(KernelSpec(kernel=ns["two_allreduces"], args=[nkisim.Abstract((128, 16), "bfloat16")], lnc=2,
                                target="trn3", name="two-allreduces"))
    res = {"model": None, "target": "trn3", "theirs": side.to_dict(), "fusegraph": "no model",
           "comparison": compare("no model", side), "layer_var": None}
    text = format_comparison(res)
    assert "theirs: rank 0's other program(s) issue 2 more collective(s) per layer (6,144 B, 15.62 us" in text
