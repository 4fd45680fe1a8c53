"""Projection ``x @ W^T (+ b)`` by a weight (streamed from HBM in chunks, the next prefetched); it provides the
``projection`` service the core's generic lowering uses for a matmul inside a traced body.

One folder, one op: its pattern(s), instruction, lowering, templates and torch reference (docs/patterns.md).
"""
from pathlib import Path

from fusegraph.codegen.api import add_template_dir

add_template_dir(Path(__file__).parent / "templates")

from . import pattern, lowering  # noqa: E402,F401  (registration)
