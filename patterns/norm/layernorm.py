"""LayerNorm over the hidden state: ``layer_norm(x, (H,), weight, bias, eps)``.

Decoders that use it instead of RMSNorm: StableLM, Phi(-2), GPT-NeoX/Pythia, Falcon, Persimmon (``nn.LayerNorm``,
with bias), OLMo (no weight, no bias), Cohere (its own fp32 formula, no bias). Lowered by the RMSNorm template with the
mean subtracted first (``ir.RMSNorm(center=True)``), in fp32, rounded once like ``torch.nn.functional.layer_norm``.
"""
import torch

from fusegraph.matching import Input, register_pattern

from .._checks import norm_weight

X = Input("x", "T H")
W = Input("weight", "H", kind="weight")
B = Input("bias", "H", kind="weight")


def _check(m):
    if "weight" not in m.inputs:  # no affine transform (OLMo's LayerNorm)
        return True
    ok = norm_weight(m)
    if ok is not True:
        return ok
    w, b = m.inputs["weight"], m.inputs.get("bias")
    if b is not None and tuple(b.shape) != tuple(w.shape):
        return f"bias {b.shape} does not match weight {w.shape}"
    return True


@register_pattern(
    "fusegraph.layernorm",
    template="layernorm",
    priority=20,
    inputs=[X, W, B],
    params={"eps": 1e-5},
    dims={"T": (3, 5), "H": (16, 40)},
    check=_check,
)
def layernorm(x, weight, bias=None, *, eps):
    """``torch.nn.functional.layer_norm(x, (H,), weight, bias, eps)``."""
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)


@layernorm.implementation("nobias", inputs=[X, W])
def _nobias(x, weight, *, eps):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, None, eps)


@layernorm.implementation("noaffine", inputs=[X])
def _noaffine(x, *, eps):
    """OLMo's ``OlmoLayerNorm``: ``layer_norm(x, (H,), None, None, eps)`` (no weight, no bias)."""
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), None, None, eps)


@layernorm.implementation("fp32_formula", inputs=[X, W])
def _fp32_formula(x, weight, *, eps):
    """Cohere's ``CohereLayerNorm``: mean and variance in fp32, weight applied in fp32, then cast back."""
    dtype = x.dtype
    h = x.to(torch.float32)
    mean = h.mean(-1, keepdim=True)
    variance = (h - mean).pow(2).mean(-1, keepdim=True)
    h = (h - mean) * torch.rsqrt(variance + eps)
    return (weight.to(torch.float32) * h).to(dtype)
