"""A per-token sigmoid gate ``x * sigmoid(g)`` (Qwen3-Next / Qwen2-MoE shared-expert gates).

One folder, one op: its pattern(s), instruction, lowering, templates and torch reference (docs/patterns.md).
"""
from pathlib import Path

from fusegraph.codegen.api import add_template_dir

add_template_dir(Path(__file__).parent / "templates")

from . import pattern, lowering  # noqa: E402,F401  (registration)
