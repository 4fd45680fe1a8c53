"""A graph fusegraph refuses (complex rope in complex128: ``view_as_complex`` / ``torch.polar``, as some families write
RoPE, but in a dtype Trainium has no pairs for; complex64 is captured as real pairs) runs eagerly and counts as uncovered, with its reason: in the report, ``explain()`` and the capture summary. Before,
a step whose only graph was refused reported ``coverage: 1.0`` of 0 ops."""
import warnings

import torch

import fusegraph
from fusegraph.capture.session import last_session
from fusegraph.report import report_for_session


class ComplexRopeLayer(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(hidden, hidden)
        self.register_buffer("freqs", torch.polar(torch.ones(hidden // 2, dtype=torch.float64),
                                                  torch.linspace(0, 3, hidden // 2, dtype=torch.float64)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x)
        c = torch.view_as_complex(q.double().reshape(*q.shape[:-1], -1, 2))
        return x + torch.view_as_real(c * self.freqs).flatten(-2).float()


class Head(torch.nn.Module):
    """Named children (no ``0``/``1`` in its module paths: those would read as decoder layers)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(hidden, hidden)
        self.down = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.up(x)))


class Model(torch.nn.Module):
    """Decoder layers under ``layers.N`` (so their ops are decoder-layer ops), optionally a break and a head."""

    def __init__(self, hidden: int = 64, head: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([ComplexRopeLayer(hidden) for _ in range(2)])
        self.head = Head(hidden) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        if self.head is None:
            return x
        torch._dynamo.graph_break()
        return self.head(x)


def _explain(model, x):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = fusegraph.explain(model, x)
    return report, [str(w.message) for w in caught if issubclass(w.category, fusegraph.FusegraphWarning)]


def test_a_refused_only_graph_is_zero_coverage_with_its_reason():
    model = Model().eval()
    x = torch.randn(2, 64)
    report, warned = _explain(model, x)
    assert len(warned) == 1 and "unsupported dtype complex128" in warned[0], warned
    data = report.to_dict()
    assert data["op_count"] == 0 and data["graphs"] == 0
    assert data["coverage"] == 0.0 and data["coverage_matched"] == 0.0 and data["coverage_all_ops"] == 0.0
    (refused,) = data["refused_graphs"]
    assert "complex128" in refused["reason"] and refused["decoder_ops"] == refused["ops"] > 0
    assert data["refused_op_count"] == refused["ops"]
    assert data["boundaries_per_step"] == 1  # the refused graph runs as one eager segment
    text = report.format()
    assert "coverage: 0.0%" in text and "graphs left to eager PyTorch (1" in text and "complex128" in text
    with torch.no_grad():
        assert torch.equal(report.outputs, model(x))


def test_refused_graph_counts_against_the_captured_ones():
    """One refused graph (the complex-rope layers) and one captured graph (the head) after a break: the head's
    ops are in a region, the refused layers' ops are what keeps coverage below 1."""
    model = Model(head=True).eval()
    x = torch.randn(2, 64)
    report, _ = _explain(model, x)
    data = report.to_dict()
    (refused,) = data["refused_graphs"]
    assert data["graphs"] == 1 and data["ops_in_regions"] == data["op_count"] > 0
    # no captured op is in a decoder layer, the refused ones are: the layers' coverage is 0
    assert data["decoder_op_count"] == 0 and refused["decoder_ops"] > 0 and data["coverage"] == 0.0
    want_all = data["ops_in_regions"] / (data["op_count"] + refused["ops"])
    assert abs(data["coverage_all_ops"] - want_all) < 1e-6
    assert data["capture"]["refused"] == [refused]


def test_report_of_a_compiled_step_with_a_refused_graph():
    """The same through torch.compile with a kernel executor (coverage of what ran) and the session's report."""
    model = Model().eval()
    torch._dynamo.reset()
    step = torch.compile(model, backend="fusegraph", options={"executor": "nkisim", "cache_dir": "off"})
    x = torch.randn(2, 64)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        assert torch.equal(step(x), model(x))
    data = report_for_session(last_session()).to_dict()
    assert data["coverage"] == 0.0 and len(data["refused_graphs"]) == 1
