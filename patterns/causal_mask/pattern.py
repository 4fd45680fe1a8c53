"""HF's decode-time causal mask over a static cache (``masking_utils.sdpa_mask`` / ``eager_mask``).

Query position = ``arange(1) + cache length`` (the layer-0 cache counter), key positions = ``arange(kv_length)``;
allowed where ``kv_idx <= q_idx``. The eager form makes it additive (0 / dtype min); the SDPA form keeps the
boolean mask (SDPA turns it into -inf itself, inside :mod:`.decode_attention`). Sliding-window or chunked masks
add ops and are reported unmatched.
"""
import torch

from fusegraph.codegen.api import lower_on_host, register_lowering
from fusegraph.matching import Input, register_pattern

COUNTER = Input("cache_len", "", dtype="int64")  # the layer-0 cache counter (a state, read-only here)


def _allowed(cache_len, kv_length, batch):
    q_idx = torch.arange(1) + cache_len
    kv_idx = torch.arange(kv_length) + 0
    allowed = kv_idx[None, None, None, :] <= q_idx[None, None, :, None]
    return allowed.expand(batch, -1, 1, kv_length)


@register_pattern(
    "fusegraph.causal_mask",
    template="causal_mask",
    block="prologue",
    priority=15,
    inputs=[COUNTER],
    outputs=("mask",),
    params={"kv_length": 16, "batch": 2},
    cases=[{"batch": 1, "form": "additive"}, {"form": "additive"}],
)
def causal_mask(cache_len, *, kv_length, batch, dtype):
    """Additive mask ``[batch, 1, 1, kv_length]``: 0 where ``kv_idx <= cache_len``, ``finfo(dtype).min`` after."""
    allowed = _allowed(cache_len, kv_length, batch)
    return torch.where(allowed, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)


@causal_mask.implementation("boolean", dtypes=["float32"], cases=[{"batch": 1, "form": "boolean"}, {"form": "boolean"}])
def _boolean(cache_len, *, kv_length, batch):
    return _allowed(cache_len, kv_length, batch)


register_lowering(causal_mask, host_side=True)(lower_on_host)
