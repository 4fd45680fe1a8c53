"""fusegraph's JAX frontend on its test clients (hand-written Llama step, keras-hub Llama and Mixtral).

    python benchmarks/bench_jax.py [--models llama-tiny,keras-llama-tiny,keras-mixtral-tiny] [--dtypes float32,bfloat16]
                                   [--steps 8] [--out bench-results/jax.json]

Per model and dtype (each in a fresh process): StableHLO ops, ATen ops, lower+import+build seconds, greedy tokens
equal to jax.jit, worst logit error relative to the logit scale, coverage, kernel launches per step, and the
seconds per fused step in the NKI interpreter.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _common import print_table, run_isolated, write_json  # noqa: E402


def measure(model: str, dtype: str, steps: str = "8") -> dict:
    import time
    import warnings

    import jax
    import jax.numpy as jnp

    import fusegraph.jax as fj
    from fusegraph.jax.cli import build_case

    case = build_case(model, dtype)
    fused = fj.jit(case.step, donate_argnums=(1,), options={"executor": "nkisim"})
    ref = jax.jit(case.step)
    params, cache, tok, pos = case.args()
    rcache, rtok = cache, tok
    t0 = time.perf_counter()
    fused.compile(params, cache, tok, pos)
    build = time.perf_counter() - t0
    equal, rel, step_s = True, 0.0, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(int(steps)):
            t1 = time.perf_counter()
            out, cache = fused(params, cache, tok, pos)
            step_s.append(time.perf_counter() - t1)
            rout, rcache = ref(params, rcache, rtok, pos)
            rel = max(rel, float(jnp.abs(out.astype(jnp.float32) - rout.astype(jnp.float32)).max()
                                 / jnp.abs(rout.astype(jnp.float32)).max()))
            tok = jnp.argmax(out[:, -1], -1).astype(jnp.int32)[:, None]
            rtok = jnp.argmax(rout[:, -1], -1).astype(jnp.int32)[:, None]
            equal = equal and bool((tok == rtok).all())
            pos = pos + 1
    c = fused.last
    row = {"model": model, "dtype": dtype, "tokens_equal": equal, "max_rel_logit_err": rel, "build_s": build,
           "fallback": c.reason or None}
    if c.fallback is None:
        report = c.report()
        row.update(stablehlo_ops=c.imported.stablehlo_ops, aten_ops=sum(1 for _ in c.program.op_nodes()),
                   coverage=report.analysis.coverage, regions=len(report.analysis.regions),
                   launches=c.launches_per_step, step_s=sorted(step_s)[len(step_s) // 2])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-tiny,keras-llama-tiny,keras-mixtral-tiny")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--steps", default="8")
    ap.add_argument("--out", default="bench-results/jax.json")
    args = ap.parse_args()
    rows = []
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            try:
                rows.append(run_isolated("bench_jax", "measure", model, dtype, args.steps))
            except Exception as e:  # noqa: BLE001 - one model failing is a row, not the end of the sweep
                rows.append({"model": model, "dtype": dtype, "fallback": str(e).splitlines()[0][:120]})
    print_table(rows, [("model", "model"), ("dtype", "dtype"), ("stablehlo_ops", "StableHLO ops"),
                       ("aten_ops", "ATen ops"), ("build_s", "build s"), ("tokens_equal", "tokens = jax"),
                       ("max_rel_logit_err", "max rel err"), ("coverage", "coverage"), ("regions", "regions"),
                       ("launches", "launches"), ("step_s", "s/step"), ("fallback", "fallback")])
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
