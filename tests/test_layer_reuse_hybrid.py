"""Layer reuse on hybrid caches (linear-attention / conv / SSM states next to attention: Falcon-H1, LFM2): only an
exact ``StaticLayer`` is replayed by the stand-in cache; every other HF cache layer type makes that layer trace as
without reuse. Before, Falcon-H1's ``LinearAttentionAndStaticFullAttentionLayer`` (a StaticLayer subclass) went
through the region, whose stand-in lacks ``get_conv_state``: 3 graphs and a recompile where a plain backend
compiles 1."""
import inspect
import warnings

import pytest
import torch
import transformers.cache_utils as cache_utils

from fusegraph.capture.rewrites import hf_layer_reuse
from fusegraph.capture.session import last_session
from fusegraph.capture.summary import summarize
from fusegraph.models import build_family_decode, greedy_decode

HYBRID = {
    "FalconH1": {},
    "Lfm2": {"layer_types": ["conv", "full_attention"]},
}


def _plain_graph_count(case) -> int:
    graphs = []
    compiled = torch.compile(case.step, backend=lambda gm, ex: graphs.append(gm) or gm.forward)
    greedy_decode(compiled, case.token, case.position, 2)
    return len(graphs)


@pytest.mark.parametrize("family", sorted(HYBRID))
def test_hybrid_cache_compiles_like_a_plain_backend(family):
    case = build_family_decode(family, **HYBRID[family])
    plain, ref = case.fork(), case.fork()
    assert {type(layer) for layer in case.cache.layers} != {cache_utils.StaticLayer}
    torch._dynamo.reset()
    compiled = torch.compile(case.step, backend="fusegraph", options={"executor": "eager", "cache_dir": "off"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = greedy_decode(compiled, case.token, case.position, 4)
    want = greedy_decode(ref.step, ref.token, ref.position, 4)
    msgs = [str(w.message) for w in caught if "fusegraph" in str(w.message)]
    assert not msgs, msgs
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))
    for a, b in zip(got[1], want[1]):
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()
    summary = summarize(last_session())
    assert summary["recompiles"] == 0
    assert len(summary["graphs"]) == _plain_graph_count(plain) == 1


def test_only_static_layer_is_replayed():
    """Every cache layer class transformers has: the stand-in replays StaticLayer and nothing else."""
    hf_layer_reuse._static_layer()  # resolves the targets
    layer_types = [c for _, c in inspect.getmembers(cache_utils, inspect.isclass)
                   if c.__module__ == cache_utils.__name__ and c.__name__.endswith("Layer")]
    assert len(layer_types) > 10
    replayed = [c for c in layer_types if hf_layer_reuse._replayed_layer_type(c, 0)]
    assert replayed == [cache_utils.StaticLayer]
