"""The fused-region report: Python API, JSON after a compile, dry run, CLI, and the documented schema."""
import json
import logging
import os
import pathlib
import re
import sys

import pytest
import torch

import fusegraph
from fusegraph.cli import main
from fusegraph.models import build_decode
from fusegraph.report import SCHEMA, Report

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "matching"))
from fg_cases import BrokenMLP  # noqa: E402  (the shared gated MLP with a graph break)

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(scope="module")
def moe_report():
    torch._dynamo.reset()
    case = build_decode("qwen3-moe-tiny", attn="sdpa", experts="grouped_mm", dtype="bfloat16")
    return case, fusegraph.explain(case.step, case.token, case.position)


def test_explain_returns_the_report(moe_report):
    case, report = moe_report
    assert isinstance(report, Report)
    d = report.to_dict()
    assert d["schema"] == SCHEMA
    assert 0.98 <= d["coverage"] <= 1.0 and isinstance(d["boundaries_per_step"], int)
    assert isinstance(d["regions"], list) and isinstance(d["unmatched"], list) and isinstance(d["breaks"], list)
    (r,) = d["regions"]
    assert r["kind"] == "decoder_stack" and r["layers"] == [0, 1]
    assert d["boundaries_per_step"] == 1 and d["unmatched"] == [] and d["breaks"] == []
    assert r["glue"] and r["glue_not_layout_preserving"] == []  # decode (S=1): every absorbed transpose/view keeps memory order
    assert d["pattern_counts_per_layer"]["0"]["fusegraph.rmsnorm"] == 4
    assert r["bytes_in_by_role"]["weight"] == sum(p.numel() * p.element_size() for p in case.model.parameters())
    json.loads(report.to_json())  # JSON-clean
    assert report.outputs.shape == (1, 1, case.model.config.vocab_size)  # the dry run still ran the step
    text = report.format()
    for piece in ("fused-region report", "coverage: 100.0%", "decoder_stack", "patterns matched per layer",
                  "unmatched ops: none", "graph breaks: none"):
        assert piece in text, piece


def test_report_option_writes_the_same_report(tmp_path, moe_report):
    _, explained = moe_report
    case = build_decode("qwen3-moe-tiny", attn="sdpa", experts="grouped_mm", dtype="bfloat16")
    path = tmp_path / "r.json"
    f = torch.compile(case.step, backend="fusegraph", options={"report": str(path), "executor": "eager"})
    with torch.no_grad():
        f(case.token, case.position)
    written = json.loads(path.read_text())
    a = explained.to_dict()
    for key in ("coverage", "coverage_by_layer", "pattern_counts", "pattern_counts_per_layer", "boundaries_per_step",
                "op_count", "layers"):
        assert written[key] == a[key], key
    assert [r["op_count"] for r in written["regions"]] == [r["op_count"] for r in a["regions"]]
    assert written["capture"]["graph_count"] == 1


def test_dryrun_logs_the_table_and_runs_eagerly(caplog):
    lin = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
    x = torch.randn(2, 16)
    with caplog.at_level(logging.INFO, logger="fusegraph.pipeline"):
        with torch.no_grad():
            out = torch.compile(lin, backend="fusegraph", options={"dryrun": True})(x)
    assert torch.allclose(out, lin(x))
    assert any("fused-region report" in r.getMessage() for r in caplog.records)


def test_breaks_and_their_cost_are_reported():
    x = torch.randn(1, 1, 64)
    d = fusegraph.explain(BrokenMLP(), x).to_dict()
    (b,) = d["breaks"]
    assert b["glue_free"] and b["spanned_by_regions"] == [0] and b["extra_boundaries"] == 1
    assert b["crossing_tensors"] == 1 and b["crossing_bytes"] == 4 * 128  # h (x reaches graph 1 as the frame argument)
    assert "graph_break" in b["reason"] and b["user_frame"]
    assert len(d["regions"]) == 1 and d["regions"][0]["graphs"] == [0, 1] and d["boundaries_per_step"] == 2
    assert any(o["crosses_break"] for o in d["regions"][0]["outputs"])

    @torch._dynamo.disable
    def glue(h):
        h.add_(1.0)

    d = fusegraph.explain(BrokenMLP(glue=glue), x, options={"min_region_size": 1}).to_dict()
    (b,) = d["breaks"]
    assert not b["glue_free"] and b["spanned_by_regions"] == [] and b["extra_boundaries"] == 1
    assert b["hbm_round_trip_bytes"] == b["crossing_bytes"] > 0
    assert d["boundaries_per_step"] == 2
    assert "Python glue computes on them" in fusegraph.explain(BrokenMLP(glue=glue), x).format()


