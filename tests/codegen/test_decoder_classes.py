"""One representative transformers family per class of decoder the bundled patterns do not cover (issue 27), tiny,
random weights (``fusegraph.models.families.build_case``: the family sweep's own builder): each runs as one kernel
per step with every op in it, verified on its first call, and gives eager's tokens.

* DeepSeek-V3: MLA attention (q/kv low-rank projections, ``kv_b_proj`` over the cached positions, q/k with their
  own head sizes) and a sigmoid router with a correction bias and group-limited top-k (no router pattern: the
  experts read its choices through ``Lowerer.routing``).
* LFM2: a short-convolution layer (a rolling state written with ``copy_``, a depthwise ``convolution``) beside
  attention layers.
* Qwen3-Next: gated-delta-rule linear attention (a recurrent state, not a KV cache) beside full attention, and MoE.
* GPT-OSS: experts through HF's grouped-MoE path with its own hooks (weights stored ``[E, in, out]``, biases, a
  clamped interleaved SwiGLU: no experts pattern), attention with sinks, a top-k -> softmax router: the grouped
  matmul, ``histc`` and the sort / gathers around them run on the tensor path (``codegen/tensor/grouped.py``).
* Bloom: a fused QKV projection interleaved by head (a ``select`` per q/k/v, then a transpose, read by the KV-cache
  and attention patterns: region glue the tensor path copies) and ALiBi scores (``baddbmm`` with alpha).
* GPT-J: partial rotary (the rotated part concatenated with an empty pass-through slice: that ``cat`` is its one
  non-empty operand).
* Inkling: a cache layer that reads its length counter after advancing it (``q_offset``): the cache_position
  match outputs the advanced counter, so the region stays whole.
* Gemma-3: two rotary tables (sliding layers rotate with their own base frequency): each layer's RoPE reads its
  own table (keyed by layout alone, every layer read the first one loaded and verification failed).
* Cohere2-MoE: a step with host arithmetic on Python numbers (``_operator.add`` of a size) outside every region:
  the report files it as host arithmetic, not as an op left to eager (``eager_segments`` stays 0).
* Gemma-3 (the multimodal class, text only): ``input_ids.clone()`` edited in place (image tokens) and read only by
  the kernel: the copy joins the kernel's region instead of running as an eager launch nothing else reads; the
  symbolic-size arithmetic of its recompiled graph is host arithmetic even where a generic host piece claimed it.
* Nemotron: LayerNorm scaled by ``weight + 1`` (``fusegraph.layernorm_offset``).
* Apertus: the xIELU activation (``expm1``, on the tensor path as ``exp(x) - 1``).
* xLSTM: recurrent state read as an activation and written in place (the running max, loaded from its own state
  argument), ``var`` in its multi-head norm, and ``cache.seqlen_offset += 1``: an int64 counter nothing in the step
  reads, incremented in place in the kernel (its own unit, merged into the region it is independent of; the
  interpreter's int32 copy written back).
* Inkling-2: an empty ``new_zeros`` operand of a ``cat`` that an op outside the kernel also reads (made there as an
  empty tensor instead of costing the kernel), L2 norms (``linalg_vector_norm``) and a short convolution whose
  window is ``flip``-ped.

The whole sweep over every ``*ForCausalLM`` class is ``benchmarks/bench_families.py`` (slow test
``tests/test_family_sweep.py``).
"""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from fusegraph.capture.session import last_session
from fusegraph.models.families import build_case
from fusegraph.report import report_for_session

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "matching"))
from fg_cases import decode_beside_eager  # noqa: E402

STEPS = 3


@pytest.mark.parametrize("family", ["DeepseekV3", "Lfm2", "Qwen3Next", "GptOss", "Cohere2Moe", "Bloom", "GPTJ",
                                    "Inkling", "Gemma3", "Gemma3ForConditionalGeneration", "Nemotron", "Apertus",
                                    "xLSTM", "Inkling2"])
def test_family_runs_as_one_kernel_with_every_op(family):
    toks_c, logits_c, toks_e, logits_e, msgs = decode_beside_eager(build_case(family), STEPS)
    session = last_session()
    stats = session.program.newest_execution()
    assert stats.launches_per_call == 1, msgs
    assert list(stats.verification.values()) == ["passed"]
    report = report_for_session(session)
    # every op in the kernel, but for views (metadata, no launch) of a value that leaves the step (Inkling-2
    # returns a view of an input)
    outside = [u for u in report.data["unmatched"] if not u["reason"].startswith("host arithmetic")
               and not re.match(r"no-op \(aten\.(view|_unsafe_view|alias)", u["reason"])]
    assert report.coverage == 1.0 or not outside, outside
    assert report.data.get("eager_segments") == 0, report.data.get("unmatched")
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    for a, b in zip(logits_c, logits_e):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()
    # nothing fell back: the only warnings allowed say a pattern's lowering gave its ops to generic lowering
    eager = [m for m in msgs if "through generic lowering" not in m]
    assert eager == []
    assert report_for_session(session).to_dict().get("eager_segments", 0) == 0


def test_split_glue_over_a_kernel_value_stays_in_the_kernel():
    """HunYuan-V4's sparse-attention indexer splits its normed key (``k_pass, k_rot = torch.split(k, ...)``) before
    the rope and a cache write that run on the tensor path: the split and its ``getitem`` are region glue over a
    kernel value (views here), not values read from outside -- before, the kernel took them as inputs, the eager
    path computed them between the kernel's ops and the region was not convex (0 launches, coverage 0). The
    indexer's top-k over cache positions sees ties, so its guard recomputes such steps eagerly (the tokens stay
    eager's)."""
    toks_c, _, toks_e, _, msgs = decode_beside_eager(build_case("HYV4"), STEPS)
    assert not [m for m in msgs if "not convex" in m or "eager path" in m and "tied values" not in m], msgs
    session = last_session()
    assert session.program.newest_execution().launches_per_call == 1
    report = report_for_session(session)
    assert report.coverage == 1.0
    assert report.data.get("eager_segments") == 0, report.data.get("unmatched")
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
