"""RMSNorm as HF Llama / Qwen / Mistral / Qwen3 (also q/k-norm) write it: normalize in fp32, cast back, scale."""
import torch

from fusegraph.matching import Input, register_pattern

from .._checks import norm_weight


@register_pattern(
    "fusegraph.rmsnorm",
    template="rmsnorm",
    priority=20,
    inputs=[Input("x", "T H"), Input("weight", "H", kind="weight")],
    params={"eps": 1e-6},
    dims={"T": (3, 5), "H": (16, 40)},
    check=norm_weight,
)
def rmsnorm(x, weight, *, eps):
    """``weight * (x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype)``."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


@rmsnorm.implementation("fp32_weight", dtypes=["bfloat16", "float16"])
def _fp32_weight(x, weight, *, eps):
    """OLMo-2 (``Olmo2RMSNorm``: ``(self.weight * hidden_states).to(input_dtype)``): the weight product in fp32
    (type promotion), one rounding at the end, where HF Llama rounds before the product."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return (weight * h).to(input_dtype)


@rmsnorm.implementation("fp32_weight_cast", dtypes=["bfloat16", "float16"])
def _fp32_weight_cast(x, weight, *, eps):
    """The same math with the weight cast explicitly (keras-hub's ``LlamaLayerNorm``/``MixtralLayerNormalization``
    as XLA writes it: ``convert(w)``, multiply, ``convert``)."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return (h * weight.float()).to(input_dtype)
