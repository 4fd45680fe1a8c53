"""Dynamically quantized models (``torch.ao.quantization.quantize_dynamic``): one graph, warnings that name the
quantized modules, results equal to eager PyTorch."""
import warnings

import pytest
import torch

from fusegraph.capture.quantized import CLASS_NAME, compact_paths
from fusegraph.capture.rewrites.quantized_linear import OP_NAME, module_of
from fusegraph.capture.session import last_session
from fusegraph.models import build_decode
from fusegraph.warnings import FusegraphWarning

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:.*quantize_per_tensor.*")


def _quantized_case(spec=None, dtype=torch.qint8):
    case = build_decode("llama-tiny")
    case.model = torch.ao.quantization.quantize_dynamic(case.model, spec or {torch.nn.Linear}, dtype=dtype)
    return case


def _run(case, options, steps=1):
    """Compile the decode step, run ``steps`` tokens next to an eager copy; return (fusegraph warnings, session)."""
    ref = case.fork()
    step = torch.compile(case.step, backend="fusegraph", options={"cache_dir": "off", **options})
    tok, pos = case.token, case.position
    msgs = []
    with torch.no_grad():
        for _ in range(steps):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = step(tok, pos)
            msgs += [str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)]
            expected = ref.step(tok, pos)
            assert (out - expected).abs().max().item() <= 1e-4 * expected.abs().max().item()
            tok, pos = expected[:, -1:].argmax(-1), pos + 1
    return msgs, last_session()


def test_int8_llama_is_one_graph_fused_around_the_quantized_linears():
    case = _quantized_case()
    msgs, session = _run(case, {"executor": "nkisim"}, steps=2)
    assert len(session.program.graphs) == 1 and not session.program.breaks  # was 12 graphs
    quantized = [m for m in msgs if CLASS_NAME in m]
    assert len(quantized) == 1, msgs  # once for the step, not once per graph or region
    assert quantized[0].startswith("fusegraph: model.layers.*.self_attn.q_proj, ")
    assert "lm_head" in quantized[0] and "15 dynamically quantized int8 Linear modules" in quantized[0]
    assert not [m for m in msgs if "spans a graph break" in m], msgs
    (stats,) = session.program.execution.values()
    assert "nkisim" in stats.executed_by.values()  # the norms and residual adds between them run as kernels
    # each op runs its own layer's module, even though dynamo may reuse one decoder-layer trace for the others
    G = session.program.graph
    by_path = {d["module"]: module_of(d["consts"][0]) for _, d in G.nodes(data=True) if d.get("op") == OP_NAME}
    modules = dict(case.model.named_modules())
    assert len(by_path) == 15 and all(modules[p] is m for p, m in by_path.items())


def test_one_fp16_module_named_by_its_path():
    case = _quantized_case({"model.layers.0.self_attn.q_proj"}, dtype=torch.float16)
    msgs, session = _run(case, {"executor": "eager"})
    assert len(session.program.graphs) == 1
    assert [m for m in msgs if CLASS_NAME in m] == [
        "fusegraph: model.layers.0.self_attn.q_proj: a dynamically quantized fp16 Linear "
        f"({CLASS_NAME}) is not fused; it runs in PyTorch, inside the same graph (no graph break)"]


def test_without_capture_rewrites_one_warning_names_the_cause():
    case = _quantized_case()
    msgs, session = _run(case, {"executor": "eager", "capture_rewrites": False})
    breaks = [m for m in msgs if CLASS_NAME in m]
    assert len(breaks) == 1 and "breaks the graph at every call" in breaks[0], msgs
    assert "capture_rewrites is off" in breaks[0]


def test_compact_paths_folds_layers():
    paths = ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj", "model.layers.3.self_attn.q_proj",
             "lm_head"]
    assert compact_paths(paths) == ["model.layers.*.mlp.up_proj", "model.layers.3.self_attn.q_proj", "lm_head"]
