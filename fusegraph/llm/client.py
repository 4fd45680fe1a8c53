"""A minimal OpenAI-compatible chat client over ``urllib`` (vLLM, TGI, llama.cpp server, hosted APIs).

Errors are values: :meth:`ChatClient.chat` returns a :class:`ChatReply` whose ``error`` says what went wrong
in one line (connection refused, timeout, HTTP status with the server's message, malformed JSON), because an
unreachable endpoint is an expected condition for an opt-in fallback, not an exception that should escape a
compile. No third-party HTTP library: the LLM option must not add a dependency.
"""
from __future__ import annotations

import json
import logging
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

MAX_RESPONSE_BYTES = 8 * 1024 * 1024
_LOOPBACK = ("localhost", "127.0.0.1", "::1")


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def from_json(cls, d: Any) -> "Usage":
        if not isinstance(d, dict):
            return cls()

        def num(key: str) -> int:
            v = d.get(key)
            return int(v) if isinstance(v, (int, float)) else 0

        p, c = num("prompt_tokens"), num("completion_tokens")
        return cls(p, c, num("total_tokens") or p + c)


@dataclass
class ChatReply:
    text: str = ""
    usage: Usage = field(default_factory=Usage)
    error: str = ""  # "" = success
    finish_reason: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error


def completions_url(url: str) -> str:
    """``http://h:8000`` / ``http://h:8000/v1`` / a full ``.../chat/completions`` URL -> the completions URL."""
    u = url.strip().rstrip("/")
    if u.endswith("/chat/completions"):
        return u
    if u.endswith("/v1"):
        return u + "/chat/completions"
    return u + "/v1/chat/completions"


class ChatClient:
    """POSTs ``/v1/chat/completions``; one request per :meth:`chat` call, no retries (the writer decides)."""

    def __init__(self, url: str, model: str, *, timeout_s: float = 120.0, max_tokens: int = 4096,
                 temperature: float = 0.0, api_key: str = "") -> None:
        self.url = completions_url(url)
        self.model = model
        self.timeout_s = timeout_s
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.api_key = api_key

    def _opener(self) -> urllib.request.OpenerDirector:
        host = urllib.parse.urlsplit(self.url).hostname or ""
        if host in _LOOPBACK or host.startswith("127."):
            return urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a proxy never serves localhost
        return urllib.request.build_opener()

    def chat(self, messages: list[dict[str, str]]) -> ChatReply:
        t0 = time.perf_counter()

        def fail(msg: str) -> ChatReply:
            return ChatReply(error=msg, seconds=time.perf_counter() - t0)

        scheme = urllib.parse.urlsplit(self.url).scheme
        if scheme not in ("http", "https"):
            return fail(f"the LLM endpoint must be an http(s) URL, got {self.url!r}")
        body = json.dumps({"model": self.model, "messages": messages, "temperature": self.temperature,
                           "max_tokens": self.max_tokens, "stream": False}).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with self._opener().open(req, timeout=self.timeout_s) as resp:
                raw = resp.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as e:
            detail = _server_message(e.read(4096) if e.fp else b"")
            return fail(f"HTTP {e.code} from {self.url}" + (f": {detail}" if detail else ""))
        except urllib.error.URLError as e:
            r = e.reason
            if isinstance(r, ConnectionRefusedError):
                return fail(f"connection refused by {self.url} (is the LLM server running?)")
            if isinstance(r, (socket.timeout, TimeoutError)):
                return fail(f"no answer from {self.url} within {self.timeout_s:g} s")
            return fail(f"cannot reach {self.url}: {r}")
        except (socket.timeout, TimeoutError):
            return fail(f"no answer from {self.url} within {self.timeout_s:g} s")
        except (ConnectionError, OSError) as e:
            return fail(f"connection to {self.url} failed: {e}")
        if len(raw) > MAX_RESPONSE_BYTES:
            return fail(f"the response from {self.url} exceeds {MAX_RESPONSE_BYTES} bytes")
        try:
            data = json.loads(raw)
            choice = data["choices"][0]
            text = choice["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            return fail(f"malformed response from {self.url} (no choices[0].message.content): {raw[:200]!r}")
        reply = ChatReply(text=text if isinstance(text, str) else "", usage=Usage.from_json(data.get("usage")),
                          finish_reason=str(choice.get("finish_reason") or ""), seconds=time.perf_counter() - t0)
        log.debug("LLM reply: %d chars, %d tokens, %.2f s", len(reply.text), reply.usage.total_tokens, reply.seconds)
        return reply


def _server_message(raw: bytes) -> str:
    try:
        data = json.loads(raw)
        err = data.get("error", data) if isinstance(data, dict) else data
        msg = err.get("message") if isinstance(err, dict) else err
        return str(msg)[:300]
    except ValueError:
        return raw.decode("utf-8", "replace").strip()[:300]
