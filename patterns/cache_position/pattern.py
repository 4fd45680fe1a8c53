"""A static KV cache's write positions for this step, and the in-place advance of its length counter.

HF ``StaticLayer.update``: ``cache_position = arange(kv_length) + cumulative_length``, then
``cumulative_length.add_(kv_length)`` (a state written in place). The advanced counter is an output too: a cache
layer may read it after the advance (Inkling's attention: ``q_positions = arange(q_length) + q_offset`` with
``q_offset`` the counter just advanced); without it the match was refused there and its ops split the region.
"""
import torch

from fusegraph.codegen.api import lower_on_host, register_lowering
from fusegraph.matching import Input, register_pattern


@register_pattern(
    "fusegraph.cache_position",
    template="cache_position",
    priority=15,
    inputs=[Input("counter", "", dtype="int64", kind="state")],
    outputs=("positions", "advanced"),
    params={"length": 1},
    dtypes=("float32",),  # nothing here depends on the model's dtype
)
def cache_position(counter, *, length):
    """``positions = arange(length) + counter; counter += length`` (the advanced counter returned too)."""
    positions = torch.arange(length) + counter
    advanced = counter.add_(length)
    return positions, advanced


register_lowering(cache_position, host_side=True)(lower_on_host)
