"""The writer against a local OpenAI-compatible server replaying scripted answers: every scenario of issue #6."""
import json

import pytest

from fusegraph.llm import write_kernel
from fusegraph.llm.prompt import NO_CODE_DETAIL

from . import kernels as K
from .fake_llm import FakeLLM, refused_url


def _run(answers, settings_factory, task=None, **llm):
    with FakeLLM(answers) as fake:
        result = write_kernel(task or K.scaled_add_task(), settings_factory(fake.url, **llm))
    return result, fake


def test_correct_kernel_is_accepted_cached_and_reused_without_a_second_request(llm_settings, tmp_path):
    with FakeLLM([K.answer(K.GOOD)]) as fake:
        settings = llm_settings(fake.url)
        first = write_kernel(K.scaled_add_task(), settings)
        second = write_kernel(K.scaled_add_task(), settings)  # a fresh but identical task
    assert first.accepted and not first.from_cache and first.kernel_source == K.GOOD
    assert first.kernel_name == "scaled_add"
    assert [a.accepted for a in first.attempts] == [True] and first.attempts[0].stage == "accepted"
    assert first.attempts[0].tokens > 0 and first.attempts[0].tokens == (
        first.attempts[0].prompt_tokens + first.attempts[0].completion_tokens)
    assert "accepted in round 1" in first.reason
    assert second.accepted and second.from_cache and second.kernel_source == K.GOOD and second.attempts == []
    assert len(fake.requests) == 1  # the cache answered the second call
    assert fake.paths == ["/v1/chat/completions"]
    req = fake.requests[0]
    assert req["model"] == "fake-nki-coder" and req["messages"][0]["role"] == "system"
    assert K.REFERENCE.strip() in req["messages"][-1]["content"]
    entries = list((tmp_path / "cache").glob("*.json"))
    assert len(entries) == 1 and json.loads(entries[0].read_text())["source"] == K.GOOD
    # the report view of the result is JSON-serialisable
    json.dumps(first.to_dict())


def test_cache_key_separates_shapes_and_models(llm_settings):
    with FakeLLM([K.answer(K.GOOD), K.answer(K.GOOD)]) as fake:
        s = llm_settings(fake.url)
        assert write_kernel(K.scaled_add_task(), s).accepted
        other_model = write_kernel(K.scaled_add_task(), s.replace(llm_model="another-model"))
        other_shape = write_kernel(K.scaled_add_task(rows=8), s)
    assert other_model.accepted and not other_model.from_cache
    assert not other_shape.from_cache  # asked again (and the 4-row kernel is wrong for 8 rows)
    assert len(fake.requests) == 3


def test_invented_api_is_rejected_and_the_repair_round_gets_the_error(llm_settings):
    result, fake = _run([K.answer(K.INVENTED_API), K.answer(K.GOOD)], llm_settings, max_rounds=1)
    first, second = result.attempts
    assert not first.accepted and first.stage == "conformance"
    assert "nisa.fused_scale_add is not in NKI 0.3.0, 0.6.0" in first.reason
    assert second.accepted and result.accepted and len(fake.requests) == 2
    repair = fake.requests[1]["messages"]
    assert repair[-2]["role"] == "assistant" and "fused_scale_add" in repair[-2]["content"]
    assert repair[-1]["role"] == "user" and "rejected (conformance)" in repair[-1]["content"]
    assert "line 14: nisa.fused_scale_add is not in NKI 0.3.0, 0.6.0" in repair[-1]["content"]
    # the repair conversation is the original prompt plus the last answer and its error
    assert repair[:-2] == fake.requests[0]["messages"]


@pytest.mark.parametrize("code, stage, words", [
    (K.TORCH_FALLBACK, "safety", "import of 'torch' is not allowed"),
    (K.NUMPY_FALLBACK, "safety", "import of 'numpy' is not allowed"),
    (K.RETURNS_INPUT, "contract", "returns its input 'x'"),
    (K.COPY_ONLY, "contract", "never calls an NKI compute instruction"),
    (K.DEAD_COMPUTE, "computes", "no compute-engine instruction ran"),
])
def test_torch_fallback_and_fake_compute_are_rejected(llm_settings, code, stage, words):
    result, fake = _run([K.answer(code)], llm_settings)
    assert not result.accepted and result.kernel_source is None and len(fake.requests) == 1
    (att,) = result.attempts
    assert att.stage == stage and words in att.reason, att.reason
    assert words in result.reason


