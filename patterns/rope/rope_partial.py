"""Partial rotary embedding: RoPE on the first ``R`` features of each head, the rest passed through.

HF writes it as ``rot, rest = x[..., :R], x[..., R:]`` then ``cat((rope(rot), rest), -1)`` (Phi-3 configs with
``partial_rotary_factor`` < 1 such as Phi-4-mini, StableLM, Phi, GPT-NeoX style models). With ``R`` equal to the
head size canonicalization folds the empty pass-through and :mod:`.rope` matches instead. Lowered by the same
``rope`` template: cos is padded with 1 and sin with 0 past ``R``, and the rotation matrix is zero there.
"""
import torch

from fusegraph.matching import Input, register_pattern

from .._checks import partial_rotary
from .rope import rotate_half


@register_pattern(
    "fusegraph.rope_partial",
    template="rope",
    priority=16,
    inputs=[Input("x", "B N S D"), Input("cos", "B 1 S R"), Input("sin", "B 1 S R")],
    dims={"B": (1, 2), "N": (3, 5), "S": (1, 3), "D": (12, 22), "R": (8, 12)},
    check=partial_rotary,
)
def rope_partial(x, cos, sin):
    """``cat((x[..., :R] * cos + rotate_half(x[..., :R]) * sin, x[..., R:]), -1)`` with ``R = cos.shape[-1]``."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat(((rot * cos) + (rotate_half(rot) * sin), rest), dim=-1)
