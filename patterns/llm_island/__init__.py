"""An island of ops no pattern matches, lowered by an NKI-writing LLM (every answer verified against eager
before it is inlined); no pattern of its own: the LLM fallback makes its matches.

One folder, one op: its pattern(s), instruction, lowering, templates and torch reference (docs/patterns.md).
"""
from pathlib import Path

from fusegraph.codegen.api import add_template_dir

add_template_dir(Path(__file__).parent / "templates")

from . import lowering  # noqa: E402,F401  (registration)
