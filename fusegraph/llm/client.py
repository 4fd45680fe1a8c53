"""A minimal OpenAI-compatible chat client over ``urllib`` (vLLM, TGI, llama.cpp server, hosted APIs).

Errors are values: :meth:`ChatClient.chat` returns a :class:`ChatReply` whose ``error`` says what went wrong
in one line (connection refused, timeout, HTTP status with the server's message, malformed JSON), because an
unreachable endpoint is an expected condition for an opt-in fallback, not an exception that should escape a
compile. No third-party HTTP library: the LLM option must not add a dependency.

``timeout_s`` is one **total deadline** per request (connect, headers and body together), not a per-read
timeout: a socket timeout alone restarts with every byte received, so a server trickling its answer a byte at a
time would hold the compile for as long as it likes. A timer shuts the request's socket down when the deadline
passes, which wakes a blocked read at once (:class:`_Deadline`).
"""
from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
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


class _Deadline:
    """One request's total deadline: at expiry every socket the request opened is shut down.

    Sockets, not connections, are kept: urllib drops the connection's socket once the headers are in and the
    response reads through its own reference to it.

    ``shutdown`` (not ``close``) is what wakes a thread blocked in ``recv`` on Linux and macOS; the blocked read
    then sees end-of-file or an error, and :meth:`ChatClient.chat` reports the deadline instead of either.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.expires = time.monotonic() + seconds
        self.fired = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(0.0, seconds), self.fire)
        self._timer.daemon = True

    def remaining(self) -> float:
        return max(0.001, self.expires - time.monotonic())

    def register(self, sock: socket.socket | None) -> None:
        if sock is None:
            return
        with self._lock:
            self._socks.append(sock)
            fired = self.fired
        if fired:  # the timer ran while this socket was being connected
            _shutdown(sock)

    def check(self) -> None:
        if self.fired:
            raise TimeoutError(f"total deadline of {self.seconds:g} s passed")

    def fire(self) -> None:
        with self._lock:
            self.fired = True
            socks = list(self._socks)
        for sock in socks:
            _shutdown(sock)

    def __enter__(self) -> "_Deadline":
        self._timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._timer.cancel()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


def _deadline_connection(base: type, deadline: _Deadline) -> type:
    """``base`` (HTTP(S)Connection) registering itself with ``deadline`` and bounding connect by its remainder."""

    class Connection(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            create = self._create_connection  # socket.create_connection; the raw socket, before any TLS

            def create_and_register(*a: Any, **kw: Any) -> socket.socket:
                sock = create(*a, **kw)
                deadline.register(sock)
                return sock

            self._create_connection = create_and_register

        def connect(self) -> None:
            deadline.check()
            self.timeout = min(self.timeout, deadline.remaining()) if isinstance(self.timeout, (int, float)) \
                else deadline.remaining()
            super().connect()
            deadline.check()

    return Connection


class _DeadlineHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def do_open(self, http_class: Any, req: Any, **kw: Any) -> Any:  # noqa: D102 - urllib's hook
        return super().do_open(_deadline_connection(http_class, self.deadline), req, **kw)


class _DeadlineHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def do_open(self, http_class: Any, req: Any, **kw: Any) -> Any:  # noqa: D102 - urllib's hook
        return super().do_open(_deadline_connection(http_class, self.deadline), req, **kw)


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

    def _opener(self, deadline: _Deadline) -> urllib.request.OpenerDirector:
        handlers: list[Any] = [_DeadlineHTTPHandler(deadline), _DeadlineHTTPSHandler(deadline)]
        host = urllib.parse.urlsplit(self.url).hostname or ""
        if host in _LOOPBACK or host.startswith("127."):
            handlers.append(urllib.request.ProxyHandler({}))  # a proxy never serves localhost
        return urllib.request.build_opener(*handlers)

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
        with _Deadline(self.timeout_s) as deadline:
            raw, error = self._exchange(req, deadline)
        late = (f"no answer from {self.url} within {self.timeout_s:g} s (llm_timeout_s, the total deadline of one "
                f"request)")
        if error:
            return fail(late if deadline.fired else error)
        if len(raw) > MAX_RESPONSE_BYTES:
            return fail(f"the response from {self.url} exceeds {MAX_RESPONSE_BYTES} bytes")
        try:
            data = json.loads(raw)
            choice = data["choices"][0]
            text = choice["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            if deadline.fired:  # the answer was cut off at the deadline
                return fail(late)
            return fail(f"malformed response from {self.url} (no choices[0].message.content): {raw[:200]!r}")
        reply = ChatReply(text=text if isinstance(text, str) else "", usage=Usage.from_json(data.get("usage")),
                          finish_reason=str(choice.get("finish_reason") or ""), seconds=time.perf_counter() - t0)
        log.debug("LLM reply: %d chars, %d tokens, %.2f s", len(reply.text), reply.usage.total_tokens, reply.seconds)
        return reply

    def _exchange(self, req: urllib.request.Request, deadline: _Deadline) -> tuple[bytes, str]:
        """(response body, "") or (b"", one-line error); the deadline's timer may cut either short."""
        try:
            with self._opener(deadline).open(req, timeout=deadline.remaining()) as resp:
                return resp.read(MAX_RESPONSE_BYTES + 1), ""
        except urllib.error.HTTPError as e:
            detail = _server_message(e.read(4096) if e.fp else b"")
            return b"", f"HTTP {e.code} from {self.url}" + (f": {detail}" if detail else "")
        except urllib.error.URLError as e:
            r = e.reason
            if isinstance(r, ConnectionRefusedError):
                return b"", f"connection refused by {self.url} (is the LLM server running?)"
            if isinstance(r, (socket.timeout, TimeoutError)):
                return b"", f"no answer from {self.url} within {self.timeout_s:g} s"
            return b"", f"cannot reach {self.url}: {r}"
        except (socket.timeout, TimeoutError):
            return b"", f"no answer from {self.url} within {self.timeout_s:g} s"
        except (ConnectionError, OSError, http.client.HTTPException) as e:
            return b"", f"connection to {self.url} failed: {e}"


def _server_message(raw: bytes) -> str:
    try:
        data = json.loads(raw)
        err = data.get("error", data) if isinstance(data, dict) else data
        msg = err.get("message") if isinstance(err, dict) else err
        return str(msg)[:300]
    except ValueError:
        return raw.decode("utf-8", "replace").strip()[:300]
