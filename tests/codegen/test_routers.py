"""MoE experts consume the routing of any router the kernel computes (issue 27: routers and experts decoupled).

A router no pattern knows -- DeepSeek-V3's sigmoid scores with a correction bias, top-k on the biased scores,
the unbiased scores gathered and renormalized -- runs on the tensor path (sigmoid, add, topk, gather, sum,
divide); the experts pattern reads its top-k weights and expert ids through ``Lowerer.routing`` (token-major
ROUTING tiles loaded from the tensor path's buffers) instead of requiring the softmax -> top-k router pattern.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fusegraph.capture.session import last_session
from fusegraph.codegen.io import LoadRouting
from fusegraph.models import build_decode, greedy_decode
from fusegraph.report import report_for_session


class SigmoidRouter(torch.nn.Module):
    """DeepSeek-V3's router form (without expert groups): choose by ``sigmoid(logits) + bias``, weight by the
    unbiased scores of the chosen experts, renormalized."""

    def __init__(self, gate: torch.nn.Module) -> None:
        super().__init__()
        self.weight = gate.weight
        self.top_k = gate.top_k
        g = torch.Generator().manual_seed(1)
        self.register_buffer("bias", torch.randn(self.weight.shape[0], generator=g) * 0.05)
        self.hidden_dim = gate.hidden_dim

    def forward(self, hidden_states: torch.Tensor):
        h = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(h, self.weight)
        scores = logits.sigmoid()
        _, idx = torch.topk(scores + self.bias, self.top_k, dim=-1)
        w = scores.gather(-1, idx)
        w = w / w.sum(dim=-1, keepdim=True)
        return logits, w.to(logits.dtype), idx


def _case():
    case = build_decode("qwen3-moe-tiny")
    for layer in case.model.model.layers:
        layer.mlp.gate = SigmoidRouter(layer.mlp.gate)
    return case


def test_a_sigmoid_router_drives_the_experts_in_one_kernel():
    case = _case()
    ref = case.fork()
    step = torch.compile(case.step, backend="fusegraph", options={"executor": "nkisim", "cache_dir": "off"})
    toks_c, logits_c = greedy_decode(step, case.token, case.position, 4)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, 4)
    session = last_session()
    stats = session.program.newest_execution()
    assert stats.launches_per_call == 1 and list(stats.verification.values()) == ["passed"]
    assert report_for_session(session).coverage == 1.0
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    for a, b in zip(logits_c, logits_e):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()
    (plan,) = stats.run.plans
    instructions = plan.lowered.program.instructions
    # the experts read their choices from the generic router: two routing loads (weights, ids) per MoE layer
    loads = [i for i in instructions if isinstance(i, LoadRouting)]
    assert len(loads) == 2 * case.model.config.num_hidden_layers
    assert any(getattr(i, "op", None) == "aten.topk.default" for i in instructions)
    assert not any(i.opcode == "router" for i in instructions)
