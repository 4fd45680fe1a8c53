"""FUSEGRAPH_MATCH_DEBUG: why a pattern did not match a node (first failing node/edge/check)."""
import logging

import torch

from fusegraph import capture_step
from fusegraph.matching import analyze
from fusegraph.settings import Settings

from fg_cases import EAGER


class SqrtNorm(torch.nn.Module):
    """RMSNorm written with ``x / sqrt(var)``: same math, other ops, so the rsqrt pattern does not match."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(32))

    def forward(self, x):
        h = x.float()
        var = h.pow(2).mean(-1, keepdim=True) + 1e-6
        return self.weight * (h / torch.sqrt(var)).to(x.dtype)


def test_debug_by_pattern_names_the_failing_node(monkeypatch, caplog):
    monkeypatch.setenv("FUSEGRAPH_MATCH_DEBUG", "fusegraph.rmsnorm")
    cap = capture_step(SqrtNorm(), torch.randn(2, 32), options=EAGER)
    settings = Settings.from_options(EAGER)
    assert settings.match_debug == "fusegraph.rmsnorm"
    with caplog.at_level(logging.WARNING, logger="fusegraph.matching.debug"):
        a = analyze(cap.program, settings)
    assert not a.matches_of("fusegraph.rmsnorm")
    G = cap.program.graph
    add = next(n for n, d in G.nodes(data=True) if d.get("op") == "aten.add.Tensor")
    text = "\n".join(a.debug)
    # anchored at the final multiply, the walk gets through mul/add/mean/pow and fails where sqrt+div replace rsqrt+mul
    assert "fails at" in text and ("aten.div.Tensor" in text or "aten.sqrt.default" in text), text
    assert any(r.message.startswith("FUSEGRAPH_MATCH_DEBUG") for r in caplog.records)
    # explain() by node id gives the same kind of answer for one node
    lines = a.explain(add)
    assert any("fusegraph.rmsnorm" in line and "fails at" in line for line in lines), lines


def test_debug_reports_refusals_with_reason():
    class Offset(SqrtNorm):
        def forward(self, x):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return (1.0 + self.weight) * h

    cap = capture_step(Offset(), torch.randn(2, 32), options=EAGER)
    a = analyze(cap.program, Settings(match_debug="fusegraph.rmsnorm", generic_lowering=False))
    text = "\n".join(a.debug)
    assert "refused" in text and "must be a weight" in text, text
