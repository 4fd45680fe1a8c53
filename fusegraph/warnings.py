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


def reset_warnings() -> None:
    _seen.clear()
