"""Joint fit and leave-one-out cross-validation (``fusegraph.perf.crossval``) on the recorded trace of
test_fit's small kernel: "measured" figures produced by known parameters, split over two kernels so that each
kernel alone determines one parameter -- a joint fit recovers both; leaving a kernel out shows its error under a
fit that could not see it (the band a modeled time is quoted with)."""
import pytest

from fusegraph.perf import crossval as X
from fusegraph.perf import fit as F
from fusegraph.perf.params import load_params

from .test_fit import view  # noqa: F401  (the module-scoped fixture: 3 layers of DMAs, matmuls, a Scalar/Vector chain)

HW = load_params("trn3")
TRUTH = {"pe_min_cycles": 190.0, "dma_issue_hwdge": 0.41e-6}


@pytest.fixture(scope="module")
def kernels(view):  # noqa: F811
    measured = F.evaluate(view, HW, TRUTH)
    # kernel "pe" measured only its Tensor engine (depends on pe_min_cycles), kernel "sync" only its Sync engine
    # (depends on dma_issue_hwdge): each alone determines one parameter
    return [X.MeasuredKernel("pe", view, {"tensor": measured["tensor"]}, {"tensor": "test:tensor"}),
            X.MeasuredKernel("sync", view, {"sync": measured["sync"]}, {"sync": "test:sync"})]


def test_joint_fit_recovers_what_each_kernel_determines(kernels):
    r = X.fit_joint(kernels, HW, params=tuple(TRUTH), prior=0.0, max_evaluations=300)
    for k, v in TRUTH.items():
        assert r.values[k] == pytest.approx(v, rel=0.03), (k, r.values)
    assert set(r.targets) == {"pe:tensor", "sync:sync"}
    assert r.max_error() < 0.01
    assert X.split(r, "pe")["tensor"] == pytest.approx(kernels[0].targets["tensor"], rel=0.01)
    assert r.sources == {"pe:tensor": "test:tensor", "sync:sync": "test:sync"}


def test_leave_one_out_shows_the_error_a_single_kernel_fit_cannot_see(kernels):
    rounds = X.leave_one_out(kernels, HW, params=tuple(TRUTH), prior=1e-3, max_evaluations=300)
    assert [r.kernel for r in rounds] == ["pe", "sync"]
    for r in rounds:
        assert not any(k.startswith(r.kernel + X.SEP) for k in r.fit.targets)  # fitted without it
        # the left-out kernel's parameter stayed near its sourced value, so its error is the sourced one
        assert r.errors()[next(iter(r.measured))] == pytest.approx(r.errors(r.sourced)[next(iter(r.measured))],
                                                                   rel=0.05)
        assert r.max_error() > 0.2
    assert X.band(rounds, "tensor") == pytest.approx(abs(rounds[0].errors()["tensor"]))
    assert X.band(rounds, "wall") is None  # no round measured a wall
    d = rounds[0].to_dict()
    assert set(d) >= {"kernel", "fit", "measured_s", "modeled_s", "errors", "sourced_errors"}


def test_each_kernel_weighs_the_same_whatever_its_figure_count(view):  # noqa: F811
    seen = {}

    def ev(name, figs):
        def f(values):
            seen.setdefault(name, 0)
            seen[name] += 1
            return figs
        return f

    a = X.MeasuredKernel("a", view, {"wall": 2.0, "sync": 2.0, "tensor": 2.0}, {})
    b = X.MeasuredKernel("b", view, {"wall": 2.0}, {})
    # every figure modeled at 1.0: a's three figures and b's one are each 2x off; equal kernel weights make the
    # objective 2 x log(2)^2 (not 4 x) at the start
    figs = {"wall": 1.0, "sync": 1.0, "tensor": 1.0}
    r = X.fit_joint([a, b], HW, params=("pe_min_cycles",), prior=0.0, max_evaluations=5,
                    evaluators={"a": ev("a", figs), "b": ev("b", figs)})
    import math

    assert r.objective == pytest.approx(2 * math.log(2) ** 2)
    assert seen["a"] == seen["b"] == r.evaluations


def test_refusals(kernels):
    with pytest.raises(ValueError, match="two measured kernels"):
        X.leave_one_out(kernels[:1], HW)
    with pytest.raises(ValueError, match="distinct names"):
        X.fit_joint([kernels[0], kernels[0]], HW)
    with pytest.raises(ValueError, match="at least one"):
        X.fit_joint([], HW)


def test_an_upper_bound_is_met_anywhere_below_it(view):  # noqa: F811
    """A whole-profile engine time that also holds work outside the kernel bounds the per-layer figure from above:
    (0, bound) costs nothing anywhere below the bound and pulls the parameter down only when above it."""
    base = F.evaluate(view, HW)
    loose = X.MeasuredKernel("loose", view, {"tensor": (0.0, 2 * base["tensor"])}, {})
    r = X.fit_joint([loose], HW, params=("pe_min_cycles",), prior=1e-3, max_evaluations=100)
    assert r.values["pe_min_cycles"] == pytest.approx(HW.pe_min_cycles)  # already inside: stays sourced
    assert r.errors() == {"loose:tensor": 0.0}
    tight = X.MeasuredKernel("tight", view, {"tensor": (0.0, 0.5 * base["tensor"])}, {})
    r = X.fit_joint([tight], HW, params=("pe_min_cycles",), prior=0.0, max_evaluations=100)
    assert r.values["pe_min_cycles"] == pytest.approx(HW.pe_min_cycles / 2, rel=0.03)
    assert tight.errors({"tensor": 0.75 * base["tensor"]})["tensor"] == pytest.approx(0.5)


def test_a_group_is_left_out_together(kernels, view):  # noqa: F811
    """Two profiles of one kernel's variants are one group: leaving one out while its sibling stays in would test
    the model on what it was fitted to."""
    measured = F.evaluate(view, HW, TRUTH)
    sibling = X.MeasuredKernel("sync bis", view, {"sync": measured["sync"]}, {}, group="sync")
    grouped = [kernels[0], X.MeasuredKernel("sync", view, kernels[1].targets, {}, group="sync"), sibling]
    rounds = X.leave_one_out(grouped, HW, params=tuple(TRUTH), prior=1e-3, max_evaluations=300)
    by = {r.kernel: r for r in rounds}
    assert set(by["sync"].fit.targets) == {"pe:tensor"}  # fitted without either sync kernel
    assert by["sync bis"].fit is by["sync"].fit
    assert by["sync bis"].max_error() > 0.2  # the sibling did not leak the answer
    with pytest.raises(ValueError, match="two groups"):
        X.leave_one_out(grouped[1:], HW)
