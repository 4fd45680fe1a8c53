"""Small JAX decode steps to run fusegraph's JAX frontend on (random weights, no downloads).

:func:`llama_step` is a hand-written Llama-style decode step in plain ``jax.numpy``/``lax``, written the way JAX
code is usually written (weights ``[in, out]`` used as ``x @ W``, ``jnp.repeat`` for grouped KV heads, the KV
cache written with ``lax.dynamic_update_slice``), not mirroring torch: it is the fast test client of the
StableHLO importer. Real library models live in :mod:`fusegraph.jax.keras_models`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 1000
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_cache_len: int = 32


@dataclass
class JaxDecodeCase:
    """A JAX decode step with everything needed to call it: ``step(params, cache, token, position)`` returns
    ``(logits[B, 1, V], new_cache)``; the cache (argument 1) is donated, so it is written in place."""

    name: str
    step: Callable[..., Any]
    params: Any
    cache: Any
    token: Any  # [B, 1] int32
    position: Any  # [B, 1] int32
    dtype: str
    info: dict = field(default_factory=dict)

    def args(self) -> tuple:
        return (self.params, self.cache, self.token, self.position)


def _rmsnorm(x, weight, eps):
    import jax.numpy as jnp

    h = x.astype(jnp.float32)
    variance = jnp.mean(jnp.square(h), axis=-1, keepdims=True)
    h = h * jax_rsqrt(variance + eps)
    return weight * h.astype(x.dtype)


def jax_rsqrt(x):
    from jax import lax

    return lax.rsqrt(x)


def _rotate_half(x):
    import jax.numpy as jnp

    half = x.shape[-1] // 2
    return jnp.concatenate((-x[..., half:], x[..., :half]), axis=-1)


def make_llama_step(cfg: LlamaConfig) -> Callable[..., Any]:
    """The decode step of a Llama-style model with a static KV cache ``[B, KV, L, D]`` per layer."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    groups = cfg.num_heads // cfg.num_kv_heads
    scale = cfg.head_dim ** -0.5
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float32) / cfg.head_dim))

    def step(params, cache, token, position):
        dtype = params["embed"].dtype
        b = token.shape[0]
        x = params["embed"][token]  # [B, 1, H]
        freqs = position[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
        emb = jnp.concatenate((freqs, freqs), axis=-1)
        cos = (jnp.cos(emb) * 1.0).astype(dtype)[:, None]  # [B, 1, 1, D]
        sin = (jnp.sin(emb) * 1.0).astype(dtype)[:, None]
        kv_pos = jnp.arange(cfg.max_cache_len)
        allowed = kv_pos[None, None, None, :] <= position[:, None, :, None]  # [B, 1, 1, L]
        mask = jnp.where(allowed, jnp.zeros((), dtype), jnp.finfo(dtype).min)
        start = position[0, 0]
        new_cache = []
        for i, layer in enumerate(params["layers"]):
            with jax.named_scope(f"layers.{i}"):
                residual = x
                h = _rmsnorm(x, layer["input_norm"], cfg.rms_norm_eps)
                with jax.named_scope("self_attn"):
                    q = (h @ layer["wq"]).reshape(b, 1, cfg.num_heads, cfg.head_dim).transpose(0, 2, 1, 3)
                    k = (h @ layer["wk"]).reshape(b, 1, cfg.num_kv_heads, cfg.head_dim).transpose(0, 2, 1, 3)
                    v = (h @ layer["wv"]).reshape(b, 1, cfg.num_kv_heads, cfg.head_dim).transpose(0, 2, 1, 3)
                    q = q * cos + _rotate_half(q) * sin
                    k = k * cos + _rotate_half(k) * sin
                    k_cache = lax.dynamic_update_slice(cache[i]["k"], k, (0, 0, start, 0))
                    v_cache = lax.dynamic_update_slice(cache[i]["v"], v, (0, 0, start, 0))
                    new_cache.append({"k": k_cache, "v": v_cache})
                    keys = jnp.repeat(k_cache, groups, axis=1)
                    values = jnp.repeat(v_cache, groups, axis=1)
                    scores = jnp.matmul(q, keys.transpose(0, 1, 3, 2)) * scale + mask
                    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(dtype)
                    attn = jnp.matmul(probs, values).transpose(0, 2, 1, 3).reshape(b, 1, -1)
                    x = residual + attn @ layer["wo"]
                residual = x
                h = _rmsnorm(x, layer["post_norm"], cfg.rms_norm_eps)
                with jax.named_scope("mlp"):
                    x = residual + (jax.nn.silu(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"]
        x = _rmsnorm(x, params["final_norm"], cfg.rms_norm_eps)
        return x @ params["lm_head"], new_cache

    return step


def llama_params(cfg: LlamaConfig, dtype: str = "float32", seed: int = 0) -> dict:
    """Random weights (normal, std 0.02 like HF's init; norms around 1)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)

    def w(*shape, std=0.02):
        return jnp.asarray(rng.normal(0.0, std, shape).astype(np.float32)).astype(dtype)

    def norm():
        return jnp.asarray(1.0 + rng.normal(0.0, 0.1, (cfg.hidden_size,)).astype(np.float32)).astype(dtype)

    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    layers = [{
        "input_norm": norm(), "post_norm": norm(),
        "wq": w(H, cfg.num_heads * D), "wk": w(H, cfg.num_kv_heads * D), "wv": w(H, cfg.num_kv_heads * D),
        "wo": w(cfg.num_heads * D, H), "w_gate": w(H, I), "w_up": w(H, I), "w_down": w(I, H),
    } for _ in range(cfg.num_layers)]
    return {"embed": w(cfg.vocab_size, H, std=1.0), "layers": layers, "final_norm": norm(),
            "lm_head": w(H, cfg.vocab_size)}


def empty_cache(cfg: LlamaConfig, batch: int, dtype: str) -> list:
    import jax.numpy as jnp

    shape = (batch, cfg.num_kv_heads, cfg.max_cache_len, cfg.head_dim)
    return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(cfg.num_layers)]


def build_llama_case(cfg: LlamaConfig | None = None, *, dtype: str = "float32", batch: int = 1,
                     prompt_len: int = 8, seed: int = 0) -> JaxDecodeCase:
    """The hand-written Llama step after a prefill of ``prompt_len`` random tokens (run one token at a time with
    plain ``jax.jit``), ready for the next decode step."""
    import jax
    import jax.numpy as jnp

    cfg = cfg or LlamaConfig()
    step = make_llama_step(cfg)
    params = llama_params(cfg, dtype, seed)
    cache = empty_cache(cfg, batch, dtype)
    rng = np.random.default_rng(seed + 1)
    prompt = rng.integers(0, cfg.vocab_size, (batch, prompt_len)).astype(np.int32)
    run = jax.jit(step)
    logits = None
    for t in range(prompt_len):
        tok = jnp.asarray(prompt[:, t:t + 1])
        pos = jnp.full((batch, 1), t, jnp.int32)
        logits, cache = run(params, cache, tok, pos)
    token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
    return JaxDecodeCase(name="llama-tiny", step=step, params=params, cache=cache, token=token,
                         position=jnp.full((batch, 1), prompt_len, jnp.int32), dtype=dtype, info={"config": cfg})
