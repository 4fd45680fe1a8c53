"""Errors codegen raises. Every one of them ends in a warning naming the region and the eager fallback."""


class CodegenError(Exception):
    """The region cannot be turned into an NKI kernel (unsupported shape, dtype, pattern or budget)."""


class BudgetError(CodegenError):
    """The kernel does not fit the target's SBUF/PSUM budget."""
