"""keras-hub's JAX LLMs (Keras 3 on its JAX backend) as clients of fusegraph's JAX frontend: models written by
others, built from configs with random weights, decoded with their own ``call_with_cache``.

``keras_hub`` must run on the JAX backend: this module sets ``KERAS_BACKEND=jax`` before importing Keras and
refuses a Keras already imported with another backend. Weights are passed to the step as arguments (through
``keras.StatelessScope``), so they are the program's weights, not constants baked into StableHLO.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from .models import JaxDecodeCase

#: tiny configs (the torch side's TINY_DIMS: hidden 256, 2 layers, GQA 4q/2kv, vocabulary 1000)
KERAS_MODELS: dict[str, dict[str, Any]] = {
    "keras-llama-tiny": dict(cls="LlamaBackbone", lm="LlamaCausalLM", vocabulary_size=1000, num_layers=2,
                             num_query_heads=4, num_key_value_heads=2, hidden_dim=256, intermediate_dim=512,
                             layer_norm_epsilon=1e-6, rope_max_wavelength=10000),
    "keras-mixtral-tiny": dict(cls="MixtralBackbone", lm="MixtralCausalLM", vocabulary_size=1000, num_layers=2,
                               num_query_heads=4, num_key_value_heads=2, hidden_dim=256, intermediate_dim=512,
                               num_experts=8, top_k=2, layer_norm_epsilon=1e-6, rope_max_wavelength=10000),
}


def _keras():
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras

    if keras.backend.backend() != "jax":
        raise RuntimeError(f"Keras is running on the {keras.backend.backend()} backend; set KERAS_BACKEND=jax "
                           "before Keras is first imported")
    import keras_hub

    return keras, keras_hub


def build_keras_case(name: str, *, dtype: str = "float32", batch: int = 1, prompt_len: int = 8,
                     max_cache_len: int = 32, seed: int = 0) -> JaxDecodeCase:
    """A keras-hub causal LM with random weights, prefilled with ``prompt_len`` random tokens by its own
    ``call_with_cache`` under plain ``jax.jit``; ``case.step(params, cache, token, index)`` is its decode step."""
    import jax
    import jax.numpy as jnp

    if name not in KERAS_MODELS:
        raise KeyError(f"unknown keras-hub model {name!r}; known: {', '.join(KERAS_MODELS)}")
    keras, keras_hub = _keras()
    cfg = dict(KERAS_MODELS[name])
    backbone_cls = getattr(keras_hub.models, cfg.pop("cls"))
    lm_cls = getattr(keras_hub.models, cfg.pop("lm"))
    keras.utils.set_random_seed(seed)
    backbone = backbone_cls(**cfg, dtype=dtype)
    lm = lm_cls(backbone=backbone, preprocessor=None)
    variables = list(lm.variables)

    def step(params, cache, token, index):
        with keras.StatelessScope(state_mapping=[(v, params[v.path]) for v in variables]):
            logits, _, new_cache = lm.call_with_cache(token, cache, index)
        return logits, new_cache

    params = {v.path: jnp.asarray(v.value) for v in variables}  # named leaves: weights keep Keras's paths
    head_dim = cfg["hidden_dim"] // cfg["num_query_heads"]
    cache = jnp.zeros((batch, cfg["num_layers"], 2, max_cache_len, cfg["num_key_value_heads"], head_dim),
                      dtype=keras.backend.standardize_dtype(lm.compute_dtype))
    rng = np.random.default_rng(seed + 1)
    prompt = rng.integers(0, cfg["vocabulary_size"], (batch, prompt_len)).astype(np.int32)
    run = jax.jit(step)
    logits = None
    for t in range(prompt_len):
        logits, cache = run(params, cache, jnp.asarray(prompt[:, t:t + 1]), jnp.asarray(t, jnp.int32))
    token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
    return JaxDecodeCase(name=name, step=step, params=params, cache=cache, token=token,
                         position=jnp.asarray(prompt_len, jnp.int32), dtype=dtype,
                         info={"config": KERAS_MODELS[name], "variables": [v.path for v in variables]})
