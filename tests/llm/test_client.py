"""The urllib chat client: URLs, usage, HTTP errors, malformed answers, timeouts — all as values."""
import pytest

from fusegraph.llm.client import ChatClient, completions_url
from fusegraph.llm.extract import extract_code

from .fake_llm import FakeLLM, Slow, Status, Trickle, refused_url

MSG = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("url, want", [
    ("http://h:8000", "http://h:8000/v1/chat/completions"),
    ("http://h:8000/v1/", "http://h:8000/v1/chat/completions"),
    ("http://h/api/v1/chat/completions", "http://h/api/v1/chat/completions"),
])
def test_completions_url(url, want):
    assert completions_url(url) == want


def test_reply_usage_and_request_body():
    with FakeLLM(["```python\nx = 1\n```"]) as fake:
        reply = ChatClient(fake.url, "m", max_tokens=123, api_key="sekrit").chat(MSG)
    assert reply.ok and reply.text.startswith("```python") and reply.finish_reason == "stop"
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens > 0
    req = fake.requests[0]
    assert req["model"] == "m" and req["messages"] == MSG and req["max_tokens"] == 123 and req["stream"] is False
    assert fake.headers[0]["Authorization"] == "Bearer sekrit"


def test_errors_are_values():
    with FakeLLM([Status(500, "model overloaded"), b"not json", b'{"choices": []}', Slow(2.0, "late")]) as fake:
        c = ChatClient(fake.url, "m", timeout_s=0.5)
        r500, rbad, rempty, rslow = (c.chat(MSG) for _ in range(4))
    assert "HTTP 500" in r500.error and "model overloaded" in r500.error
    assert "malformed response" in rbad.error and "malformed response" in rempty.error
    assert "no answer" in rslow.error and "0.5 s" in rslow.error
    down = ChatClient(refused_url(), "m").chat(MSG)
    assert not down.ok and "connection refused" in down.error
    assert "http(s) URL" in ChatClient("file:///etc/passwd", "m").chat(MSG).error


def test_extract_code():
    assert extract_code("text\n```python\nimport nki\n@nki.jit\ndef k(): pass\n```\nmore") .startswith("import nki")
    two = "```python\nhelper = 1\n```\nand\n```python\n@nki.jit\ndef k(x):\n    return x\n```"
    assert "@nki.jit" in extract_code(two)
    assert extract_code("<think>```python\n@nki.jit\ndef bad(): pass\n```</think>no code") is None
    assert extract_code("import nki\n\n@nki.jit\ndef k(x):\n    return x\n").startswith("import nki")
    assert extract_code("Sorry, nki.jit is hard.") is None
    assert extract_code("```python\n@nki.jit\ndef k(x):\n    return x\n") is not None  # unterminated fence


@pytest.mark.parametrize("head", [False, True], ids=["body", "status-line"])
def test_a_trickling_endpoint_is_cut_off_at_one_total_deadline(head):
    """One byte every 0.2 s resets any per-read timeout; the client must give up at its total deadline."""
    import time

    with FakeLLM([Trickle(0.2, "x" * 2000, head=head)]) as fake:
        t0 = time.monotonic()
        reply = ChatClient(fake.url, "m", timeout_s=1.5).chat(MSG)
        elapsed = time.monotonic() - t0
    assert not reply.ok and reply.text == ""
    assert "no answer" in reply.error and "1.5 s" in reply.error and "total deadline" in reply.error, reply.error
    assert 1.3 <= elapsed < 1.5 + 1.0, elapsed


def test_the_deadline_leaves_fast_answers_alone():
    with FakeLLM(["```python\nx = 1\n```"] * 3) as fake:
        c = ChatClient(fake.url, "m", timeout_s=1.0)
        replies = [c.chat(MSG) for _ in range(3)]
    assert all(r.ok and r.text.startswith("```python") for r in replies)
