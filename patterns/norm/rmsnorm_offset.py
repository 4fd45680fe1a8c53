"""RMSNorm with a ``(offset + weight)`` scale computed in fp32 (Gemma, Gemma2/3, Qwen3-Next: offset 1.0).

Not the same math as :mod:`.rmsnorm` (the scale is applied before the cast back, and shifted), so it is its own
pattern with its own template; plain RMSNorm refuses these sites because its ``weight`` must be a parameter.
"""
import torch

from fusegraph.matching import Input, register_pattern

from .._checks import norm_weight


@register_pattern(
    "fusegraph.rmsnorm_offset",
    template="rmsnorm_offset",
    priority=21,
    inputs=[Input("x", "T H"), Input("weight", "H", kind="weight")],
    params={"eps": 1e-6, "offset": 1.0},
    dims={"T": (3, 5), "H": (16, 40)},
    check=norm_weight,
)
def rmsnorm_offset(x, weight, *, eps, offset):
    """``(x.float() * rsqrt(mean(x.float()**2, -1) + eps) * (offset + weight.float())).to(x.dtype)``."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h * (offset + weight.float())
    return h.type_as(x)
