"""Errors codegen raises. Every one of them ends in a warning naming the region and the eager fallback."""
from __future__ import annotations

from typing import Any


class CodegenError(Exception):
    """The region cannot be turned into an NKI kernel (unsupported shape, dtype, pattern or budget).

    ``match`` is the match whose lowering failed and ``instructions`` the instructions whose emission failed,
    when one piece of the region is the cause: the caller keeps the rest of the region in the kernel and sends
    only that piece to the eager path. Both are empty when the kernel as a whole failed (its budget, say)."""

    match: Any = None
    instructions: tuple[Any, ...] = ()
    causes: tuple[str, ...] = ()  # one message per failed instruction


class BudgetError(CodegenError):
    """The kernel does not fit the target's SBUF/PSUM budget."""
