"""A decode step that dynamo would recompile at every call: detected, fixed where the value is a position counter,
warned about otherwise (fusegraph/capture/recompiles.py).

With ``torch.compile(..., dynamic=False)`` (how ``capture_step`` compiles) dynamo specializes transformers'
sliding-window counter ``cache.layers[i].cumulative_length_int`` and recompiles at every step; after 8 versions the
step ran in plain eager, silently. Now the counter becomes a symbolic scalar after its second recompile.
"""
import warnings

import pytest
import torch

from fusegraph import FusegraphWarning
from fusegraph.capture.recompiles import guard_expression
from fusegraph.capture.session import last_session
from fusegraph.models import build_family_decode, greedy_decode

STEPS = 12


@pytest.fixture(autouse=True)
def _restore_dynamic_sources():
    saved = torch.compiler.config.dynamic_sources
    torch.compiler.config.dynamic_sources = ""
    torch._dynamo.reset()
    yield
    torch.compiler.config.dynamic_sources = saved
    torch._dynamo.reset()


def _fusegraph_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)]


@pytest.mark.parametrize("executor", ["eager", "nkisim"])
def test_sliding_window_counter_under_dynamic_false_stops_recompiling(executor):
    case = build_family_decode("Mistral")
    ref = case.fork()
    assert hasattr(case.cache.layers[0], "cumulative_length_int")
    compiled = torch.compile(case.step, backend="fusegraph", dynamic=False,
                             options={"executor": executor, "cache_dir": "off"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = greedy_decode(compiled, case.token, case.position, STEPS)
    want = greedy_decode(ref.step, ref.token, ref.position, STEPS)
    assert not _fusegraph_warnings(caught), _fusegraph_warnings(caught)
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))
    for a, b in zip(got[1], want[1]):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()
    session = last_session()
    # calls 1-3 specialized the counter (the second recompile on it shows automatic dynamic is off); from the
    # fourth version on it is a symbolic scalar
    assert len(session.superseded) + 1 <= 4, f"{len(session.superseded) + 1} versions for {STEPS} steps"
    assert session.recompiles.made_dynamic == ["cumulative_length_int"]
    assert session.program.inputs() and any(i.kind.value == "scalar" for i in session.program.inputs())
    if executor == "nkisim":
        (record,) = session.program.execution.values()
        assert record.launches_per_call == 1 and record.calls == STEPS - len(session.superseded)


class ModuleCounter(torch.nn.Module):
    """A step counter on an nn.Module (dynamo specializes ints on modules): not a known position counter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(16, 16)
        self.step_count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step_count += 1
        return torch.relu(self.proj(x)) + self.step_count


def test_other_guard_failing_at_every_call_warns_once_naming_it():
    model, ref = ModuleCounter(), ModuleCounter()
    compiled = torch.compile(model, backend="fusegraph", options={"executor": "eager"})
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        x = torch.randn(2, 16)
        got = [compiled(x) for _ in range(6)]
        want = [ref(x) for _ in range(6)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    msgs = [m for m in _fusegraph_warnings(caught) if "recompiles the step at every call" in m]
    assert len(msgs) == 1 and "step_count" in msgs[0], _fusegraph_warnings(caught)


def test_guard_expression():
    assert guard_expression("0/3: L['self'].cache.layers[0].cumulative_length_int == 11") == \
        "L['self'].cache.layers[0].cumulative_length_int"
    assert guard_expression("3/1: self.step_count == 2\nUser stack trace: ...") == "self.step_count"
