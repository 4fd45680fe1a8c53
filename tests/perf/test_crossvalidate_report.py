"""``fusegraph.modelperf.crossvalidate`` end to end (what ``benchmarks/bench_crossval.py`` prints) on test_fit's
small recorded trace standing in for two measured kernels: every set's figures per kernel, the fits' parameters
with their ranges, the band -- without the third-party checkouts."""
import pytest

from fusegraph.modelperf import crossvalidate as CV
from fusegraph.perf import crossval as X
from fusegraph.perf import fit as F
from fusegraph.perf.params import load_params

from .test_fit import view  # noqa: F401

HW = load_params("trn3")


def test_run_and_report(view):  # noqa: F811
    measured = F.evaluate(view, HW, {"pe_min_cycles": 190.0, "dma_issue_hwdge": 0.41e-6})
    ks = [X.MeasuredKernel("a", view, {"wall": measured["wall"], "tensor": measured["tensor"]}, {"wall": "s"}),
          X.MeasuredKernel("b", view, {"wall": measured["wall"], "sync": (0.0, measured["sync"])}, {}, group="g")]
    r = CV.run(kernels=ks, params=("pe_min_cycles", "dma_issue_hwdge"), max_evaluations=60)
    assert r["kernels"] == ["a", "b"] and r["groups"] == {"a": "a", "b": "g"}
    assert set(r["parameters"]) >= {"sourced", "joint fit", "without a", "without g"}
    for k in ("a", "b"):
        sets = r["per_kernel"][k]["modeled_s"]
        assert set(sets) >= {"sourced", "joint fit", "left out"}
        assert r["per_kernel"][k]["errors"]["joint fit"]["wall"] == pytest.approx(0.0, abs=0.05)
    assert r["band"]["wall"] == max(abs(r["per_kernel"][k]["errors"]["left out"]["wall"]) for k in ("a", "b"))
    text = CV.format_report(r)
    assert "Cost model cross-validation on 2 measured kernels" in text and "MODELED" in text
    assert "<= " in text  # b's Sync is an upper bound
    assert text.splitlines()[-1].startswith("Band (largest error of a figure on a kernel left out of the fit): ")
    with pytest.raises(RuntimeError, match="two measured kernels"):
        CV.run(kernels=ks[:1])
