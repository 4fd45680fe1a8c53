"""Partial rotary embedding: RoPE on the first ``R`` features of each head, the rest passed through.

HF writes it as ``rot, rest = x[..., :R], x[..., R:]`` then ``cat((rope(rot), rest), -1)`` (Phi-3 configs with
``partial_rotary_factor`` < 1 such as Phi-4-mini, StableLM, Phi, GPT-NeoX style models). With ``R`` equal to the
head size canonicalization folds the empty pass-through and :mod:`.rope` matches instead. Lowered by the same
``rope`` template: cos is padded with 1 and sin with 0 past ``R``, and the rotation matrix is zero there.
"""
import torch

from fusegraph.matching import Input, register_pattern

from .rope import rotate_half


def _check(m):
    x, cos = m.inputs["x"], m.inputs["cos"]
    if x.shape is None or cos.shape is None:
        return "unknown shapes"
    R, D = cos.shape[-1], x.shape[-1]
    if not 0 < R < D or R % 2:
        return f"rotary dim {R} must be even and smaller than the head size {D}"
    return True


@register_pattern(
    "fusegraph.rope_partial",
    template="rope",
    priority=16,
    inputs=[Input("x", "B N S D"), Input("cos", "B 1 S R"), Input("sin", "B 1 S R")],
    dims={"B": (1, 2), "N": (3, 5), "S": (1, 3), "D": (12, 22), "R": (8, 12)},
    check=_check,
)
def rope_partial(x, cos, sin):
    """``cat((x[..., :R] * cos + rotate_half(x[..., :R]) * sin, x[..., R:]), -1)`` with ``R = cos.shape[-1]``."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat(((rot * cos) + (rotate_half(rot) * sin), rest), dim=-1)
