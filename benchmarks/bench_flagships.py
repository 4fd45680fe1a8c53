"""Full-size flagship decoders, shape-only on the meta device: is every decoder op inside one kernel per step,
within the SBUF/PSUM budgets, and what does the cost model put it at (issue 27)?

    python benchmarks/bench_flagships.py [--models gpt-oss-20b,deepseek-v3,...] [--target trn3] [--layers 2]
        [--timeout 1200] [--out bench-results/flagships.json]

Each row is one core running the whole model (no sharding), built from the family's config class in the
installed transformers with the dimensions of the published checkpoint (``FLAGSHIPS``: the family's default
config where it is that checkpoint, else the overrides listed there, copied from the checkpoint's public
``config.json``), cut to ``--layers`` decoder layers that hold one layer of every kind (sliding and full
attention, linear and full attention, dense and MoE: :func:`fusegraph.models.families.cut_layers`), random
weights on the meta device. The pipeline is the one ``fusegraph bench --size full`` runs: capture, match, lower,
generate, a shape-only run of the kernel in the interpreter (which enforces the SBUF and PSUM budgets), the cost
model on its profile. Each row runs in a fresh process.

Columns: ``launches`` (kernels per step of the megakernel strategy), ``regions`` (fusible regions of the step
with work in a kernel: 1 = one kernel), ``ops_outside`` (decoder-layer ops that compute, neither in that kernel
nor host-side step metadata: 0 = every decoder op in the kernel; views compute nothing and are not counted, e.g.
the per-layer unsqueeze of the host-side rotary tables), ``coverage`` (the matcher's: decoder ops in regions),
``generic_ops`` (ops that run in the kernel through generic lowering, no pattern: the next patterns to write),
``sbuf_peak_kib``, ``hbm_gb`` (HBM bytes read per step for the layers built), ``ms_step`` (MODELED, the layers
built), ``us_layer`` (MODELED, per decoder layer), ``full_ms_token`` (MODELED: ``ms_step`` plus ``us_layer`` for
each of the model's other layers, batch 1), ``core_limit_ms`` (one core's DMA bound for the layers built),
``bound``; under the table, the generic ops that cost the most modeled time (the next patterns to write).
Everything is modeled on the cost model's sourced parameters (docs/performance.md); nothing here ran on
Trainium.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _common import print_table, run_isolated_partial, write_json  # noqa: E402

#: name -> (HF model_type, overrides of its default config: the published checkpoint's dimensions, what it is)
FLAGSHIPS: dict[str, tuple[str, dict[str, Any], str]] = {
    "gpt-oss-20b": ("gpt_oss", {"num_hidden_layers": 24, "num_local_experts": 32},
                    "openai/gpt-oss-20b: the gpt_oss default with 24 layers and 32 experts"),
    "gpt-oss-120b": ("gpt_oss", {}, "openai/gpt-oss-120b: the gpt_oss default config"),
    "deepseek-v3": ("deepseek_v3", {"first_k_dense_replace": 1},
                    "deepseek-ai/DeepSeek-V3: the default config; first_k_dense_replace=1 so that 2 layers are "
                    "one dense and one MoE layer (the checkpoint has 3 dense layers of 61)"),
    "llama-4-scout": ("llama4_text", {}, "meta-llama/Llama-4-Scout-17B-16E (text): the llama4_text default"),
    "qwen3-next-80b-a3b": ("qwen3_next", {}, "Qwen/Qwen3-Next-80B-A3B: the qwen3_next default"),
    "gemma-3-27b": ("gemma3_text", {
        "hidden_size": 5376, "intermediate_size": 21504, "num_attention_heads": 32, "num_key_value_heads": 16,
        "head_dim": 128, "num_hidden_layers": 62, "query_pre_attn_scalar": 168, "sliding_window": 1024,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)]},
        "google/gemma-3-27b (text): 5 sliding-window layers to 1 global"),
    "glm-4.5-air": ("glm4_moe", {}, "zai-org/GLM-4.5-Air: the glm4_moe default (1 dense layer, then MoE)"),
    "ministral-3": ("ministral3", {}, "Ministral 3: the ministral3 default"),
    "qwen3-235b-a22b": ("qwen3_moe", {
        "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 94, "num_experts": 128,
        "num_experts_per_tok": 8}, "Qwen/Qwen3-235B-A22B"),
}
PARTIAL_ENV = "FUSEGRAPH_BENCH_PARTIAL"


def _partial(row: dict[str, Any]) -> None:
    path = os.environ.get(PARTIAL_ENV)
    if path:
        import json

        with open(path, "w") as f:
            json.dump(row, f)


def register(name: str) -> Any:
    """The flagship's spec (full size, meta device) registered under ``name`` so the pipeline finds it."""
    from fusegraph.models import MODELS
    from fusegraph.models.custom import custom_spec
    from fusegraph.models.families import cut_layers

    family, overrides, _ = FLAGSHIPS[name]
    spec = custom_spec(family, "full")
    config = dict(spec.config)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:  # per-layer lists follow the count
        config.update(cut_layers(config, overrides["num_hidden_layers"]))
    spec = dataclasses.replace(spec, name=name, config={**config, **overrides})
    MODELS[name] = spec
    return spec


