"""A local OpenAI-compatible chat server (http.server in a thread on 127.0.0.1, random port) that replays
scripted answers and records every request, for testing the LLM kernel writer without a model."""
from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Status:
    """Answer with an HTTP error instead of a completion."""

    code: int
    message: str


@dataclass
class Slow:
    """Answer after a delay (for client timeouts)."""

    seconds: float
    text: str


@dataclass
class Trickle:
    """Answer one byte every ``interval`` seconds (a slow or hostile endpoint); ``head``: trickle the status
    line and headers too, else they arrive at once and only the body trickles."""

    interval: float
    text: str
    head: bool = False


class FakeLLM:
    def __init__(self, answers: list) -> None:
        self.answers = list(answers)
        self.requests: list[dict] = []
        self.paths: list[str] = []
        self.headers: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                fake.paths.append(self.path)
                fake.headers.append(dict(self.headers))
                try:
                    req = json.loads(body)
                except ValueError:
                    req = {"raw": body.decode("utf-8", "replace")}
                fake.requests.append(req)
                if not self.path.endswith("/chat/completions"):
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                if not fake.answers:
                    return self._send(500, {"error": {"message": "no scripted answer left"}})
                ans = fake.answers.pop(0)
                if isinstance(ans, Status):
                    return self._send(ans.code, {"error": {"message": ans.message}})
                if isinstance(ans, Slow):
                    time.sleep(ans.seconds)
                    ans = ans.text
                if isinstance(ans, bytes):
                    return self._send_raw(200, ans)
                if isinstance(ans, Trickle):
                    return self._trickle(ans)
                prompt_chars = sum(len(m.get("content", "")) for m in req.get("messages", []))
                usage = {"prompt_tokens": prompt_chars // 4, "completion_tokens": len(ans) // 4,
                         "total_tokens": prompt_chars // 4 + len(ans) // 4}
                self._send(200, {"id": f"cmpl-{len(fake.requests)}", "object": "chat.completion",
                                 "model": req.get("model"), "usage": usage,
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": ans}}]})

            def _trickle(self, t: Trickle) -> None:
                body = json.dumps({"choices": [{"index": 0, "finish_reason": "stop",
                                                "message": {"role": "assistant", "content": t.text}}]}).encode()
                head = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                        f"\r\n").encode()
                data = body if not t.head else head + body
                try:
                    if not t.head:
                        self.wfile.write(head)
                        self.wfile.flush()
                    for i in range(len(data)):
                        self.wfile.write(data[i:i + 1])
                        self.wfile.flush()
                        time.sleep(t.interval)
                except OSError:
                    pass  # the client gave up
                self.close_connection = True

            def _send(self, code: int, payload: dict) -> None:
                self._send_raw(code, json.dumps(payload).encode())

            def _send_raw(self, code: int, data: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up (timeout tests)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> "FakeLLM":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def refused_url() -> str:
    """A loopback URL nobody listens on (connection refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}/v1"
