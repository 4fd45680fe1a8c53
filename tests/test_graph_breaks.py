"""A step split by an explicit graph break is linked into one program with the break's reason."""
import types

import torch

from fusegraph import capture_step
from fusegraph.program import InputKind
from fusegraph.models import build_decode


def _break_inside_mlp(case):
    mlp = case.model.model.layers[0].mlp

    def forward(self, x):
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        torch._dynamo.graph_break()
        return self.down_proj(h)

    mlp.forward = types.MethodType(forward, mlp)


def test_break_inside_decoder_layer_is_linked_and_explained():
    case = build_decode("llama-tiny")
    ref = case.fork()
    _break_inside_mlp(case)
    cap = capture_step(case.step, case.token, case.position, options={"executor": "eager"})
    prog = cap.program
    assert len(prog.graphs) > 1
    assert any("graph_break" in b.reason for b in prog.breaks)
    assert all(b.user_frame for b in prog.breaks)
    # the MLP's intermediate crosses the break untouched by Python: a glue-free link
    h_links = [l for l in prog.links if prog.graph.nodes[l.src_node].get("op") == "aten.mul.Tensor"
               and prog.graph.nodes[l.src_node]["module"] == "model.layers.0.mlp"]
    assert h_links and all(l.glue_free for l in h_links)
    for l in prog.links:
        assert prog.graph.has_edge(l.src_node, l.dst_node)
        assert prog.graph.nodes[l.dst_node]["input_kind"] in (InputKind.LINKED, InputKind.STATE)
    summary = cap.summary()
    assert summary["breaks"] and summary["links"]
    assert "graph_break" in cap.format()
    with torch.no_grad():
        expected = ref.step(ref.token, ref.position)
    assert torch.equal(cap.outputs, expected)
    assert all(torch.equal(a, b) for a, b in zip(case.cache_tensors(), ref.cache_tensors()))


def test_python_glue_on_a_crossing_tensor_is_not_glue_free():
    @torch._dynamo.disable
    def glue(y):  # runs as plain Python between two graphs and mutates the crossing tensor
        y.add_(1)

    def f(x):
        y = x * 2
        z = x * 3
        glue(y)
        return y.sin() + z

    cap = capture_step(f, torch.ones(4), options={"executor": "eager"})
    assert torch.allclose(cap.outputs, (torch.ones(4) * 2 + 1).sin() + 3)
    by_src = {cap.program.graph.nodes[l.src_node]["consts"]: l for l in cap.program.links}
    assert by_src[(2,)].glue_free is False  # y: mutated by the glue
    assert by_src[(3,)].glue_free is True  # z: crossed untouched
