"""The KV-cache write of the step's row at its runtime position (in place in HBM), and the sliding-window
cache's roll (the window moves up one row, the new row goes last).

One folder, one op: its pattern(s), instruction, lowering, templates and torch reference (docs/patterns.md).
"""
from pathlib import Path

from fusegraph.codegen.api import add_template_dir

add_template_dir(Path(__file__).parent / "templates")

from . import kv_cache_update, sliding_window_cache, lowering  # noqa: E402,F401  (registration)
