"""The causal attention mask of the step: host-side on purpose (the kernel reads it as a per-step input).

One folder, one op: its pattern(s), instruction, lowering, templates and torch reference (docs/patterns.md).
"""
from . import pattern  # noqa: F401  (registration)
