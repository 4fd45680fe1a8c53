"""Rotary embedding on interleaved pairs ``(x[2i], x[2i+1])`` (GPT-J convention: Cohere, GLM, GLM-4).

``rotate(x) = stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)`` with cos/sin repeated per pair. Two patterns:
the whole head (Cohere, which also computes it in fp32: its own implementation) and a partial rotary dim (GLM:
``cat((rope(x[..., :R]), x[..., R:]), -1)``). Lowered by the ``rope`` template with a pair-rotation matrix.
"""
import torch

from fusegraph.matching import Input, register_pattern

from .._checks import partial_rotary


def rotate_pairs(x):
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


@register_pattern(
    "fusegraph.rope_interleaved",
    template="rope_interleaved",
    priority=15,
    inputs=[Input("x", "B N S D"), Input("cos", "B 1 S D"), Input("sin", "B 1 S D")],
    dims={"B": (1, 2), "N": (3, 5), "S": (1, 3), "D": (8, 20)},
)
def rope_interleaved(x, cos, sin):
    """``x * cos + rotate_pairs(x) * sin``."""
    return (x * cos) + (rotate_pairs(x) * sin)


@rope_interleaved.implementation("fp32", dtypes=["bfloat16"])
def _fp32(x, cos, sin):
    """Cohere: q/k upcast to fp32, the result cast back."""
    dtype = x.dtype
    x = x.float()
    return ((x * cos) + (rotate_pairs(x) * sin)).to(dtype)


@register_pattern(
    "fusegraph.rope_interleaved_partial",
    template="rope_interleaved",
    priority=16,
    inputs=[Input("x", "B N S D"), Input("cos", "B 1 S R"), Input("sin", "B 1 S R")],
    dims={"B": (1, 2), "N": (3, 5), "S": (1, 3), "D": (12, 22), "R": (8, 12)},
    check=partial_rotary,
)
def rope_interleaved_partial(x, cos, sin):
    """``cat((rope_interleaved(x[..., :R]), x[..., R:]), -1)`` with ``R = cos.shape[-1]``."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat(((rot * cos) + (rotate_pairs(rot) * sin), rest), dim=-1)
