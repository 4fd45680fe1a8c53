"""The rotary cos/sin tables of the step's positions: host-side on purpose (a few hundred bytes per step;
on chip they would cost range-reduced sin/cos); the kernel reads them as per-step inputs.

One folder, one op: its pattern(s), instruction, lowering, templates and torch reference (docs/patterns.md).
"""
from . import pattern  # noqa: F401  (registration)
