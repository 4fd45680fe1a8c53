"""What fusegraph cannot capture runs eagerly with one clear warning; never an exception from the forward."""
import warnings

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


def test_kernel_failing_after_verification_falls_back_for_that_call_only():
    """A verified kernel that fails at a later call (a NaN hidden state makes the router's top-k search undefined
    behaviour, which the interpreter refuses) must not raise into the forward: that call runs the region eagerly,
    with one warning (eager just returns the NaN logits), and the next call runs the kernel again: one malformed
    request must not cost every later request its kernel. (The NaN call writes NaN KV rows, in eager too: both
    caches are put back before the next valid request.)"""
    import warnings

    from fusegraph.capture.session import last_session

    case = build_decode("qwen3-moe-tiny")
    ref = case.fork()
    step = _compile(case.step, dynamic=False, options={"executor": "nkisim", "cache_dir": "off"})
    emb = case.model.model.embed_tokens.weight
    tok, pos = case.token.clone(), case.position.clone()
    with torch.no_grad():
        for i in range(4):
            if i == 2:
                saved, kept, kept_ref = emb[tok[0, 0]].clone(), _state(case), _state(ref)
                emb[tok[0, 0]] = float("nan")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    out = step(tok, pos)
                expected = ref.step(tok, pos)
                emb[tok[0, 0]] = saved
                msgs = [str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)]
                assert expected.isnan().all() and torch.equal(out.isnan(), expected.isnan())
                assert len([m for m in msgs if "kernel failed at run time" in m and "this call" in m]) == 1, msgs
                assert last_session().program.newest_execution().launches_per_call == 0
                _put_back(case, kept)
                _put_back(ref, kept_ref)
            out, expected = step(tok, pos), ref.step(tok, pos)
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
            assert last_session().program.newest_execution().launches_per_call == 1, i
            tok, pos = expected[:, -1:].argmax(-1), pos + 1
    (run,) = last_session().program.newest_execution().regions
    assert run.failed_calls == 1 and not run.disabled and run.verification == "passed"


def _put_back(case, saved):
    tensors = []
    for layer in case.cache.layers:
        tensors += [v for v in vars(layer).values() if isinstance(v, torch.Tensor)]
    for t, v in zip(tensors, saved):
        t.copy_(v)


def _state(case):
    """Every tensor of the cache (KV rows and position counters), copied."""
    out = []
    for layer in case.cache.layers:
        out += [v.clone() for v in vars(layer).values() if isinstance(v, torch.Tensor)]
    return out


def test_out_of_range_token_leaves_the_state_as_eager_does():
    """Batch of 2, one token id past the vocabulary: eager raises IndexError in the embedding before it writes any
    state. The fused step runs the cache's position counters on the host before the kernel, and the kernel (whose
    embedding DMA refuses the id) may have written KV rows of the other sequence: the call must raise eager's error
    and leave every state tensor exactly as it was, so later steps equal eager's and still run the kernel."""
    from fusegraph.capture.session import last_session

    case = build_decode("llama-tiny", batch=2)
    ref = case.fork()
    step = _compile(case.step, dynamic=False, options={"executor": "nkisim", "cache_dir": "off"})
    tok, pos = case.token.clone(), case.position.clone()
    with torch.no_grad():
        for i in range(4):
            if i in (1, 2):
                bad = tok.clone()
                bad[0, 0] = case.model.config.vocab_size + 7 if i == 1 else -3
                before = _state(case)
                with pytest.raises(IndexError):
                    ref.step(bad, pos)
                with pytest.warns(FusegraphWarning, match="kernel failed at run time"):
                    with pytest.raises(IndexError):
                        step(bad, pos)
                assert all(torch.equal(a, b) for a, b in zip(_state(case), before))
                assert all(torch.equal(a, b) for a, b in zip(_state(ref), before))
                continue
            out, expected = step(tok, pos), ref.step(tok, pos)
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
            assert last_session().program.newest_execution().launches_per_call == 1
            tok, pos = expected[:, -1:].argmax(-1), pos + 1
    (run,) = last_session().program.newest_execution().regions
    assert not run.disabled and run.failed_calls == 2


def _kernel_plan():
    from fusegraph.capture.session import last_session

    record = last_session().program.newest_execution()
    (plan,) = [p for p in record.run.plans if not p.disabled]
    return plan


