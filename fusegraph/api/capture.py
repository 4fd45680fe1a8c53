"""``fusegraph.capture_step``: compile a step with the fusegraph backend, run it once, return what was captured."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ..backend import fusegraph_backend
from ..capture.session import CaptureSession, explicit_session, last_session
from ..capture.summary import format_summary, summarize
from ..program import Program
from ..settings import Settings


@dataclass
class Capture:
    """The result of :func:`capture_step`: the linked program of one step, how it was captured, and its outputs."""

    program: Program
    session: CaptureSession
    outputs: Any = None
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return summarize(self.session)

    def format(self) -> str:
        return format_summary(self.summary())


def capture_step(fn: Callable | torch.nn.Module, *args: Any, options: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> Capture:
    """Compile ``fn`` with the fusegraph backend, run it once on the inputs, and return what was captured.

    Runs under ``torch.no_grad()`` (fusegraph fuses inference steps) and resets dynamo's cache first so the
    capture is fresh even if ``fn`` was compiled before.
    """
    settings = Settings.from_options(options)
    session = CaptureSession(settings=settings, name="capture")
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=fusegraph_backend, options=dict(options or {}) or None, dynamic=False)
    with explicit_session(session), torch.no_grad():
        out = compiled(*args, **kwargs)
    return Capture(program=session.program, session=session, outputs=out, extra={"compiled": compiled})


def last_capture() -> Capture | None:
    """What the backend captured most recently (for code that called ``torch.compile`` itself)."""
    s = last_session()
    return Capture(program=s.program, session=s) if s else None
