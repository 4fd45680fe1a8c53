"""Recompiles and symbolic scalars.

Dynamo compiles a frame again when a guard fails (a new batch size, a Python int that changed). Two things
must then hold: the new graph is a new *version* of the step (not a second piece of it), and a Python int that
changes every step (transformers' sliding-window cache keeps one) is taken as a runtime scalar instead of making
the step run eagerly.
"""
import warnings

import pytest
import torch

from fusegraph import FusegraphWarning
from fusegraph.capture.session import last_session
from fusegraph.capture.summary import summarize


class Counter:
    """Like a model with a sliding-window cache: a plain object (not an nn.Module: dynamo specializes ints on
    modules, recompiling every call) with a Python int that changes every call and only enters arithmetic."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(16, 16)
        self.n = 0

    def step(self, x: torch.Tensor) -> torch.Tensor:
        offset = torch.arange(16) + self.n  # a position computed from the int
        self.n += 1
        return torch.relu(self.proj(x)) + offset


class Growing:
    """A Python int that sets a tensor's shape: no static kernel can be generated for it."""

    def __init__(self) -> None:
        self.n = 4

    def step(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        return x.sum() + torch.ones(self.n).sum()


def _run(cls, calls, *args):
    model, ref = cls(), cls()
    compiled = torch.compile(model.step, backend="fusegraph", options={"executor": "eager"})
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        got = [compiled(*args) for _ in range(calls)]
        want = [ref.step(*args) for _ in range(calls)]
    return got, want, [str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)]


def test_changing_python_int_is_a_runtime_scalar():
    got, want, warned = _run(Counter, 5, torch.randn(2, 16))
    assert not warned, warned
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    session = last_session()
    summary = summarize(session)
    # call 1 specialized the int, call 2 made it symbolic: one recompile, then no more
    assert summary["recompiles"] == 1
    assert summary["inputs"]["scalar"]["count"] == 1
    (graph,) = summary["graphs"]
    assert graph["executor"] == "eager"
    assert len(session.superseded) == 1 and len(session.superseded[0].program.graphs) == 1


def test_symbolic_int_that_sets_a_shape_runs_eagerly_with_a_warning():
    got, want, warned = _run(Growing, 4, torch.randn(3))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert any("dynamic shapes are not supported" in w and "symbolic size" in w for w in warned), warned


def test_recompile_for_a_new_shape_is_a_new_version_and_the_old_one_still_runs():
    f = torch.compile(lambda x: torch.relu(x) * 2, backend="fusegraph", dynamic=False,
                      options={"executor": "eager"})
    a, b = torch.randn(3), torch.randn(5)
    assert torch.equal(f(a), torch.relu(a) * 2)
    assert torch.equal(f(b), torch.relu(b) * 2)
    session = last_session()
    assert [g.inputs[0].shape for g in session.program.graphs] == [(5,)]
    assert [g.inputs[0].shape for v in session.superseded for g in v.program.graphs] == [(3,)]
    assert torch.equal(f(a), torch.relu(a) * 2)  # dynamo picks the first version again: its runner still works


def test_refused_graph_does_not_break_the_next_one():
    """Graph indices count refused graphs too: the graph after a refused one must still be captured."""

    def f(x, w):
        y = (x.to(torch.complex128) * 2).real.float()  # unsupported dtype (complex64 is taken, as pairs): refused
        torch._dynamo.graph_break()
        return torch.relu(y @ w) + 1

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    compiled = torch.compile(f, backend="fusegraph", options={"executor": "eager"})
    with pytest.warns(FusegraphWarning) as caught:
        out = compiled(x, w)
    messages = [str(m.message) for m in caught]
    assert len(messages) == 1 and "unsupported dtype complex128" in messages[0], messages
    assert torch.equal(out, f(x, w))
    session = last_session()
    assert [g.index for g in session.program.graphs] == [1] and session.executors == {1: "eager"}
