"""Error types of the NKI interpreter.

Every rule violation names the rule (a short stable identifier such as ``partition-dim``) and the kernel
source location of the offending call, so that codegen, tests and LLM-written kernels get actionable
feedback.  ``NkiValidationError`` has the name of the official ``nki.isa.NkiValidationError`` and is exposed
under that name inside ``as_nki``.
"""

from __future__ import annotations


class NkiSimError(Exception):
    """Base class of every error raised by fusegraph's NKI interpreter."""

    def __init__(self, message: str, rule: str = "error", location: str | None = None):
        self.rule = rule
        self.location = location
        self.detail = message
        text = f"[{rule}] {message}"
        if location:
            text += f" (at {location})"
        super().__init__(text)


class NkiValidationError(NkiSimError):
    """A hardware or API rule was violated (the official name of this error class)."""


class NkiCapacityError(NkiValidationError):
    """SBUF or PSUM capacity (per partition) was exceeded."""


class NkiUsageError(NkiSimError, TypeError):
    """The interpreter was used wrongly (e.g. an NKI API called outside a kernel run, bad argument types)."""


class NkiSyncError(NkiSimError):
    """A cross-program / cross-rank synchronisation failed (deadlock, mismatched sendrecv, peer failure)."""


class NkiNotImplementedError(NkiSimError, NotImplementedError):
    """An official API the interpreter does not implement (or a documented mode it does not model)."""
