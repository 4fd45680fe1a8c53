"""The calibrated parameter set of the data file: selectable, never the default, changes only the low-confidence
parameters, each with the calibration (date, kernel, figures) as its source; validation rejects anything else."""
import copy

import pytest

from fusegraph.perf import params
from fusegraph.perf.params import FITTABLE, calibrations, load_params, validate

NAME = "o1_hand_megakernel"


def test_sourced_set_is_the_default_and_the_calibrated_one_is_labelled():
    sourced, default = load_params("trn3", "sourced"), load_params("trn3")
    assert default.parameter_set == "sourced" and default.pe_min_cycles == sourced.pe_min_cycles == 64
    cal = load_params("trn3", NAME)
    assert cal.parameter_set == NAME
    rec = calibrations("trn3")[NAME]
    changed = {n for n in cal.names() if cal.param(n).value != sourced.param(n).value
               or cal.param(n).source != sourced.param(n).source}
    assert changed == set(rec["values"]) and changed <= set(FITTABLE)
    for n in changed:
        p = cal.param(n)
        assert p.value == rec["values"][n] and p.confidence == "M"
        assert rec["date"] in p.source and "O1" in p.source and str(sourced.param(n).value) in p.source
    # what-ifs of a calibrated set stay labelled with it
    assert cal.what_if("x", pe_min_cycles=1).parameter_set == NAME


def test_the_record_names_the_kernel_the_figures_and_the_method():
    rec = calibrations()[NAME]
    assert rec["target"] == "trn3" and "nki-moe-megakernel" in rec["kernel"]
    assert {k: v["value"] for k, v in rec["figures"].items()} == {"wall": 134.47, "sync": 19.05,
                                                                  "dma_active": 66.50, "tensor": 48.15}
    assert all(abs(e) <= 0.15 for e in rec["fitted_errors"].values())  # the target: within 15%
    assert "fusegraph.perf.fit" in rec["method"]


def test_unknown_or_foreign_sets_are_refused():
    with pytest.raises(ValueError, match="unknown parameter set"):
        load_params("trn3", "nope")
    with pytest.raises(ValueError, match="is for trn3"):
        load_params("trn2", NAME)


@pytest.mark.parametrize("edit,problem", [
    (lambda c: c["values"].__setitem__("dma_bandwidth_core", 1e9), "not a low-confidence parameter"),
    (lambda c: c.pop("date"), "no date"),
    (lambda c: c.pop("figures"), "no fitted figures"),
    (lambda c: c["values"].__setitem__("pe_min_cycles", "fast"), "not a number"),
    (lambda c: c.__setitem__("target", "trn9"), "unknown target"),
])
def test_validate_rejects_a_bad_calibration(edit, problem):
    data = copy.deepcopy(params.raw_data())
    edit(data["calibrations"][NAME])
    assert any(problem in p for p in validate(data)), validate(data)
