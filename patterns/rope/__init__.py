"""Rotary position embedding of q/k heads: half-rotation (Llama), interleaved pairs (GPT-J, GLM) and partial
rotary dims, from the step's cos/sin tables.

One folder, one op: its pattern(s), instruction, lowering, templates and torch reference (docs/patterns.md).
"""
from pathlib import Path

from fusegraph.codegen.api import add_template_dir

add_template_dir(Path(__file__).parent / "templates")

from . import rope, rope_interleaved, rope_partial, lowering  # noqa: E402,F401  (registration)
