"""Regions across dynamo graph breaks run in kernels (issue 31, item 1: split, don't drop).

A break inside a decoder layer splits the step into several captured graphs. The matcher still finds regions across
the glue-free ones; fusegraph runs each graph by itself, so such a region is cut at the break and each graph's part
is its own kernel (the crossing hidden state goes through HBM). Before, the whole region ran eagerly. Checked on
Llama and Qwen3-MoE tiny with three kinds of break a user's code makes: an explicit ``graph_break()``, a ``print``
and an ``.item()`` on a non-state tensor, each in layer 0 before its attention output projection.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from fusegraph.capture.session import last_session
from fusegraph.models import build_decode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "matching"))
from fg_cases import decode_beside_eager  # noqa: E402


def _explicit(x):
    torch._dynamo.graph_break()


def _print(x):
    print("o_proj input", tuple(x.shape))


def _item(x):
    if x.abs().amax().item() > 1e30:  # data-dependent Python on a non-state tensor
        raise RuntimeError("overflow")


BREAKS = {"graph_break": _explicit, "print": _print, "item": _item}


def _break_before_o_proj(case, glue) -> None:
    """Layer 0's attention output projection runs ``glue`` (a graph break) on its input first."""
    o_proj = case.model.model.layers[0].self_attn.o_proj
    inner = o_proj.forward

    def forward(x):
        glue(x)
        return inner(x)

    o_proj.forward = forward


CASES = [pytest.param(k, m, marks=() if (k, m) in {("graph_break", "llama-tiny"), ("item", "qwen3-moe-tiny")}
                      else pytest.mark.slow) for m in ("llama-tiny", "qwen3-moe-tiny") for k in sorted(BREAKS)]


@pytest.mark.parametrize("kind,model", CASES)
def test_region_across_a_break_runs_as_one_kernel_per_graph(model, kind):
    case = build_decode(model)
    _break_before_o_proj(case, BREAKS[kind])
    toks_c, logits_c, toks_e, logits_e, msgs = decode_beside_eager(case, 5)
    assert not [m for m in msgs if "eager path" in m or "graph break" in m], msgs
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    for a, b in zip(logits_c, logits_e):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()
    session = last_session()
    program = session.program
    assert program.breaks and len(program.graphs) > 1
    records = program.execution
    analysis = records[max(records)].run.analysis  # the last graph's compile sees the whole step
    spanning = [r for r in analysis.regions if len(r.graphs) > 1]
    assert spanning, "no region spans the break: the test would not exercise the cut"
    # every graph the spanning region has decoder ops in runs its part as one verified kernel
    for g in {g for r in spanning for g in r.graphs}:
        rec = records[g]
        assert rec.launches_per_call <= 1
    launches = sum(rec.launches_per_call for rec in records.values())
    kernels = [g for g, rec in records.items() if rec.launches_per_call]
    assert launches == len(kernels) >= 2
    assert all(v == "passed" for rec in records.values() for v in rec.verification.values())
    assert all(e == "nkisim" for rec in records.values() for e in rec.executed_by.values())


def test_a_break_in_every_layer_keeps_every_graph_in_one_step():
    """The frame dynamo resumes after a break inside the attention is compiled once per layer in the same step (its
    guards name the layer: ``self.layer_idx == 0``); the capture session used to take that for a recompile of a
    later step and drop layer 0's graphs (a new version). A step is a run of its first graph, so graphs compiled
    before it runs again are parts of the same step: every layer's graphs stay, each runs its kernel."""
    case = build_decode("llama-tiny")
    for layer in case.model.model.layers:
        o_proj = layer.self_attn.o_proj
        inner = o_proj.forward
        o_proj.forward = (lambda f: (lambda x: (_explicit(x), f(x))[1]))(inner)
    toks_c, _, toks_e, _, msgs = decode_beside_eager(case, 5)
    assert not [m for m in msgs if "eager path" in m], msgs
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    session = last_session()
    program = session.program
    assert not session.superseded and len(program.breaks) == 3  # one per layer, plus the resumed caller's
    layers = {d.get("layer") for _, d in program.graph.nodes(data=True) if d.get("kind") == "op"}
    assert {0, 1} <= layers
    records = program.execution
    assert sum(rec.launches_per_call for rec in records.values()) >= 4
    assert all(v == "passed" for rec in records.values() for v in rec.verification.values())
