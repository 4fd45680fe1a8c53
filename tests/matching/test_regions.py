"""Region formation: across graph breaks, and the knobs named after Torch-TensorRT's, with their decision log."""
import torch

from fusegraph import capture_step
from fusegraph.matching import analyze
from fusegraph.models import build_decode
from fusegraph.settings import Settings

from fg_cases import EAGER, BrokenMLP, analyzed, break_inside_mlp


def test_region_spans_glue_free_breaks():
    case = build_decode("llama-tiny")
    break_inside_mlp(case)
    cap = capture_step(case.step, case.token, case.position, options=EAGER)
    prog = cap.program
    assert len(prog.graphs) > 1 and prog.breaks
    a = analyze(prog)
    assert a.coverage >= 0.98, [u.to_dict() for u in a.unmatched]
    assert len(a.regions) == 1
    (r,) = a.regions
    assert r.kind == "decoder_stack" and r.layers == [0, 1] and len(r.graphs) == len(prog.graphs)
    spans = [d for d in a.decisions if d.action == "span_break"]
    assert spans and all("untouched by Python" in d.reason for d in spans)
    # tensors handed to the next graph are still materialized for Python: region outputs marked as crossing
    assert any(b.crosses_break for b in r.outputs)
    # the MLP's swiglu and down projection sit in different dynamo graphs, yet in one region
    down = [m for m in a.matches if m.module == "model.layers.0.mlp.down_proj"]
    swiglu = [m for m in a.matches_of("fusegraph.swiglu") if m.layer == 0]
    assert down and swiglu and down[0].graphs != swiglu[0].graphs


def test_python_glue_on_a_crossing_tensor_splits_regions():
    @torch._dynamo.disable
    def glue(h):
        h.mul_(1.0)  # Python computes on the crossing tensor: not glue-free

    x = torch.randn(1, 1, 64)
    spanned = analyze(capture_step(BrokenMLP(), x, options=EAGER).program)
    assert len(spanned.regions) == 1 and len(spanned.regions[0].graphs) == 2
    cap = capture_step(BrokenMLP(glue=glue), x, options=EAGER)
    a = analyze(cap.program, Settings(min_region_size=1))
    (link,) = [l for l in cap.program.links if not l.glue_free]
    assert len(a.regions) == 2 and all(len(r.graphs) == 1 for r in a.regions)
    refused = [d for d in a.decisions if d.action == "refuse_break"]
    assert refused and "not glue-free" in refused[0].reason and link.src_node in refused[0].nodes
    assert a.region_of[link.src_node] != a.region_of[next(iter(cap.program.graph.successors(link.dst_node)))]


def test_fallback_op_splits_the_stack_and_is_logged():
    _, cap, _ = analyzed("qwen3-moe-tiny", "eager", "batched_mm", "float32")
    a = analyze(cap.program, Settings(fallback_ops=("aten.topk",), generic_lowering=False))
    assert len(a.regions) >= 2
    assert not a.matches_of("fusegraph.moe_router")
    assert any(d.action == "fallback" and "topk" in d.reason for d in a.decisions)
    topk = [u for u in a.unmatched if u.op == "aten.topk.default"]
    assert topk and topk[0].count == 2 and topk[0].module == "model.layers.*.mlp.gate"
    assert a.boundaries_per_step > 2


def test_min_region_size_dissolves_small_regions():
    _, cap, _ = analyzed("qwen3-moe-tiny", "eager", "batched_mm", "float32")
    a = analyze(cap.program, Settings(fallback_ops=("aten.topk",), min_region_size=10_000, generic_lowering=False))
    assert not a.regions
    dis = [d for d in a.decisions if d.action == "dissolve"]
    assert dis and all("min_region_size=10000" in d.reason for d in dis)
    assert all("min_region_size" in u.reason for u in a.unmatched if u.op == "aten.mm.default")


def test_require_full_compilation():
    _, cap, full = analyzed("qwen3-moe-tiny", "eager", "batched_mm", "float32")
    ok = analyze(cap.program, Settings(require_full_compilation=True))
    assert len(ok.regions) == 1 and ok.coverage_all == 1.0
    a = analyze(cap.program, Settings(require_full_compilation=True, fallback_ops=("aten.topk",), generic_lowering=False))
    assert not a.regions
    (d,) = [d for d in a.decisions if d.action == "require_full"]
    assert "ops outside any region" in d.reason and "fallback path" in d.reason
    assert all("require_full_compilation" in u.reason for u in a.unmatched if u.op == "aten.mm.default")


def test_region_boundaries_and_bytes():
    case, cap, a = analyzed("qwen3-moe-tiny", "eager", "batched_mm", "float32")
    (r,) = a.regions
    weights = sum(p.numel() * p.element_size() for p in case.model.parameters())
    assert r.bytes_by_role()["weight"] == weights  # every weight streamed once per step
    assert len(r.state_writes) == 6  # keys, values, length counter per layer
    (out,) = r.outputs
    assert out.shape == (1, 1, case.model.config.vocab_size) and out.bytes == 4 * case.model.config.vocab_size
    assert r.glue and all(m.nodes <= r.nodes for m in r.matches)
    assert r.op_count == sum(1 for d in cap.program.graph.nodes.values() if d["kind"] == "op")
