"""Verification harness: process isolation and limits, in-place outputs, dtypes, inputs, comparison."""
import math

import pytest
import torch

from fusegraph.llm import compare
from fusegraph.llm.harness import Limits, run_isolated, verify
from fusegraph.llm.inputs import make_cases, make_input
from fusegraph.llm.task import KernelTask, TensorSpec

from . import kernels as K


def test_the_kernel_never_runs_in_this_process(monkeypatch):
    import fusegraph.nkisim as nkisim
    import fusegraph.nkisim.modules as modules

    def forbidden(*a, **k):
        raise AssertionError("kernel source loaded in the compiling process")

    monkeypatch.setattr(nkisim, "load_kernel_source", forbidden)
    monkeypatch.setattr(modules, "load_kernel_source", forbidden)
    v = verify(K.GOOD, K.scaled_add_task())
    assert v.ok, v.detail
    assert [c["case"] for c in v.cases] == ["random", "zeros", "negative", "large"]
    assert all(c["compute_instructions"] == 1 for c in v.cases)


def test_worker_starts_without_torch(tmp_path):
    import subprocess
    import sys

    code = "import sys, fusegraph.llm.worker, fusegraph.nkisim; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert out.stdout.strip() == "False"


def test_memory_limit():
    src = K.GOOD.replace("    return out\n", "    hog = [0] * (10 ** 10)\n    return out\n")
    v = verify(src, K.scaled_add_task(), limits=Limits(memory_mb=1024))
    assert not v.ok and v.stage == "run" and "memory limit exceeded (1024 MiB)" in v.reason


def test_worker_scrubs_builtins_behind_the_static_check():
    # run_isolated skips the static checks: the worker itself must refuse open() and imports
    task = K.scaled_add_task()
    cases = make_cases(task)[:1]
    out = run_isolated(K.GOOD.replace("    return out\n", "    open('/etc/hostname')\n    return out\n"),
                       "scaled_add", task, cases)
    assert not out.ok and "NameError" in out.reason and "'open'" in out.reason
    sneaky = K.GOOD.replace("    return out\n", "    import os\n    return out\n")
    out = run_isolated(sneaky, "scaled_add", task, cases)
    assert not out.ok and "import of 'os' is not allowed" in out.reason
    assert "kernel.py:" in out.detail  # the kernel traceback names the kernel's own line


def test_interpreter_errors_come_back_with_rule_and_line():
    src = K.GOOD.replace('xs = nl.ndarray(shape=(4, 64)', 'xs = nl.ndarray(shape=(256, 1)')
    v = verify(src, K.scaled_add_task())
    assert not v.ok and v.stage == "run" and "[partition-dim]" in v.detail and "kernel.py:" in v.detail


def test_output_dtype_must_match():
    src = K.GOOD.replace('out = nl.ndarray(shape=(4, 64), dtype=nl.float32', 'out = nl.ndarray(shape=(4, 64), '
                         'dtype=nl.bfloat16')
    v = verify(src, K.scaled_add_task())
    assert not v.ok and v.stage == "compare" and "has dtype bfloat16, expected float32" in v.reason


KV_WRITE = K.HEADER + '''

@nki.jit
def write_row(cache, row, pos):
    idx = nl.ndarray(shape=(1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=pos.reshape((1, 1)))
    t = nl.ndarray(shape=(1, 64), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=row)
    s = nl.ndarray(shape=(1, 64), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=s, data=t, op0=nl.multiply, operand0=0.5)
    nisa.dma_copy(dst=cache.ap(pattern=[[64, 1], [1, 64]], offset=0, scalar_offset=idx, indirect_dim=0), src=s)
    return cache
'''


def _kv_task(alias: bool) -> KernelTask:
    def reference(cache, row, pos):
        cache[int(pos[0])] = row[0] * 0.5
        return cache

    return KernelTask("write_row", "def reference(cache, row, pos):\n    cache[pos[0]] = row[0] * 0.5\n"
                      "    return cache\n", reference,
                      [TensorSpec("cache", (8, 64), torch.float32), TensorSpec("row", (1, 64), torch.float32),
                       TensorSpec("pos", (1,), torch.int64, index=True, value_range=(0, 8))],
                      [TensorSpec("cache", (8, 64), torch.float32, alias_of="cache" if alias else None)])


