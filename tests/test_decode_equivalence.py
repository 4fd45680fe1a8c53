"""Captured decode steps (eager executor) equal eager HF code (tiny Llama, Qwen3, Qwen3-MoE): capture is exact.

The NKI executor has its own end-to-end tests (tests/codegen/test_megakernel_e2e.py)."""
import pytest
import torch

from fusegraph.capture.session import last_session
from fusegraph.models import build_decode, greedy_decode

CASES = [
    ("llama-tiny", {}),
    ("qwen3-tiny", {}),
    ("qwen3-moe-tiny", {"experts": "batched_mm"}),
    ("qwen3-moe-tiny", {"experts": "grouped_mm"}),
]


def _run(name, attn, dtype="float32", steps=8, **kw):
    case = build_decode(name, attn=attn, dtype=dtype, **kw)
    ref = case.fork()
    compiled = torch.compile(case.step, backend="fusegraph", dynamic=False, options={"executor": "eager"})
    toks_c, logits_c = greedy_decode(compiled, case.token, case.position, steps)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, steps)
    # a recompile (or a split) would add graphs to the compile's session
    graphs = len(last_session().program.graphs)
    return case, ref, toks_c, logits_c, toks_e, logits_e, graphs


@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] + "-" + "-".join(c[1].values()) for c in CASES])
def test_eager_attention_is_bit_identical(name, kw):
    case, ref, toks_c, logits_c, toks_e, logits_e, graphs = _run(name, "eager", **kw)
    assert graphs == 1, "recompiled or split"
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    assert all(torch.equal(a, b) for a, b in zip(logits_c, logits_e))
    assert all(torch.equal(a, b) for a, b in zip(case.cache_tensors(), ref.cache_tensors()))


@pytest.mark.parametrize("name,kw", CASES[:3], ids=[c[0] for c in CASES[:3]])
def test_sdpa_attention_tokens_equal(name, kw):
    case, ref, toks_c, logits_c, toks_e, logits_e, graphs = _run(name, "sdpa", **kw)
    assert graphs == 1
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    for a, b in zip(logits_c, logits_e):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(case.cache_tensors(), ref.cache_tensors()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-moe-tiny"])
def test_bf16_eager_attention_bit_identical(name):
    case, ref, toks_c, logits_c, toks_e, logits_e, graphs = _run(name, "eager", dtype="bfloat16", steps=4)
    assert graphs == 1
    assert all(torch.equal(a, b) for a, b in zip(logits_c, logits_e))
    assert all(torch.equal(a, b) for a, b in zip(case.cache_tensors(), ref.cache_tensors()))