def test_unmatched_ops_are_grouped_with_reasons():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(32, 32)

        def forward(self, x):
            return torch.erf(self.proj(x)) * 2

    d = fusegraph.explain(Model(), torch.randn(2, 32), options={"min_region_size": 1, "generic_lowering": False}).to_dict()
    by_op = {u["op"]: u for u in d["unmatched"]}
    assert "no registered pattern contains aten.erf.default" in by_op["aten.erf.default"]["reason"]
    assert by_op["aten.erf.default"]["count"] == 1
    assert d["boundaries_per_step"] == 2  # the linear's region + the fallback segment
    assert d["pattern_counts"] == {"fusegraph.linear": 1}


def test_cli_report_prints_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["report", "--model", "qwen3-moe-tiny", "--option", "executor=eager", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "captured 1 graph(s)" in text and "fused-region report" in text and "coverage: 100.0%" in text
    data = json.loads(out.read_text())
    assert data["schema"] == SCHEMA and data["coverage"] == 1.0 and data["check"]["kv_cache_equal"] is True


def _documented(section: str) -> set[str]:
    return set(re.findall(r"^\| `([a-z_]+)`", section, re.M))


def test_schema_is_documented(moe_report):
    _, report = moe_report
    d = report.to_dict()
    doc = (DOCS / "report.md").read_text()
    top, rest = doc.split("\nRegion:\n", 1)
    region_doc = rest.split("\nBoundary:", 1)[0]
    assert set(d) - {"capture"} <= _documented(top) and "capture" in _documented(top)
    assert set(d["regions"][0]) <= _documented(region_doc) | {"bytes_in", "bytes_out"}
    for key in d["regions"][0]["inputs"][0]:
        assert f"`{key}`" in doc
    for key in ("op", "count", "module", "reason", "layers", "nodes"):
        assert f"`{key}`" in doc
    for action in {x["action"] for x in d["decisions"]}:
        assert f"`{action}`" in doc


@pytest.mark.parametrize("fails", [False, True])
def test_report_counts_what_ran_not_what_matched(tmp_path, monkeypatch, fails):
    """A region whose kernel verification failed ran eagerly: the report's coverage and boundaries say so (the
    matched figures stay available as coverage_matched / boundaries_per_step_matched)."""
    from fusegraph.executors import verify

    if fails:
        monkeypatch.setattr(verify, "compare", lambda what, got, expected, settings: [f"{what}: forced mismatch"])
    case = build_decode("llama-tiny")
    path = tmp_path / "r.json"
    f = torch.compile(case.step, backend="fusegraph", dynamic=False,
                      options={"executor": "nkisim", "cache_dir": "off", "report": str(path)})
    with torch.no_grad():
        f(case.token, case.position)
        f(case.token, case.position + 1)
    from fusegraph.capture.session import last_session
    from fusegraph.report import report_for_session

    d = report_for_session(last_session()).to_dict()  # after the calls: what ran
    assert d["coverage_basis"] == "executed" and d["coverage_matched"] == 1.0
    assert d["boundaries_per_step_matched"] == 1
    (r,) = d["regions"]
    if fails:
        assert r["executed_by"] == "eager" and "forced mismatch" in r["verification"]
        assert d["coverage"] == 0.0 and d["kernel_launches_per_step"] == 0
        assert d["boundaries_per_step"] == d["eager_segments"] >= 1
    else:
        assert r["executed_by"] == "nkisim" and d["coverage"] == 1.0
        assert d["boundaries_per_step"] == 1 and d["eager_segments"] == 0
