"""User-facing warnings: one line, naming the cause, saying what fusegraph does instead."""
from __future__ import annotations

import logging
import warnings

log = logging.getLogger("fusegraph")


class FusegraphWarning(UserWarning):
    """fusegraph could not do something and fell back to a slower but correct path."""


_seen: set[str] = set()


def warn(message: str) -> None:
    """Emit ``fusegraph: <message>`` once per distinct message per process."""
    text = f"fusegraph: {message}"
    log.debug(text)
    if text in _seen:
        return
    _seen.add(text)
    warnings.warn(text, FusegraphWarning, stacklevel=3)


def one_line(e: BaseException) -> str:
    """``Type: first line of the message``: how a warning names an exception."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def reset_warnings() -> None:
    _seen.clear()
