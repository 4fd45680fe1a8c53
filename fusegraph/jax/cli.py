"""``fusegraph report --frontend jax --model NAME``: the JAX counterpart of the torch report command."""
from __future__ import annotations

import json
from typing import Any

from ..capture.summary import format_summary, summarize
from ..perf.progress import UsageError
from .frontend import jit

JAX_MODELS = {
    "llama-tiny": "hand-written JAX Llama step (fusegraph.jax.models), 2 layers, hidden 256, GQA 4q/2kv",
    "keras-llama-tiny": "keras-hub LlamaCausalLM (Keras 3, JAX backend), 2 layers, hidden 256, GQA 4q/2kv",
    "keras-mixtral-tiny": "keras-hub MixtralCausalLM (MoE, 8 experts top-2), 2 layers, hidden 256",
}


def build_case(name: str, dtype: str | None = None, batch: int = 1, max_cache_len: int = 32, layers: int | None = None):
    """A JAX decode case by name (``JAX_MODELS``)."""
    dtype = dtype or "float32"
    if name == "llama-tiny":
        from dataclasses import replace

        from .models import LlamaConfig, build_llama_case

        cfg = LlamaConfig(max_cache_len=max_cache_len)
        if layers is not None:
            cfg = replace(cfg, num_layers=layers)
        return build_llama_case(cfg, dtype=dtype, batch=batch)
    if name in JAX_MODELS:
        from .keras_models import build_keras_case

        return build_keras_case(name, dtype=dtype, batch=batch, max_cache_len=max_cache_len)
    raise UsageError(f"unknown JAX model {name!r}; known: {', '.join(JAX_MODELS)}")


def cmd_report_jax(args: Any, options: dict[str, Any]) -> int:
    """Fuse a JAX model's decode step, run two steps against jax.jit, print the capture and the report."""
    import jax
    import jax.numpy as jnp

    model = args.model
    if model not in JAX_MODELS:  # checked before jax builds anything (no silent substitute)
        raise UsageError(f"unknown JAX model {model!r} for --frontend jax; known: {', '.join(JAX_MODELS)}")
    case = build_case(model, args.dtype, args.batch, args.max_cache_len, args.layers)
    fused = jit(case.step, donate_argnums=(1,), options=options)
    ref = jax.jit(case.step)
    params, cache, tok, pos = case.args()
    rcache = cache
    diffs = []
    for _ in range(2):  # the first call is verified against jax.jit; the second shows the fused step itself
        out, cache = fused(params, cache, tok, pos)
        rout, rcache = ref(params, rcache, tok, pos)
        diffs.append(float(jnp.abs(out.astype(jnp.float32) - rout.astype(jnp.float32)).max()))
        tok = jnp.argmax(rout[:, -1], -1).astype(jnp.int32)[:, None]
        pos = pos + 1
    c = fused.last
    print(f"model {model} (JAX: {JAX_MODELS[model]}, {case.dtype}, batch {args.batch})")
    if c.fallback is not None:
        print(f"fusegraph did not fuse this step: {c.reason}; it ran as plain jax.jit")
        return 0
    print(f"StableHLO: {c.imported.stablehlo_ops} ops -> " + format_summary(summarize(c.session)))
    print(f"fused vs jax.jit: step 1 max |diff| = {diffs[0]:.3g}; step 2 max |diff| = {diffs[1]:.3g} "
          f"(logit scale {float(jnp.abs(rout).max()):.3g})")
    report = c.report()
    print(report.format())
    if args.json:
        data = report.to_dict()
        data["check"] = {"max_abs_diff_vs_jax": diffs[0], "step2_max_abs_diff_vs_jax": diffs[1]}
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2, default=str)
        print(f"wrote {args.json}")
    return 0
