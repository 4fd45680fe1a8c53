"""The llm-eval problem set: fixed and versioned, shaped to need tiling, and every problem solvable."""
import pytest

from fusegraph.llm import evalset
from fusegraph.llm.harness import static_checks, verify

from .eval_solutions import SOLUTIONS


def test_the_set_is_versioned_and_covers_the_level_one_kinds():
    names = evalset.problem_names()
    assert len(names) == len(set(names)) == 16
    assert evalset.EVALSET_VERSION == "1"
    for kind in ("scale_matrix", "elementwise_chain", "row_softmax", "rmsnorm", "layernorm", "silu_gate",
                 "gelu_tanh_gate", "matmul_psum", "transpose", "cumsum", "topk", "gather_rows", "kv_row_write"):
        assert kind in names
    assert [p.name for p in evalset.PROBLEMS if p.lnc == 2] == ["row_softmax_lnc2", "rmsnorm_lnc2",
                                                                 "matmul_psum_lnc2"]
    assert sorted(SOLUTIONS) == sorted(names)  # a reference solution for every problem


@pytest.mark.parametrize("problem", evalset.PROBLEMS, ids=lambda p: p.name)
def test_problem_is_well_formed_and_needs_tiling(problem):
    task = problem.task()
    assert task.problems() == [] and task.name == problem.name and task.lnc == problem.lnc
    assert f"v{evalset.EVALSET_VERSION}" in task.model
    # the reference is its own text executed: running it gives outputs of the declared shapes
    assert max(max(s.shape) for s in task.inputs) >= 256, "every problem spans several 128-partition tiles"
    if problem.name.startswith("matmul"):
        (x, w), (y,) = task.inputs, task.outputs
        assert x.shape[1] > 128 and y.shape[1] > 512  # K accumulates in PSUM, N needs two moving tiles


def test_problems_are_rebuilt_identically_and_select_checks_names():
    a, b = evalset.rmsnorm(), evalset.rmsnorm()
    assert a.reference_source == b.reference_source and a.inputs == b.inputs
    assert [p.name for p in evalset.select(["topk", "cumsum"])] == ["cumsum", "topk"]  # set order
    with pytest.raises(KeyError, match="unknown problem"):
        evalset.select(["softmax"])


# Plain elementwise/normalisation problems on large tiles cost ~1-2 s of CPU each and exercise nothing the
# others do not (row_softmax and layernorm also pass in test_eval.py): they run with -m slow.
SLOW = {"scale_matrix", "elementwise_chain", "rmsnorm", "silu_gate", "gelu_tanh_gate", "row_softmax", "layernorm"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in sorted(SOLUTIONS)])
def test_every_problem_is_solvable_by_its_reference_solution(name):
    problem = next(p for p in evalset.PROBLEMS if p.name == name)
    task = problem.task()
    info, bad = static_checks(SOLUTIONS[name], task)
    assert bad is None and info.name == task.kernel_name
    v = verify(SOLUTIONS[name], task)
    assert v.ok, v.detail
    assert v.profile is not None and v.profile["lnc"] == problem.lnc
