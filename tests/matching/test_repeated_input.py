"""A pattern that uses one input twice in one op (``x * x``, the usual way to write a square; ``x + x``) traces,
binds and matches, through the public pattern API (docs/patterns.md), and runs inside the megakernel."""
import pytest
import torch

import fusegraph
from fusegraph.matching import unregister_pattern

FORMS = {
    "mul": lambda x: x * x,
    "torch_mul": lambda x: torch.mul(x, x),
    "add": lambda x: x + x,
}


class Block(torch.nn.Module):
    """``x + down(up(x)^2)`` with the square written as ``h * h`` (or ``h + h``): the repeated operand is a
    computed value (the ``up`` projection's output)."""

    def __init__(self, form: str, hidden: int = 256) -> None:
        super().__init__()
        self.up = torch.nn.Linear(hidden, hidden)
        self.down = torch.nn.Linear(hidden, hidden)
        self.form = FORMS[form]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.form(self.up(x)))


@pytest.fixture(params=sorted(FORMS))
def square(request):
    name = f"fgtest.twice_{request.param}"
    body = FORMS[request.param]

    def twice(x):
        return body(x)

    fusegraph.register_pattern(name, template="twice", priority=5, dtypes=("float32",),
                               inputs=[fusegraph.Input("x", "T H")])(twice)
    yield request.param, name
    unregister_pattern(name)


def test_pattern_with_one_input_twice_matches_in_a_program(square):
    form, name = square
    torch.manual_seed(0)
    report = fusegraph.explain(Block(form).eval(), torch.randn(2, 256))
    data = report.to_dict()
    assert data["pattern_counts"].get(name) == 1, "\n".join(report.explain(name))
    (m,) = [m for m in report.analysis.matches if m.pattern.name == name]
    # bound to the up projection's output, which the op reads at both arguments
    assert report.analysis.program.graph.nodes[m.inputs["x"]]["op"] == "aten.addmm.default"
    assert report.analysis.program.graph.nodes[m.inputs["x"]]["module"] == "up"
    assert report.coverage == 1.0


def test_pattern_with_one_input_twice_does_not_match_two_different_values(square):
    form, name = square

    def two_values(a, b):
        return a * b if form != "add" else a + b

    report = fusegraph.explain(two_values, torch.randn(2, 256), torch.randn(2, 256))
    assert name not in report.to_dict()["pattern_counts"]
    assert any("different values" in line for line in report.explain(name)), report.explain(name)


def test_square_pattern_runs_in_the_megakernel(square):
    form, name = square
    torch.manual_seed(1)
    block = Block(form).eval()
    torch._dynamo.reset()
    step = torch.compile(block, backend="fusegraph", dynamic=False,
                         options={"executor": "nkisim", "cache_dir": "off"})
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 256)
            got, want = step(x), block(x)
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    (record,) = fusegraph.last_capture().program.execution.values()
    assert record.launches_per_call == 1 and [r.verification for r in record.regions] == ["passed"]
    (plan,) = record.run.plans
    assert [i.pattern for i in plan.lowered.program.instructions].count(name) == 1
