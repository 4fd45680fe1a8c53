"""Token embedding (row gather of the table by the step's token ids), and its vocabulary-parallel form under
tensor parallelism (each rank its rows, masked, then all-reduced).

One folder, one op: its pattern(s), instruction, lowering, templates and torch reference (docs/patterns.md).
"""
from pathlib import Path

from fusegraph.codegen.api import add_template_dir

add_template_dir(Path(__file__).parent / "templates")

from . import embedding, vocab_parallel_embedding, lowering  # noqa: E402,F401  (registration)
