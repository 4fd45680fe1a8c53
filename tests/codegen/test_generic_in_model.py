"""A decoder variant no pattern covers (a quick-GELU MLP activation) stays one region through generic lowering,
runs as one megakernel, and equals eager."""
import torch

from fusegraph import explain
from fusegraph.capture.session import last_session
from fusegraph.models import build_decode, greedy_decode


class QuickGelu(torch.nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


def _custom_case():
    case = build_decode("llama-tiny")
    for layer in case.model.model.layers:
        layer.mlp.act_fn = QuickGelu()
    return case


def test_report_shows_the_region_staying_whole():
    case = _custom_case()
    rep = explain(case.step, case.token, case.position).to_dict()
    assert len(rep["regions"]) == 1 and rep["coverage"] == 1.0
    # the 1.702*x scale and the product with up_proj have no pattern: generic pieces, one pair per layer
    # (sigmoid(1.702 x) * x itself is a legitimate gated-activation match with act=sigmoid)
    assert rep["pattern_counts"].get("fusegraph.generic") == 2 * case.model.config.num_hidden_layers
    assert rep["unmatched"] == []


def test_generic_piece_runs_in_the_megakernel_and_matches_eager():
    case = _custom_case()
    ref = case.fork()
    step = torch.compile(case.step, backend="fusegraph", options={"executor": "nkisim", "cache_dir": "off"})
    toks_c, logits_c = greedy_decode(step, case.token, case.position, 6)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, 6)
    stats = last_session().program.newest_execution()
    assert stats.launches_per_call == 1 and list(stats.verification.values()) == ["passed"]
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    for a, b in zip(logits_c, logits_e):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()
