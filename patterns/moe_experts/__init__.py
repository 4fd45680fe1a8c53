"""Mixture-of-experts experts: the chosen experts' gated MLPs weighted by the router, only the chosen experts'
weights read; and the expert-parallel form (each rank its experts, the tokens routed by rank).

One folder, one op: its pattern(s), instruction, lowering, templates and torch reference (docs/patterns.md).
"""
from pathlib import Path

from fusegraph.codegen.api import add_template_dir

add_template_dir(Path(__file__).parent / "templates")

from . import moe_experts, moe_experts_ep, lowering, lowering_ep  # noqa: E402,F401  (registration)
