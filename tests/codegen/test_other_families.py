"""Decoder families beyond the three bundled ones, through the megakernel (not only matched): Qwen2 (q/k/v
biases), Gemma (offset norms, gelu_tanh, scaled embedding), Qwen2-MoE (shared expert with a sigmoid gate),
Mistral (sliding-window cache layers: their Python step counter becomes a runtime scalar after one recompile),
Phi-3 (fused QKV and gate_up projections read through feature slices: one projection per slice in the kernel),
StableLM (LayerNorm, partial rotary), GPT-NeoX (QKV fused per head), GLM and Cohere (interleaved RoPE), Gemma 3
(sliding and full attention layers), Gemma 2 (soft-capped attention scores and logits).
"""
import pytest
import torch

from fusegraph import FusegraphWarning
from fusegraph.capture.session import last_session
from fusegraph.models import greedy_decode

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "matching"))
from fg_cases import decodes_in_one_kernel, hf_case  # noqa: E402

FAMILIES = [
    ("Qwen2", "float32", {}),
    ("Gemma", "float32", {}),
    ("Qwen2Moe", "float32", dict(moe_intermediate_size=128, shared_expert_intermediate_size=256, num_experts=8,
                                 num_experts_per_tok=2)),
    ("Mistral", "float32", {}),
    ("Phi3", "float32", {}),  # fused qkv_proj / gate_up_proj, partial-rotary RoPE code
    ("Phi3", "float32", dict(partial_rotary_factor=0.5)),  # Phi-4-mini style: RoPE on part of each head
    ("StableLm", "float32", {}),  # LayerNorm with bias, partial rotary 0.25
    ("StableLm", "bfloat16", {}),
    ("GPTNeoX", "float32", {}),  # QKV fused per head (view, transpose, chunk), LayerNorm, parallel residual
    ("Glm", "float32", {}),  # interleaved partial rotary, cos/sin repeat_interleave'd inside attention
    ("Cohere", "float32", {}),  # interleaved RoPE in fp32, LayerNorm without bias, parallel attention + MLP
    ("Cohere", "bfloat16", {}),
    ("Gemma3", "float32", {}),  # text-only config, sliding and full attention layers, q/k norms with offset
    ("Gemma2", "float32", {}),  # attention scores and final logits soft-capped
]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])  # tie_word_embeddings (test_tied_embeddings.py)
@pytest.mark.parametrize("family,dtype,config", FAMILIES,
                         ids=[f[0] + "".join(f"-{k}={v}" for k, v in f[2].items() if k == "partial_rotary_factor")
                              + ("-bf16" if f[1] == "bfloat16" else "") for f in FAMILIES])
def test_family_runs_as_one_megakernel(family, dtype, config, tied):
    case = hf_case(family, dtype=dtype, tie_word_embeddings=tied, **config)
    assert (case.model.lm_head.weight is case.model.get_input_embeddings().weight) == tied
    decodes_in_one_kernel(case, dtype, steps=5)


def test_sliding_window_cache_past_its_capacity_equals_eager():
    """Once a sliding-window cache is full, transformers rolls it every step (another recompile: roll(-1), a write
    at [-1], copy_): the ``sliding_window_roll`` pattern keeps that version in the kernel too (``KVRoll``), with no
    warning; tokens and cache stay equal to eager across the switch."""
    import warnings

    case = hf_case("Mistral")  # max_cache_len 32, 8 prompt tokens: full after 24 steps
    ref = case.fork()
    step = torch.compile(case.step, backend="fusegraph", options={"executor": "nkisim", "cache_dir": "off"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusegraphWarning)
        toks_c, logits_c = greedy_decode(step, case.token, case.position, 27)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, 27)
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    for a, b in zip(logits_c, logits_e):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()
    for a, b in zip(case.cache_tensors(), ref.cache_tensors()):
        assert (a - b).abs().max().item() <= 1e-5
    session = last_session()
    assert len(session.superseded) == 2  # specialized first step; symbolic counter; full cache
    (earlier,) = session.superseded[1].program.execution.values()
    assert earlier.launches_per_call == 1 and earlier.calls >= 20
    (full,) = session.program.execution.values()  # the rolling version: one kernel, verified, nothing eager
    assert full.launches_per_call == 1 and full.calls >= 3, full.executed_by
    assert list(full.verification.values()) == ["passed"]
    (plan,) = full.run.plans
    assert "sliding-window KV cache" in plan.generated.source  # kv_roll.j2: the roll is in the kernel
    G = session.program.graph
    rolls = [n for n, d in G.nodes(data=True) if d.get("op") == "aten.roll.default"]
    assert rolls and set(rolls) <= set(plan.lowered.kernel_nodes)  # no roll left on the eager path
