"""LayerNorm with a ``weight + offset`` scale (Nemotron's ``NemotronLayerNorm1P``: ``layer_norm(x, (H,), weight +
1, bias, eps)``, the weight stored as its difference from 1).

Its own pattern because :mod:`.layernorm` refuses these sites (its ``weight`` must be a parameter, here it is
computed from one). Lowered by the LayerNorm lowering with the instruction's ``weight_offset``: the kernel adds the
offset in fp32 where eager adds it in the weight's dtype (the same in fp32; in bf16 within its rounding).
"""
import torch

from fusegraph.matching import Input, register_pattern

from .._checks import norm_weight

X = Input("x", "T H")
W = Input("weight", "H", kind="weight")
B = Input("bias", "H", kind="weight")


@register_pattern(
    "fusegraph.layernorm_offset",
    template="layernorm",
    priority=21,
    inputs=[X, W, B],
    params={"eps": 1e-5, "offset": 1.0},
    dims={"T": (3, 5), "H": (16, 40)},
    check=norm_weight,
)
def layernorm_offset(x, weight, bias=None, *, eps, offset):
    """``torch.nn.functional.layer_norm(x, (H,), weight + offset, bias, eps)``."""
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight + offset, bias, eps)


@layernorm_offset.implementation("nobias", inputs=[X, W])
def _nobias(x, weight, *, eps, offset):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight + offset, None, eps)