def outside_ops(build: Any) -> tuple[int, int, list[str]]:
    """(decoder-layer ops outside the kernel and not host-side step metadata, regions with kernel work, the first
    few outside ops)."""
    from fusegraph.codegen.registry import is_host_side
    from fusegraph.matching.tensor_ops import CATEGORY

    G = build.program.graph
    inside = set(build.lowered.kernel_nodes) | set(getattr(build.lowered, "host_nodes", ()))
    host = {n for m in build.analysis.matches if is_host_side(m.pattern.template) for n in m.nodes}
    # views compute nothing: a view of a host-side table (the rotary cos/sin unsqueezed per layer) is its input
    out = [n for n, d in G.nodes(data=True) if d.get("kind") == "op" and d.get("layer") is not None
           and n not in inside and n not in host and CATEGORY.get(d.get("op")) != "view" and d.get("op") != "getitem"]
    regions = sum(1 for r in build.analysis.regions if any(not is_host_side(m.pattern.template) for m in r.matches))
    return len(out), regions, [f"{n} {G.nodes[n].get('op')}" for n in out[:5]]


def measure(name: str, target: str, layers: str) -> dict[str, Any]:
    """One flagship on one core (in a child process)."""
    from fusegraph.modelperf.analysis import analyze_model
    from fusegraph.modelperf.bench import not_run_row, row_of
    from fusegraph.modelperf.analysis import NotRun

    spec = register(name)
    full_layers = int(spec.config.get("num_hidden_layers"))
    row: dict[str, Any] = {"model": name, "checkpoint": FLAGSHIPS[name][2], "target": target,
                           "layers_built": int(layers), "layers": full_layers}
    _partial(row)
    t0 = time.perf_counter()
    res = analyze_model(name, [target], layers=int(layers), per_op=False, like_for_like=False)[target]
    base = not_run_row(res) if isinstance(res, NotRun) else row_of(res)
    row.update({k: base.get(k) for k in ("status", "reason", "stage", "megakernel_launches", "sbuf_peak_kib",
                                         "sbuf_kib", "hbm_gb_per_token", "megakernel_ms", "megakernel_us_layer",
                                         "megakernel_bound", "limit_core_ms") if k in base})
    build = getattr(res, "build", None)
    if build is not None:
        n_out, regions, first = outside_ops(build)
        generic = sum(len(m.nodes) for m in build.analysis.matches if m.pattern.name.startswith("fusegraph.generic"))
        row.update({"ops_outside": n_out, "regions": regions, "first_outside": first,
                    "coverage": build.analysis.coverage, "generic_ops": generic})
        if row.get("megakernel_ms") is not None and row.get("megakernel_us_layer") is not None:
            row["full_ms_token"] = row["megakernel_ms"] + (full_layers - int(layers)) * row["megakernel_us_layer"] / 1e3
        row["top_generic"] = top_generic(res)
    row["seconds"] = time.perf_counter() - t0
    return row


def top_generic(res: Any, n: int = 3) -> list[str]:
    """The generic (tensor-path) ops that cost the step the most modeled time
    (:meth:`fusegraph.modelperf.analysis.ModelPerf.generic_by_cost`), each as ``region (ATen op): ms``: the next
    patterns to write."""
    return [f"{g['region']} ({g['op']}): {g['ms']:.2f} ms" for g in res.generic_by_cost(n)]


COLUMNS = [("model", "model"), ("status", "status"), ("megakernel_launches", "launches"), ("regions", "regions"),
           ("ops_outside", "ops outside"), ("coverage", "coverage"), ("generic_ops", "generic ops"),
           ("sbuf_peak_kib", "SBUF peak KiB"), ("hbm_gb_per_token", "HBM GB/step"), ("megakernel_ms", "ms/step"),
           ("megakernel_us_layer", "us/layer"), ("layers", "model layers"), ("full_ms_token", "full ms/token"),
           ("limit_core_ms", "core DMA limit ms"), ("megakernel_bound", "bound"), ("failure", "failure")]
#: printed under the table, one line per model
DETAIL = "top_generic"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(FLAGSHIPS))
    ap.add_argument("--target", default="trn3")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=1200)
    ap.add_argument("--out", default="bench-results/flagships.json")
    args = ap.parse_args(argv)
    rows = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        if name not in FLAGSHIPS:
            ap.error(f"unknown flagship {name!r} (one of {', '.join(FLAGSHIPS)})")
        row = run_isolated_partial("bench_flagships", "measure", name, args.target, str(args.layers),
                                   timeout=args.timeout, partial_env=PARTIAL_ENV)
        rows.append(row)
        print(f"{name}: {row.get('status')} launches={row.get('megakernel_launches')} "
              f"outside={row.get('ops_outside')} {row.get('failure') or row.get('reason') or ''}", flush=True)
        write_json(args.out, {"target": args.target, "layers_built": args.layers, "rows": rows,
                              "method": "one core, whole model, shape-only on the meta device; MODELED"}, quiet=True)
    print_table(rows, COLUMNS)
    print("\nmost expensive generic ops (MODELED exposed time per step; the next patterns to write):")
    for r in rows:
        print(f"  {r['model']}: " + ("; ".join(r.get(DETAIL) or []) or "-"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
