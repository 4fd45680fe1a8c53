"""Grouped-query decode attention over the static KV cache (+ Gemma 2 soft-capping): the whole-row template for
short caches, the streamed (flash-decoding) one for long ones, bounded by each sequence's position.

One folder, one op: its pattern(s), instruction, lowering, templates and torch reference (docs/patterns.md).
"""
from pathlib import Path

from fusegraph.codegen.api import add_template_dir

add_template_dir(Path(__file__).parent / "templates")

from . import decode_attention, lowering  # noqa: E402,F401  (registration)
