"""The captured program: node metadata, input classes and in-place state writes, checked on real HF models."""
import networkx as nx
import pytest
import torch

from fusegraph import capture_step
from fusegraph.program import InputKind
from fusegraph.models import build_decode


@pytest.fixture(scope="module")
def qwen3_capture():
    torch._dynamo.reset()
    case = build_decode("qwen3-tiny")
    return case, capture_step(case.step, case.token, case.position, options={"executor": "eager"})


def test_nodes_carry_op_shape_dtype_module_and_layer(qwen3_capture):
    case, cap = qwen3_capture
    G = cap.program.graph
    mms = [d for _, d in G.nodes(data=True) if d["kind"] == "op" and d["op"] == "aten.mm.default"]
    q = [d for d in mms if d["module"] == "model.layers.1.self_attn.q_proj"]
    assert len(q) == 1
    assert q[0]["layer"] == 1 and q[0]["shape"] == (1, 256) and q[0]["dtype"] == "float32"
    assert q[0]["module_type"] == "Linear"
    lm = [d for d in mms if d["module"] == "lm_head"]
    assert lm and lm[0]["layer"] is None and lm[0]["shape"] == (1, 1000)
    eps = [d for _, d in G.nodes(data=True) if d.get("op") == "aten.add.Tensor" and d["module"] == "model.norm"]
    assert eps and case.model.config.rms_norm_eps in eps[0]["consts"]
    assert nx.is_directed_acyclic_graph(G)


def test_input_classes(qwen3_capture):
    case, cap = qwen3_capture
    prog = cap.program
    weights = prog.inputs(InputKind.WEIGHT)
    assert len(weights) == len(list(case.model.parameters()))
    names = {w.module for w in weights}
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    state = prog.inputs(InputKind.STATE)
    n_layers = case.model.config.num_hidden_layers
    assert len(state) == 3 * n_layers  # keys, values, cumulative_length per layer
    assert any(s.source.endswith("layers[0].keys") for s in state)
    assert [b.module for b in prog.inputs(InputKind.BUFFER)] == ["model.rotary_emb.inv_freq"]
    assert len(prog.inputs(InputKind.STEP)) == 2  # token, position


def test_kv_cache_write_is_in_place(qwen3_capture):
    _, cap = qwen3_capture
    G = cap.program.graph
    ops = cap.program.op_counts()
    assert ops["aten.index_copy_.default"] == 4 and "aten.index_copy.default" not in ops
    assert "aten.copy_.default" not in ops
    for state, writer in cap.program.graphs[0].state_writes.items():
        d = G.nodes[writer]
        assert d["writes_state"] == state
        # every reader of the old value runs before the write
        for reader in G.successors(state):
            if reader != writer and G.nodes[reader]["kind"] == "op":
                assert G.nodes[reader]["order"] < d["order"]
    # attention reads the *updated* cache: consumers of the write come after it
    w = next(n for n, d in G.nodes(data=True) if d.get("op") == "aten.index_copy_.default")
    assert all(G.nodes[s]["order"] > G.nodes[w]["order"] for s in G.successors(w))


def test_meta_device_capture_of_a_deeper_model():
    case = build_decode("qwen3-moe-tiny", device="meta", num_layers=6)
    cap = capture_step(case.step, case.token, case.position, options={"executor": "eager"})
    assert cap.program.layers() == list(range(6))
    assert cap.outputs.device.type == "meta" and cap.outputs.shape == (1, 1, 1000)


def test_step_returning_its_in_place_write_and_a_constant():
    """A graph that returns the state it wrote in place, and uses a constant it created, runs eagerly as captured."""
    cache = torch.zeros(4)

    def step(x):
        cache.index_copy_(0, torch.tensor([1]), x)
        return cache, x + torch.tensor([2.0])

    out = capture_step(step, torch.ones(1), options={"executor": "eager"}).outputs
    assert torch.equal(out[0], torch.tensor([0.0, 1.0, 0.0, 0.0])) and torch.equal(out[1], torch.tensor([3.0]))