def test_in_place_output_is_verified_against_the_updated_input():
    v = verify(KV_WRITE, _kv_task(alias=True))
    assert v.ok, v.detail
    wrong = verify(KV_WRITE.replace("operand0=0.5", "operand0=0.25"), _kv_task(alias=True))
    assert not wrong.ok and wrong.stage == "compare"
    assert not verify(KV_WRITE, _kv_task(alias=False)).ok


def test_reference_nan_on_random_inputs_is_the_callers_problem():
    task = K.scaled_add_task()
    task.reference = lambda x, b: torch.full_like(x, math.nan)
    v = verify(K.GOOD, task)
    assert not v.ok and v.stage == "reference" and "NaN" in v.reason


def test_edge_cases_skip_only_when_the_reference_is_nan():
    task = K.scaled_add_task()
    task.reference = lambda x, b: torch.where(x.abs().amax() > 50, torch.full_like(x, math.nan), 2.0 * x + b)
    v = verify(K.GOOD, task)
    assert v.ok and "cases skipped: reference NaN on large" in v.reason


def test_input_cases():
    f = TensorSpec("x", (64, 64), torch.float32, value_range=(-2, 3))
    rnd, zeros, neg, large = (make_input(f, c) for c in ("random", "zeros", "negative", "large"))
    for t in (rnd, zeros, neg, large):
        assert not torch.isnan(t).any()
    assert rnd.min() >= -2 and rnd.max() <= 3 and rnd.std() > 0.5
    assert (zeros == 0).all() and (neg <= 0).all() and neg.min() < -1
    assert large.abs().min() >= 0.25 * 3 * 64 and (large < 0).any() and (large > 0).any()
    idx = TensorSpec("i", (100,), torch.int32, index=True, value_range=(3, 9))
    got = {c: make_input(idx, c) for c in ("random", "zeros", "negative", "large")}
    assert all(((t >= 3) & (t < 9)).all() for t in got.values())
    assert (got["zeros"] == 3).all() and (got["large"] == 8).all()
    fixed = TensorSpec("c", (2, 2), torch.float32, fixed=torch.eye(2))
    assert all(torch.equal(make_input(fixed, c), torch.eye(2)) for c in ("random", "large"))
    steady = TensorSpec("w", (8,), torch.float32, edge_values=False)
    assert make_input(steady, "large").abs().max() <= 4 and make_input(steady, "zeros").abs().min() > 0
    assert torch.equal(make_input(f, "random", seed=1), make_input(f, "random", seed=1))
    assert not torch.equal(make_input(f, "random", seed=1), make_input(f, "random", seed=2))
    bf = make_input(TensorSpec("h", (4, 4), torch.bfloat16), "large")
    assert bf.dtype == torch.bfloat16 and torch.isfinite(bf).all()


def test_compare_messages():
    spec = TensorSpec("y", (2, 3), torch.float32)
    ref = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert compare.compare(ref.clone(), ref, spec, "random") == (None, 0.0)
    got = ref.clone()
    got[1, 2] = 7.5
    msg, diff = compare.compare(got, ref, spec, "large")
    assert diff == 1.5 and "max |kernel - reference| = 1.5 at index (1, 2)" in msg and "case 'large'" in msg
    got = ref.clone()
    got[0, 1] = math.nan
    msg, diff = compare.compare(got, ref, spec, "zeros")
    assert diff == math.inf and "non-finite" in msg and "(0, 1)" in msg
    assert "shape" in compare.compare(ref[:1], ref, spec, "random")[0]
    inf = ref.clone()
    inf[0, 0] = math.inf
    assert compare.compare(inf.clone(), inf, spec, "large")[0] is None
    bf = TensorSpec("y", (2, 3), torch.bfloat16)
    assert compare.compare((ref * 1.01).bfloat16(), ref.bfloat16(), bf, "random")[0] is None
    assert compare.compare((ref * 1.2).bfloat16(), ref.bfloat16(), bf, "random")[0] is not None
    loose = TensorSpec("y", (2, 3), torch.float32, atol=0.0, rtol=0.5)
    assert compare.compare(ref * 1.4, ref, loose, "random")[0] is None


def test_invalid_task_is_reported():
    task = K.scaled_add_task()
    task.cases = ("zeros",)
    v = verify(K.GOOD, task)
    assert not v.ok and v.stage == "reference" and "needs the 'random' case" in v.reason


@pytest.mark.parametrize("source, stage", [
    ("def broken(:\n", "parse"),
    ("x" * 200_001, "parse"),
])
def test_parse_failures(source, stage):
    v = verify(source, K.scaled_add_task())
    assert not v.ok and v.stage == stage
