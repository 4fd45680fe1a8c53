"""The cache position of the step (from the layer-0 cache counter): host-side on purpose.

One folder, one op: its pattern(s), instruction, lowering, templates and torch reference (docs/patterns.md).
"""
from . import pattern  # noqa: F401  (registration)
