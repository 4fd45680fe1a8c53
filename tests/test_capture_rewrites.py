"""HF eager MoE experts: 11 graphs for 2 layers normally; the capture rewrite makes it 1, outputs unchanged."""
import torch

from fusegraph import capture_step
from fusegraph.capture.rewrites import apply_to_module, registered_rewrites, remove_from_module
from fusegraph.models import build_decode, greedy_decode


def test_eager_experts_break_without_fusegraph():
    case = build_decode("qwen3-moe-tiny", experts="eager")
    graphs = []
    with torch.no_grad():
        torch.compile(case.step, backend=lambda gm, ex: graphs.append(gm) or gm.forward)(case.token, case.position)
    assert len(graphs) >= 5  # 11 in transformers 5.24 (several per MoE layer)


def test_rewrite_removes_breaks_and_keeps_outputs():
    case = build_decode("qwen3-moe-tiny", experts="eager")
    ref = case.fork()
    cap = capture_step(case.step, case.token, case.position, options={"executor": "eager"})
    assert len(cap.program.graphs) == 1 and not cap.program.breaks
    ops = cap.program.op_counts()
    assert ops["aten.bmm.default"] >= 4 and "aten.nonzero.default" not in ops
    with torch.no_grad():
        expected = ref.step(ref.token, ref.position)
    # bit-identical here (top-2 routing, fp32), but the rewrite's bmm and the loop's per-expert linear are other BLAS
    # calls, which another CPU may round differently: to rounding
    torch.testing.assert_close(cap.outputs, expected, rtol=1e-5, atol=1e-6)
    compiled = cap.extra["compiled"]
    toks_c, logits_c = greedy_decode(compiled, case.token, case.position + 1, 8)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position + 1, 8)
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    assert max((a - b).abs().max().item() for a, b in zip(logits_c, logits_e)) == 0.0


def test_rewrite_can_be_switched_off():
    case = build_decode("qwen3-moe-tiny", experts="eager")
    cap = capture_step(case.step, case.token, case.position, options={"capture_rewrites": False, "executor": "eager"})
    assert len(cap.program.graphs) + len(cap.session.refusals) > 1


def test_explicit_instance_rewrite_is_exact_in_eager_mode():
    case = build_decode("qwen3-moe-tiny", experts="eager")
    ref = case.fork()
    done = apply_to_module(case.model)
    assert done == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    with torch.no_grad():
        a = case.step(case.token, case.position)
        b = ref.step(ref.token, ref.position)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # bmm vs per-expert linear: see the test above
    remove_from_module(case.model)
    assert not hasattr(case.model.model.layers[0].mlp.experts, "_fusegraph_rewrite")


def test_rewrite_is_registered_with_a_namespaced_name():
    assert "fusegraph.hf_eager_experts" in [r.name for r in registered_rewrites()]
