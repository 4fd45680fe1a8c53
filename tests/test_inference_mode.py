"""Every public path under ``torch.inference_mode()`` (how serving code usually runs), with the model built outside
it and inside it: the torch.compile backend, HF ``generate`` with a compile config, ``capture_step`` and ``explain``.

Inference tensors have no version counter (reading ``t._version`` raises ``RuntimeError: Inference tensors do not
track version counter.``); fusegraph must neither crash nor return results other than eager's.
"""
import contextlib
import warnings

import pytest
import torch
from transformers import CompileConfig

import fusegraph
from fusegraph.capture.session import CaptureSession, version_of
from fusegraph.models import build_decode, greedy_decode
from fusegraph.settings import Settings

BUILT = ["outside", "inside"]


def _case(built: str):
    with torch.inference_mode() if built == "inside" else contextlib.nullcontext():
        return build_decode("llama-tiny")


def _no_fusegraph_warnings(caught) -> None:
    msgs = [str(w.message) for w in caught if "fusegraph" in str(w.message)]
    assert not msgs, msgs


@pytest.mark.parametrize("built", BUILT)
def test_torch_compile_backend_under_inference_mode_eager_executor(built):
    _compiled_steps_equal_eager(built, "eager")


@pytest.mark.parametrize("built", BUILT)
def test_torch_compile_backend_under_inference_mode(built):
    _compiled_steps_equal_eager(built, "nkisim")


def _compiled_steps_equal_eager(built: str, executor: str) -> None:
    case = _case(built)
    ref = case.fork()
    compiled = torch.compile(case.step, backend="fusegraph", options={"executor": executor, "cache_dir": "off"})
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        toks_c, logits_c = greedy_decode(compiled, case.token, case.position, 4)
        toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, 4)
    _no_fusegraph_warnings(caught)
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    for a, b in zip(logits_c, logits_e):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()


@pytest.mark.parametrize("built", BUILT)
def test_capture_step_and_explain_under_inference_mode(built):
    case = _case(built)
    ref = case.fork()
    with torch.inference_mode():
        cap = fusegraph.capture_step(case.step, case.token, case.position, options={"executor": "eager"})
        expected = ref.step(ref.token, ref.position)
        report = fusegraph.explain(ref.fork().step, ref.token, ref.position + 1)
    assert torch.equal(cap.outputs, expected)
    assert len(cap.program.graphs) == 1
    assert report.to_dict()["regions"], "explain found no fused region"


@pytest.mark.parametrize("built", BUILT)
def test_hf_generate_under_inference_mode(built):
    model = _case(built).model
    torch.manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (1, 8))
    mask = torch.ones_like(ids)

    def generate(cc=None):
        return model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                              cache_implementation="static", compile_config=cc)

    cc = CompileConfig(backend="fusegraph", fullgraph=False, mode=None,
                       options={"executor": "nkisim", "cache_dir": "off"})
    cc._compile_all_devices = True  # transformers only auto-compiles on cuda/xpu/neuron/tpu devices
    with torch.inference_mode():
        ref = generate()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = generate(cc)
    _no_fusegraph_warnings(caught)
    assert torch.equal(out, ref)


def test_links_from_inference_tensors_are_not_glue_free():
    """Without a version counter no write between two graphs can be excluded: the link is kept, not glue-free."""
    with torch.inference_mode():
        t = torch.ones(3)
    assert version_of(t) is None and version_of(torch.ones(3)) == 0
    session = CaptureSession(settings=Settings.from_options(None))
    session.record_outputs(0, [t])
    assert session.find_producers([t]) == {0: (0, 0, False)}
    plain = torch.ones(3)
    session.record_outputs(1, [plain])
    assert session.find_producers([plain]) == {0: (1, 0, True)}
