"""``torch.compile(..., dynamic=True)`` on an HF decode step: a clean fallback, not a crash (issue 11, item 4).

Under ``dynamic=True`` dynamo gives the StaticCache tensors a symbolic length (``max_cache_len`` becomes a
symbolic int). Layer reuse (a nested compile region per decoder layer) crashed dynamo there (``KeyError: 2`` in
``stamp_out_subgraph``); it now turns itself off for such a layer (debug log only: reuse just saves tracing
time), and the checks refuse the symbolic shapes with their one warning, so the step runs eagerly.
"""
import logging
import warnings

import pytest
import torch

from fusegraph import FusegraphWarning
from fusegraph.capture.rewrites.hf_layer_reuse import _symbolic_shapes
from fusegraph.capture.session import last_session
from fusegraph.capture.summary import summarize
from fusegraph.models import build_decode, greedy_decode


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-moe-tiny"])
def test_dynamic_true_decode_runs_eagerly_with_one_warning(name, caplog):
    case = build_decode(name)
    ref = case.fork()
    compiled = torch.compile(case.step, backend="fusegraph", dynamic=True,
                             options={"executor": "nkisim", "cache_dir": "off"})
    with warnings.catch_warnings(record=True) as caught, \
            caplog.at_level(logging.DEBUG, logger="fusegraph.capture.rewrites.hf_layer_reuse"):
        warnings.simplefilter("always")
        toks_c, logits_c = greedy_decode(compiled, case.token, case.position, 4)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, 4)
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    assert all(torch.equal(a, b) for a, b in zip(logits_c, logits_e))
    assert all(torch.equal(a, b) for a, b in zip(case.cache_tensors(), ref.cache_tensors()))
    ours = [str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)]
    assert len(ours) == 1 and "dynamic shapes are not supported" in ours[0] and "running it eagerly" in ours[0], ours
    # reuse turned itself off (a debug note per layer), so dynamo traced the layers as without reuse_layer_traces
    assert any("layer reuse off" in r.getMessage() and "dynamic shapes" in r.getMessage() for r in caplog.records)
    assert summarize(last_session())["layer_calls_reusing_traces"] == {"calls": 0, "traced": 0}


def test_layer_reuse_still_applies_with_static_shapes():
    """The dynamic-shape switch must not turn reuse off for an ordinary (dynamic=False) compile."""
    case = build_decode("llama-tiny")
    ref = case.fork()
    compiled = torch.compile(case.step, backend="fusegraph", dynamic=False, options={"executor": "eager"})
    with torch.no_grad():
        assert torch.equal(compiled(case.token, case.position), ref.step(ref.token, ref.position))
    layers = case.model.config.num_hidden_layers
    assert summarize(last_session())["layer_calls_reusing_traces"] == {"calls": layers, "traced": 1}


@pytest.mark.parametrize("dynamic", [True, False])
def test_symbolic_shape_probe_is_a_trace_time_constant(dynamic):
    """Dynamo shows a SymInt as an int to traced code; the probe must still see it (and not at run time)."""
    def f(x):
        return x + 1 if _symbolic_shapes(x, 3, None) else x - 1

    out = torch.compile(f, backend="eager", dynamic=dynamic)(torch.zeros(3, 4))
    assert torch.equal(out, torch.full((3, 4), 1.0 if dynamic else -1.0))
    assert not _symbolic_shapes(torch.zeros(3, 4))  # eager: sizes are ints
