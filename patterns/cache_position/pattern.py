"""A static KV cache's write positions for this step, and the in-place advance of its length counter.

HF ``StaticLayer.update``: ``cache_position = arange(kv_length) + cumulative_length``, then
``cumulative_length.add_(kv_length)`` (a state written in place).
"""
import torch

from fusegraph.codegen.api import lower_on_host, register_lowering
from fusegraph.matching import Input, register_pattern


@register_pattern(
    "fusegraph.cache_position",
    template="cache_position",
    priority=15,
    inputs=[Input("counter", "", dtype="int64", kind="state")],
    outputs=("positions",),
    params={"length": 1},
    dtypes=("float32",),  # nothing here depends on the model's dtype
)
def cache_position(counter, *, length):
    """``positions = arange(length) + counter; counter += length``."""
    positions = torch.arange(length) + counter
    counter.add_(length)
    return positions


register_lowering(cache_position, host_side=True)(lower_on_host)