def test_a_kernel_failing_after_partial_state_writes_is_undone():
    """A kernel that writes this step's KV rows and then fails: with a malformed input (eager raises too) the rows
    it wrote are undone, so the state is exactly as before the call; with a valid one the region's eager ops give
    eager's state. Three failing calls in a row retire the kernel."""
    case = build_decode("llama-tiny")
    ref = case.fork()
    step = _compile(case.step, dynamic=False, options={"executor": "nkisim", "cache_dir": "off"})
    tok, pos = case.token.clone(), case.position.clone()
    with torch.no_grad():
        step(tok, pos)
        expected = ref.step(tok, pos)
        tok, pos = expected[:, -1:].argmax(-1), pos + 1
        plan = _kernel_plan()
        real = plan.runner
        row = int(case.cache.layers[0].cumulative_length)

        def write_rows_then_fail(args):
            for layer in case.cache.layers:
                layer.keys[:, :, row] = 123.0
                layer.values[:, :, row] = -5.0
            raise RuntimeError("injected failure after state writes")

        plan.runner = write_rows_then_fail
        before = _state(case)
        bad = tok.clone()
        bad[0, 0] = 10**6
        with pytest.warns(FusegraphWarning, match="injected failure"), pytest.raises(IndexError):
            step(bad, pos)
        assert all(torch.equal(a, b) for a, b in zip(_state(case), before))
        for i in range(3):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = step(tok, pos)
            retired = [w for w in caught if "3 calls in a row" in str(w.message)]
            assert len(retired) == (i == 1), [str(w.message) for w in caught]
            expected = ref.step(tok, pos)
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
            for a, b in zip(case.cache_tensors(), ref.cache_tensors()):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
            assert plan.disabled == (i >= 1)  # the failing call with the bad token counted too
            tok, pos = expected[:, -1:].argmax(-1), pos + 1
            row += 1
        plan.runner = real


@pytest.mark.parametrize("change", ["data_copy", "data_assign", "no_grad_copy", "data_iadd"])
def test_weights_changed_after_compile_are_staged_again(change):
    """Serving swaps weights and merges adapters after compile: the kernel must use the new values (the old
    staged layouts were silently reused: err 0.435). ``p.data.copy_`` and ``p.data += d`` bump no version counter
    and keep the storage; the staged copy's key samples the values too."""
    case = build_decode("llama-tiny")
    ref = case.fork()
    step = _compile(case.step, dynamic=False, options={"executor": "nkisim", "cache_dir": "off"})
    tok, pos = case.token.clone(), case.position.clone()
    with torch.no_grad():
        for i in range(3):
            if i == 1:
                for m in (case.model, ref.model):
                    torch.manual_seed(1)
                    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                                 "lm_head.weight"):
                        p = m.get_parameter(name)
                        new = torch.randn_like(p) * 0.05
                        if change == "data_copy":
                            p.data.copy_(new)
                        elif change == "data_assign":
                            p.data = new.clone()
                        elif change == "no_grad_copy":
                            p.copy_(new)
                        else:
                            p.data += new
            out, expected = step(tok, pos), ref.step(tok, pos)
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
            tok, pos = expected[:, -1:].argmax(-1), pos + 1
    plan = _kernel_plan()
    assert plan.trusted and not plan.disabled


def test_paged_slot_past_the_pool_leaves_the_pool_unchanged():
    """A paged-KV batch of 2 whose second slot lies past the pool: the kernel's DMA refuses it (after the first
    sequence's row may have been written), the call raises eager's IndexError and every pool is as before the
    call (rows saved by the journal, not whole pools); the next valid step runs the kernel and equals eager."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parent / "serving"))
    from paged_step import PagedDecoder, PagedServer

    from fusegraph.capture.session import last_session

    torch.manual_seed(0)
    model = PagedDecoder().eval()
    srv = PagedServer(model, [15, 40], num_blocks=16)
    ref = srv.fork()
    step = torch.compile(model, backend="fusegraph", options={"executor": "nkisim", "cache_dir": "off"})
    torch.testing.assert_close(srv.step(step), ref.step(model), rtol=1e-4, atol=1e-4)
    table, slots, ctx = srv.step_inputs()
    bad = slots.clone()
    bad[1] = 16 * 16 + 3
    before = [t.clone() for kv in srv.caches for t in kv]
    with pytest.warns(FusegraphWarning, match="kernel failed at run time"), pytest.raises(IndexError), torch.no_grad():
        step(srv.tokens, srv.caches, table, bad, ctx)
    assert all(torch.equal(a, b) for a, b in zip((t for kv in srv.caches for t in kv), before))
    for _ in range(2):
        torch.testing.assert_close(srv.step(step), ref.step(model), rtol=1e-4, atol=1e-4)
        assert last_session().program.newest_execution().launches_per_call == 1
