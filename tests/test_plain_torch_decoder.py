"""A plain PyTorch decoder, no transformers (issue 27): ``fusegraph.models.gptfast``, a gpt-fast style ``model.py``
(``KVCache`` buffers written by ``k_out[:, :, input_pos] = k_val``, hand-written RMSNorm, a ``freqs_cis`` table of
real (cos, sin) pairs, a causal-mask buffer indexed by ``input_pos``, ``F.scaled_dot_product_attention`` after
``repeat_interleave`` of k/v, SwiGLU, fused ``wqkv``), compiled with ``backend="fusegraph"``.

Each decode step is one kernel launch with every op in it (coverage 1.0), verified on its first call; the next
steps return what the kernel computed: tokens equal to eager on a separate copy of the model, logits within 1e-4
of eager's scale, the KV cache buffers equal within fp32 rounding, and no fusegraph warning (nothing fell back).
"""
from __future__ import annotations

import warnings

import pytest
import torch

from fusegraph import FusegraphWarning
from fusegraph.capture.session import last_session
from fusegraph.models import greedy_decode, gptfast
from fusegraph.report import report_for_session

STEPS = 6  # the first (verified against eager) call, then 5 steps computed by the kernel alone


def _decode_and_check(case: gptfast.PlainDecodeCase) -> None:
    ref = case.fork()
    written_before = [t.clone() for t in case.cache_tensors()]
    step = torch.compile(case.step, backend="fusegraph", options={"executor": "nkisim", "cache_dir": "off"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        toks_c, logits_c = greedy_decode(step, case.token, case.position, STEPS)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, STEPS)
    fg_warnings = [str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)]
    assert fg_warnings == []

    session = last_session()
    assert len(session.program.graphs) == 1  # one graph, no recompile
    record = session.program.newest_execution()
    assert record.calls == STEPS
    assert record.launches_per_call == 1
    assert list(record.verification.values()) == ["passed"]
    assert all(r.runs_kernel and not r.guard_reruns and not r.failed_calls for r in record.regions)
    assert report_for_session(session).coverage == 1.0

    assert len({int(t.sum()) for t in toks_e}) > 1  # the decode is not stuck on one token
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e)), (toks_c, toks_e)
    for a, b in zip(logits_c, logits_e):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()
    for before, a, b in zip(written_before, case.cache_tensors(), ref.cache_tensors()):
        assert not torch.equal(a, before)  # the kernel wrote this step's keys and values
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()


@pytest.mark.parametrize("tied,batch", [(False, 1), (True, 2)], ids=["untied-b1", "tied-b2"])
def test_plain_decoder_is_one_kernel(tied, batch):
    _decode_and_check(gptfast.build(tied=tied, batch=batch))


@pytest.mark.slow
@pytest.mark.parametrize("tied,batch,fused_qkv", [(True, 1, True), (False, 2, True), (False, 1, False)],
                         ids=["tied-b1", "untied-b2", "separate-qkv"])
def test_plain_decoder_variants(tied, batch, fused_qkv):
    _decode_and_check(gptfast.build(tied=tied, batch=batch, fused_qkv=fused_qkv))


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
def test_plain_decoder_bf16(batch):
    """bf16 weights and caches (gpt-fast's usual dtype; RMSNorm in fp32, rope in fp32 from a bf16 table): one
    kernel, every op in it, tokens equal, logits and caches within the documented bf16 bounds (docs/codegen.md,
    tests/codegen/test_megakernel_e2e.py)."""
    case = gptfast.build(batch=batch, dtype=torch.bfloat16)
    ref = case.fork()
    step = torch.compile(case.step, backend="fusegraph", options={"executor": "nkisim", "cache_dir": "off"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        toks_c, logits_c = greedy_decode(step, case.token, case.position, STEPS)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, STEPS)
    assert [str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)] == []
    session = last_session()
    assert session.program.newest_execution().launches_per_call == 1
    assert report_for_session(session).coverage == 1.0
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    rel = sorted((a.float() - b.float()).abs().max().item() / b.float().abs().max().item()
                 for a, b in zip(logits_c, logits_e))
    assert rel[len(rel) // 2] <= 2 ** -6 and rel[-1] <= 0.125
    for a, b in zip(case.cache_tensors(), ref.cache_tensors()):
        assert (a.float() - b.float()).abs().max().item() <= 2 ** -5 * b.float().abs().max().item()


def test_shared_mask_and_default_scale_match_decode_attention():
    """What the plain decoder needed from matching: SDPA without ``scale=`` (PyTorch's 1/sqrt(D)) and one
    ``[1, 1, 1, L]`` boolean mask row for a batch of 2 are the decode-attention pattern, with the default scale."""
    from fusegraph import capture_step
    from fusegraph.matching import analyze

    case = gptfast.build(batch=2)
    cap = capture_step(case.step, case.token, case.position, options={"executor": "eager", "cache_dir": "off"})
    a = analyze(cap.program)
    attn = a.matches_of("fusegraph.decode_attention")
    assert len(attn) == 2
    assert all(m.variant.startswith("sdpa_shared_mask") for m in attn), [m.variant for m in attn]
    assert all(m.params["scale"] == 64 ** -0.5 for m in attn)
    assert a.coverage == 1.0 and len(a.regions) == 1


def test_model_decode_equals_a_full_forward():
    """The model itself is sound: one token at a time through the KV cache gives the logits of one forward over
    the whole sequence (so the eager reference the kernel is compared with is a correct decoder)."""
    case = gptfast.build(batch=2, prompt_len=4, max_seq_length=16)
    full = case.fork()
    toks, logits = greedy_decode(case.step, case.token, case.position, 4)
    seq = torch.cat([case.options["prompt"], *toks], dim=1)
    with torch.no_grad():
        out = full.model(seq, torch.arange(seq.shape[1]))
    for i, lg in enumerate(logits):
        torch.testing.assert_close(lg[:, -1], out[:, 4 + i], rtol=1e-4, atol=1e-4)
