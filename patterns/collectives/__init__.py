"""Tensor-parallel all-reduce and all-gather (torch functional collectives, DTensor redistributions) inside
the kernel, across the ranks of the group.

One folder, one op: its pattern(s), instruction, lowering, templates and torch reference (docs/patterns.md).
"""
from pathlib import Path

from fusegraph.codegen.api import add_template_dir

add_template_dir(Path(__file__).parent / "templates")

import torch  # noqa: E402

from . import all_reduce, all_gather  # noqa: E402,F401  (registration)

if torch.distributed.is_available():  # the patterns exist only then; the lowering is given them
    from . import lowering  # noqa: F401
