"""Built-in fusion patterns (installed as ``fusegraph.patterns``), one fusion per module.

They use only the public API (:mod:`fusegraph.matching`), exactly like a third-party plugin would; importing this
package registers them. ``docs/patterns.md`` documents the contract of each (inputs, params, outputs, template).
"""
from . import (  # noqa: F401  (imported for registration)
    cache_position,
    causal_mask,
    decode_attention,
    embedding,
    kv_cache_update,
    layernorm,
    linear,
    moe_experts,
    moe_router,
    residual_add,
    rmsnorm,
    rmsnorm_offset,
    rope,
    rope_interleaved,
    rope_partial,
    rope_tables,
    sigmoid_gate,
    swiglu,
)
