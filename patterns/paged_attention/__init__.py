"""Paged KV caches (vLLM's layout): the write of the step's rows into the block pool, and decode attention over
each sequence's blocks in table order (the streamed attention of :mod:`fusegraph.patterns.attention`, reading
its blocks through the table).

One folder, one op: its pattern(s), instructions, lowering, templates and torch reference (docs/patterns.md).
"""
from pathlib import Path

from fusegraph.codegen.api import add_template_dir

add_template_dir(Path(__file__).parent / "templates")

from . import pattern, lowering  # noqa: E402,F401  (registration)