@pytest.mark.parametrize("code, words", [
    (K.IMPORTS_OS, "import of 'os' is not allowed"),
    (K.OPENS_FILE, "the builtin 'open' is not allowed"),
])
def test_os_and_file_access_are_rejected_before_running(llm_settings, code, words, tmp_path):
    result, _ = _run([K.answer(code)], llm_settings)
    (att,) = result.attempts
    assert not result.accepted and att.stage == "safety" and words in att.reason


def test_numerically_wrong_kernel_reports_the_max_abs_diff(llm_settings):
    result, fake = _run([K.answer(K.WRONG), K.answer(K.WRONG)], llm_settings, max_rounds=1)
    assert not result.accepted and [a.stage for a in result.attempts] == ["compare", "compare"]
    att = result.attempts[0]
    assert "max |kernel - reference| =" in att.reason and att.max_abs_diff > 0.1
    assert "max |kernel - reference|" in fake.requests[1]["messages"][-1]["content"]
    assert "no verified kernel after 2 round(s)" in result.reason


def test_kernel_that_never_terminates_is_killed_by_the_time_limit(llm_settings):
    result, _ = _run([K.answer(K.NEVER_ENDS)], llm_settings, run_timeout_s=3)
    (att,) = result.attempts
    assert not result.accepted and att.stage == "run" and "time limit (3 s)" in att.reason
    assert att.seconds < 20


def test_garbage_text_has_no_code_block(llm_settings):
    result, fake = _run([K.GARBAGE, K.GARBAGE], llm_settings, max_rounds=1)
    assert not result.accepted and [a.stage for a in result.attempts] == ["extract", "extract"]
    assert result.attempts[0].reason == NO_CODE_DETAIL
    assert NO_CODE_DETAIL in fake.requests[1]["messages"][-1]["content"]


def test_endpoint_down_gives_a_clean_reason(llm_settings):
    result = write_kernel(K.scaled_add_task(), llm_settings(refused_url(), max_rounds=3))
    assert not result.accepted and result.kernel_source is None
    (att,) = result.attempts  # an endpoint failure is not retried as a repair round
    assert att.stage == "endpoint" and "connection refused" in att.reason
    assert result.reason.startswith("LLM endpoint unavailable: connection refused")


def test_rounds_are_bounded_by_max_rounds(llm_settings):
    result, fake = _run([K.answer(K.WRONG)] * 5, llm_settings, max_rounds=2)
    assert len(result.attempts) == 3 and len(fake.requests) == 3
    assert [a.round for a in result.attempts] == [1, 2, 3]
    assert result.tokens == sum(a.tokens for a in result.attempts) > 0


def test_writer_off_and_half_configured(llm_settings):
    from fusegraph.settings import Settings

    off = write_kernel(K.scaled_add_task(), Settings.from_options({}, env={}))
    assert not off.accepted and "off" in off.reason and off.attempts == []
    half = write_kernel(K.scaled_add_task(), Settings.from_options({"llm_url": "http://127.0.0.1:1"}, env={}))
    assert "llm_model is not" in half.reason


def test_broken_reference_is_reported_not_raised(llm_settings):
    task = K.scaled_add_task()
    task.reference = lambda x, b: (_ for _ in ()).throw(RuntimeError("reference bug"))
    result, fake = _run([K.answer(K.GOOD)], llm_settings, task=task, max_rounds=2)
    assert not result.accepted and len(fake.requests) == 1  # not the model's fault: no repair round
    assert result.attempts[0].stage == "reference" and "reference bug" in result.attempts[0].reason


def test_internal_errors_never_escape(llm_settings, monkeypatch):
    import fusegraph.llm.writer as writer

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(writer, "_write", boom)
    result = write_kernel(K.scaled_add_task(), llm_settings("http://127.0.0.1:1"))
    assert not result.accepted and "internal error" in result.reason and "boom" in result.reason


def test_tampered_cache_entry_is_not_trusted(llm_settings, tmp_path):
    import hashlib

    with FakeLLM([K.answer(K.GOOD), K.answer(K.GOOD)]) as fake:
        s = llm_settings(fake.url)
        assert write_kernel(K.scaled_add_task(), s).accepted
        (entry,) = (tmp_path / "cache").glob("*.json")
        data = json.loads(entry.read_text())
        data["source"] = K.IMPORTS_OS
        data["sha256"] = hashlib.sha256(K.IMPORTS_OS.encode()).hexdigest()
        entry.write_text(json.dumps(data))
        again = write_kernel(K.scaled_add_task(), s)
    assert again.accepted and not again.from_cache and again.kernel_source == K.GOOD
    assert len(fake.requests) == 2
