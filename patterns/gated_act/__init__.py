"""Gated activation ``act(gate) * up`` (SwiGLU, GeGLU, ...) of two activations.

One folder, one op: its pattern(s), instruction, lowering, templates and torch reference (docs/patterns.md).
"""
from pathlib import Path

from fusegraph.codegen.api import add_template_dir

add_template_dir(Path(__file__).parent / "templates")

from . import swiglu, lowering  # noqa: E402,F401  (registration)
