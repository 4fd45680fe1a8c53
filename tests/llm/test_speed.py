"""The modeled speedup: a verified kernel's profile on the cost model vs the per-op baseline of its reference."""
import pytest

from fusegraph.llm import evalset
from fusegraph.llm.harness import verify
from fusegraph.llm.speed import Speed, baseline_seconds, kernel_seconds, modeled_speedup, program_share
from fusegraph.llm.task import KernelTask
from fusegraph.perf.costmodel import estimate_kernel
from fusegraph.perf.kernelview import build_view
from fusegraph.perf.params import load_params

from . import kernels as K
from .eval_solutions import SOLUTIONS

HELPER = K.GOOD.replace("@nki.jit", '''def fused(dst, data, addend):
    nisa.scalar_tensor_tensor(dst=dst, data=data, op0=nl.multiply, operand0=2.0, op1=nl.add, operand1=addend)


@nki.jit''').replace(
    "    nisa.scalar_tensor_tensor(dst=ys, data=xs, op0=nl.multiply, operand0=2.0, op1=nl.add, operand1=bs)\n",
    "    fused(ys, xs, bs)\n")


@pytest.fixture(scope="module")
def good():
    task = K.scaled_add_task()
    v = verify(K.GOOD, task)
    assert v.ok and v.profile is not None
    return task, v.profile


def test_kernel_time_is_the_cost_model_of_its_profile(good):
    task, profile = good
    k, note = kernel_seconds(K.GOOD, "scaled_add", profile)
    assert note == ""
    view = build_view(K.GOOD, profile, kernel="scaled_add")
    assert k == pytest.approx(estimate_kernel(view, load_params("trn2")).seconds)
    sp = modeled_speedup(task, K.GOOD, "scaled_add", profile)
    assert sp.kernel_s == pytest.approx(k) and sp.baseline_s == pytest.approx(baseline_seconds(task))
    assert sp.baseline_s > 0
    assert sp.speedup == pytest.approx(sp.baseline_s / sp.kernel_s)
    # the baseline is one kernel per ATen op: 2 * x + b (mul, add) costs more than x + b (add)
    one_op = KernelTask("add", "def reference(x, b):\n    return x + b\n", lambda x, b: x + b, task.inputs,
                        task.outputs)
    assert 0 < baseline_seconds(one_op) < sp.baseline_s


def test_work_outside_the_kernel_function_is_kept_not_dropped(good):
    task, _ = good
    v = verify(HELPER, task)
    assert v.ok, v.detail
    inline, _ = kernel_seconds(K.GOOD, "scaled_add", good[1])
    helper, note = kernel_seconds(HELPER, "scaled_add", v.profile)
    assert "outside nisa calls of the kernel function" in note
    assert helper == pytest.approx(inline)  # placed at the helper's call: the same schedule as written inline


def test_lnc2_share_is_measured_or_assumed():
    assert program_share({"lnc": 1}) == (1.0, "")
    share, note = program_share({"lnc": 2, "program_instructions": [30, 10]})
    assert share == 0.75 and "30 of 40" in note
    share, note = program_share({"lnc": 2, "program_instructions": None})
    assert share == 0.5 and "assumed" in note
    v = verify(SOLUTIONS["row_softmax_lnc2"], evalset.row_softmax(2))
    assert v.ok
    split, _ = kernel_seconds(SOLUTIONS["row_softmax_lnc2"], "row_softmax_lnc2", v.profile)
    serial, _ = kernel_seconds(SOLUTIONS["row_softmax_lnc2"], "row_softmax_lnc2", dict(v.profile, lnc=1))
    assert split < serial  # each core runs half of the counted work


def test_failures_are_notes_not_exceptions(good):
    task, profile = good
    assert modeled_speedup(task, K.GOOD, "scaled_add", None).speedup is None
    broken = modeled_speedup(task, "def (:", "scaled_add", profile)
    assert broken.speedup is None and broken.note.startswith("kernel not modeled")
    assert Speed(kernel_s=1e-6, baseline_s=None).speedup is None
