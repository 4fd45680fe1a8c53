"""Batches as a kernel dimension: HF's padded batch (left padding, so every sequence has its own prompt length,
attention mask and RoPE positions) decoded by ``generate()`` with fusegraph as the compile backend, at batch 1, 3
and 8, on tiny Llama, Qwen3 (q/k-norm), Qwen3-MoE (8 experts top-2, renormalized) and Mixtral (8 experts top-2).

Each decode step must be one megakernel launch in the interpreter, verified against eager on its first call,
with no decoder op left on the eager path (the report's executed coverage is 100%) and no step recomputed
eagerly by a router guard; the greedy tokens equal eager generation and the scores stay within the fp32
tolerance of docs/codegen.md."""
import warnings

import pytest
import torch
from transformers import CompileConfig

from fusegraph.capture.session import last_session
from fusegraph.models import build_decode, build_family_decode
from fusegraph.report.api import report_for_session

NEW_TOKENS = 4


def _model(name: str) -> torch.nn.Module:
    if name == "mixtral":
        model = build_family_decode("Mixtral", num_local_experts=8, num_experts_per_tok=2,
                                    intermediate_size=128).model
        with torch.no_grad():  # spread the tiny random router (as build_decode does for Qwen3-MoE): no near-ties
            for n, p in model.named_parameters():
                if n.endswith("mlp.gate.weight"):
                    p.normal_(0.0, 0.5)
        return model
    return build_decode(name).model


def _prompts(vocab: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` prompts of 8 slots, sequence b left-padded by (3 b) mod 7: prompt lengths 8, 5, 2, 6, 3, 7, 4, 8."""
    torch.manual_seed(1)
    ids = torch.randint(1, vocab, (batch, 8))
    mask = torch.ones_like(ids)
    for b in range(batch):
        pad = (3 * b) % 7
        ids[b, :pad] = 0
        mask[b, :pad] = 0
    return ids, mask


def _generate(model, ids, mask, cc=None):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                          cache_implementation="static", compile_config=cc, output_scores=True,
                          return_dict_in_generate=True)


def _check_batch(name: str, batch: int) -> None:
    model = _model(name)
    ids, mask = _prompts(model.config.vocab_size, batch)
    ref = _generate(model, ids, mask)
    before = last_session()
    cc = CompileConfig(backend="fusegraph", fullgraph=False, mode=None,
                       options={"executor": "nkisim", "cache_dir": "off"})
    cc._compile_all_devices = True  # transformers only auto-compiles on cuda/xpu/neuron/tpu devices
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _generate(model, ids, mask, cc)
    fusegraph_warnings = [str(w.message) for w in caught if "fusegraph" in str(w.message)]
    assert not fusegraph_warnings, fusegraph_warnings

    session = last_session()
    assert session is not None and session is not before, "generate did not compile the decode step with fusegraph"
    (rec,) = session.program.execution.values()
    assert rec.calls == NEW_TOKENS - 1  # the first token comes from the eager prefill
    assert rec.launches_per_call == 1
    assert set(rec.executed_by.values()) == {"nkisim"}, rec.executed_by
    assert set(rec.verification.values()) == {"passed"}, rec.verification
    assert not rec.guard_reruns, rec.guard_reruns
    report = report_for_session(session).data
    assert report["coverage_basis"] == "executed" and report["coverage"] == 1.0, report["coverage"]
    assert report["kernel_launches_per_step"] == 1
    (kernel,) = report["kernels"]
    assert kernel["active"]

    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()


FAST = [("llama-tiny", 3), ("qwen3-tiny", 3), ("mixtral", 3), ("qwen3-moe-tiny", 8)]
SLOW = [("llama-tiny", 1), ("qwen3-tiny", 1), ("qwen3-moe-tiny", 1), ("mixtral", 1), ("qwen3-moe-tiny", 3),
        ("llama-tiny", 8), ("qwen3-tiny", 8), ("mixtral", 8)]


@pytest.mark.parametrize("name,batch", FAST, ids=[f"{n}-b{b}" for n, b in FAST])
def test_padded_batch_decodes_in_one_kernel(name, batch):
    _check_batch(name, batch)


@pytest.mark.slow
@pytest.mark.parametrize("name,batch", SLOW, ids=[f"{n}-b{b}" for n, b in SLOW])
def test_padded_batch_decodes_in_one_kernel_slow(name, batch):
    _check_batch(name, batch)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-moe-tiny"])
def test_batch_64_with_logits_streamed_to_hbm(name):
    """64 sequences (`build_decode(batch=64)`), 1 KiB weight chunks so the [64, vocab] logits tile exceeds a chunk
    and the lm_head stores it chunk by chunk: greedy tokens equal eager over 3 steps, one verified launch."""
    from fusegraph.models import greedy_decode

    case = build_decode(name, batch=64, max_cache_len=16)
    ref = case.fork()
    ref_tokens, ref_logits = greedy_decode(ref.step, ref.token, ref.position, 3)
    step = torch.compile(case.step, backend="fusegraph",
                         options={"executor": "nkisim", "cache_dir": "off", "weight_chunk_kib": 1})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens, logits = greedy_decode(step, case.token, case.position, 3)
    assert not [str(w.message) for w in caught if "fusegraph" in str(w.message)]
    (rec,) = last_session().program.execution.values()
    assert rec.launches_per_call == 1 and set(rec.verification.values()) == {"passed"}
    (plan,) = rec.run.plans  # the executor's runner: its kernel plans (for tests and tools)
    assert "straight to HBM" in plan.generated.source
    assert all(torch.equal(a, b) for a, b in zip(tokens, ref_tokens))
    for a, b in zip(logits, ref_logits):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()
