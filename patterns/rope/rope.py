"""Rotary position embedding applied to q or k, HF's ``rotate_half`` convention."""
import torch

from fusegraph.matching import Input, register_pattern


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


@register_pattern(
    "fusegraph.rope",
    template="rope",
    priority=15,
    inputs=[Input("x", "B N S D"), Input("cos", "B 1 S D"), Input("sin", "B 1 S D")],
    dims={"B": (1, 2), "N": (3, 5), "S": (1, 3), "D": (8, 20)},
)
def rope(x, cos, sin):
    """``x * cos + rotate_half(x) * sin`` (cos/sin already broadcastable to x)."""
    return (x * cos) + (rotate_half(x) * sin)
