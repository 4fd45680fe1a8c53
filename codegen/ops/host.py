"""Host-side on purpose: rotary tables, the attention mask and cache positions stay on the eager path.

Computing them on chip would cost range-reduced ``sin``/``cos`` or iota chains for tensors of a few hundred
bytes; the kernel reads them as per-step inputs instead (the ops that use them load them once per step).
"""
from __future__ import annotations

from typing import Any

from ..lowering import Lowerer
from ..registry import register_lowering


@register_lowering("rope_tables", "causal_mask", "cache_position", host_side=True)
def lower_on_host(L: Lowerer, m: Any) -> None:
    L.host(m)
