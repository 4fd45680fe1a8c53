"""What fusegraph cannot capture runs eagerly with one clear warning; never an exception from the forward."""
import pytest
import torch

from fusegraph import FusegraphWarning
from fusegraph.models import build_decode


def _compile(fn, **kw):
    return torch.compile(fn, backend="fusegraph", **kw)


def test_dynamic_shapes_fall_back_with_a_warning():
    f = _compile(lambda x: torch.relu(x) * 2, dynamic=True)
    with pytest.warns(FusegraphWarning, match="dynamic shapes are not supported"):
        out = f(torch.randn(5))
    assert out.shape == (5,)
    x = torch.randn(7)
    assert torch.equal(f(x), torch.relu(x) * 2)


def test_unsupported_dtype_falls_back_with_a_warning():
    case = build_decode("llama-tiny", dtype="float64")
    ref = case.fork()
    with pytest.warns(FusegraphWarning, match="unsupported dtype float64"):
        with torch.no_grad():
            out = _compile(case.step)(case.token, case.position)
    with torch.no_grad():
        assert torch.equal(out, ref.step(ref.token, ref.position))


def test_graph_without_tensor_inputs_falls_back():
    @torch.compile(backend="fusegraph")
    def f(n: int):
        return torch.arange(n) * 2

    with pytest.warns(FusegraphWarning, match="no tensor inputs"):
        out = f(4)
    assert torch.equal(out, torch.arange(4) * 2)


def test_autograd_enabled_falls_back():
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with pytest.warns(FusegraphWarning, match="autograd is enabled"):
        out = _compile(lin)(x)
    assert torch.allclose(out, lin(x))
    out.sum().backward()  # still differentiable: it ran eagerly


def test_unknown_executor_falls_back_to_eager(monkeypatch):
    monkeypatch.setenv("FUSEGRAPH_EXECUTOR", "neuron")  # the Neuron SDK is not installed here
    f = _compile(lambda x: x.sin() + 1)
    with pytest.warns(FusegraphWarning, match="executor 'neuron'"):
        with torch.no_grad():
            out = f(torch.ones(3))
    assert torch.allclose(out, torch.ones(3).sin() + 1)


def test_kernel_failing_after_verification_falls_back_for_that_call_and_the_rest():
    """A verified kernel that fails at a later call (a NaN hidden state makes the router's top-k search undefined
    behaviour, which the interpreter refuses) must not raise into the forward: that call and every later one run
    the region eagerly, with one warning; eager just returns the NaN logits."""
    import warnings

    from fusegraph.capture.session import last_session

    case = build_decode("qwen3-moe-tiny")
    ref = case.fork()
    step = _compile(case.step, dynamic=False, options={"executor": "nkisim", "cache_dir": "off"})
    emb = case.model.model.embed_tokens.weight
    tok, pos = case.token.clone(), case.position.clone()
    with torch.no_grad():
        for i in range(4):
            saved = emb[tok[0, 0]].clone()
            if i == 2:
                emb[tok[0, 0]] = float("nan")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = step(tok, pos)
            expected = ref.step(tok, pos)
            emb[tok[0, 0]] = saved
            msgs = [str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)]
            assert torch.equal(out.isnan(), expected.isnan())
            torch.testing.assert_close(out.nan_to_num(), expected.nan_to_num(), rtol=1e-4, atol=1e-4)
            if i == 2:
                assert len([m for m in msgs if "kernel failed at run time" in m]) == 1, msgs
                assert expected.isnan().all()
            tok, pos = expected[:, -1:].nan_to_num().argmax(-1), pos + 1
    stats = last_session().program.newest_execution()
    assert list(stats.executed_by.values()) == ["eager"]
    assert "failed to run at call 3" in next(iter(stats.verification.values()))
