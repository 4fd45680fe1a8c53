"""Serving-shaped decode: modeled per-token time, SBUF peak and HBM bytes vs the minimum, as the KV cache grows.

    python benchmarks/bench_serving.py [--models qwen3-30b-a3b,llama3-8b] [--target trn3]
                                       [--cache-lens 640,2048,4096,8192,32768,131072] [--batches 1]
                                       [--layers 2] [--out bench-results/serving.json]

For every model, cache length and batch: the full-size config on the meta device (``fusegraph.api``: capture,
match, lower, generate, exactly the pipeline's kernel), profiled in the interpreter's shape-only mode with the
step's cache position assumed at the *end* of the cache (``kv_index = L - 1``,
``fusegraph.codegen.api.position_assumption``: every sequence's context is the whole cache, so a streamed attention
reads every block; the default shape-only assumption, position 0, would
read one block and flatter the kernel), costed by the cost model (``fusegraph.perf``, sourced parameters only).
``--layers`` decoder layers are built (the per-partition SBUF peak does not depend on the layer count); the
full-model time is extrapolated as the kernel's non-layer time plus the per-layer time times the model's layer
count. A configuration the pipeline refuses is a row ``not run: <reason>``.

    python benchmarks/bench_serving.py --tp [--tp-rows qwen3-30b-a3b:trn3:4:2] [--cache-lens 640,32768,131072]
                                       [--batches 1,8] [--layers 2] [--out bench-results/serving_tp.json]

``--tp``: the same rows on the tensor-parallel configuration, one rank each (``fusegraph.modelperf.tp``: HF
``tp_plan="auto"`` on the meta device, rank 0 of torch's fake process group, the executor's kernels with their
collectives, profiled shape-only at ``kv_index = L - 1`` (``position_assumption``)); the same ``--layers`` build and extrapolation.

``--attention PIPELINE=0`` / ``KT_BY_DMA=1`` / ``PREFETCH=0`` / ``ROW_GROUPS=1`` / ``BLOCK=2048`` /
``BLOCK_MAX=2048``: the same rows with the streamed attention's block loop one block at a time / K^T by DMA
transpose / the first block read after the layer's KV write / one row group per score tile / blocks forced to 2048
positions / the modeled choice among blocks up to 2048 (the JSON records the switches), for the A/B figures of
docs/serving.md. Each flag is the fusegraph option of that name (``attn_pipeline``, ``attn_kt_by_dma``,
``attn_prefetch``, ``attn_row_groups``, ``attn_block``, ``attn_block_max``), passed with the build's options. Every
row records the block and row groups its streamed attentions took (``attention_blocks``, from the kernel's
comments: the cost model's choice unless forced; docs/serving.md, "Block size and row groups: a modeled choice").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _common import print_table, write_json  # noqa: E402

DEFAULT_LENS = (640, 2048, 4096, 8192, 32768, 131072)


def min_bytes(cfg: dict[str, Any], L: int, batch: int) -> dict[str, float]:
    """Bytes a step of ``batch`` sequences at ``L`` positions must read: the weights once (an MoE's experts as
    many as the tokens can choose, at most all of them), each sequence's whole KV cache."""
    from fusegraph.perf.baselines import bytes_per_token

    one = bytes_per_token(cfg, L)
    extra = 0
    E = int(cfg.get("num_experts") or 0)
    if E and batch > 1:
        K, H, inter = int(cfg["num_experts_per_tok"]), int(cfg["hidden_size"]), int(cfg["moe_intermediate_size"])
        extra = (min(E, batch * K) - K) * 3 * H * inter * 2 * int(cfg["num_hidden_layers"])
    return {"weight_bytes": one["weight_bytes"] + extra, "kv_bytes": batch * one["kv_bytes"],
            "total_bytes": one["weight_bytes"] + extra + batch * one["kv_bytes"]}


def measure(model: str, target: str, L: int, batch: int, layers: int,
            options: dict[str, Any] | None = None) -> dict[str, Any]:
    """One row: build, profile shape-only at a full cache, cost; or ``status: not run`` with the reason."""
    from fusegraph import nkisim
    from fusegraph.api.kernel import build_for_target, capture_decode
    from fusegraph.perf.analysis import (cost_strategies, kernel_stats, model_config, one_line_reason,
                                         strategy_summary)
    from fusegraph.codegen.api import position_assumption
    from fusegraph.nkisim.torch_io import abstract_args
    from fusegraph.perf.kernelview import build_view
    from fusegraph.perf.params import load_params
    from fusegraph.patterns.attention.lowering import stream_choices
    from fusegraph.settings import Settings

    row: dict[str, Any] = {"model": model, "target": target, "cache_len": L, "batch": batch, "layers": layers}
    full_cfg = model_config(model, None)
    cfg = dict(full_cfg, num_hidden_layers=layers)
    t0 = time.perf_counter()
    stage = "capture"
    try:
        kw: dict[str, Any] = {"max_cache_len": L, "num_layers": layers}
        if batch != 1:
            kw["batch"] = batch
        step = capture_decode(model, options={"target": target, **(options or {})}, case_kwargs=kw)
        stage = "codegen"
        b = build_for_target(step, target, profile=False)
        stage = "profile"
        settings = Settings.from_options({**step.settings_options, "target": target})
        gen = b.generated
        ns = nkisim.load_kernel_source(gen.source, f"<fusegraph:{gen.name}>", target=target)
        extra = {"sbuf_budget": settings.sbuf_budget} if settings.sbuf_budget else {}
        nkisim.run(ns[gen.name], *abstract_args(gen), target=target, shape_only=True, lnc=settings.lnc,
                   assume=position_assumption(L - 1), **extra)
        prof = nkisim.last_profile().to_dict()
        b.config, b.profile, b.view = cfg, prof, build_view(gen.source, prof)
        stage = "cost model"
        hw = load_params(target)
        mk = strategy_summary(cost_strategies(b, hw, per_op=False).megakernel, 1)
    except Exception as e:  # noqa: BLE001 - a refused configuration is a result: the row says why
        return {**row, "status": "not run", "stage": stage, "reason": one_line_reason(e)}
    k = kernel_stats(b)
    need = min_bytes(cfg, L, batch)
    need_full = min_bytes(full_cfg, L, batch)
    step_s, layer_s = mk["seconds_per_token"], mk["seconds_per_layer"]
    full_layers = int(full_cfg["num_hidden_layers"])
    full_step_s = step_s + (full_layers - layers) * layer_s
    streamed = gen.source.count("cache positions streamed in blocks of")
    choices = stream_choices(gen.source)
    return {**row, "status": "run", "streamed_attention": streamed > 0, "attention_blocks": choices,
            "blocks": blocks_label(choices),
            "sbuf_peak_kib": k["sbuf_peak_bytes_per_partition"] / 1024, "sbuf_kib": k["sbuf_bytes_per_partition"] / 1024,
            "hbm_read_gb": k["hbm_read_bytes"] / 1e9, "min_gb": need["total_bytes"] / 1e9,
            "hbm_vs_min": k["hbm_read_bytes"] / need["total_bytes"],
            "step_ms": step_s * 1e3, "us_per_layer": layer_s * 1e6, "bound": mk.get("bound"),
            # where the kernel's time goes (cost model: bytes at bandwidth, DMA overhead, busiest engine, waits)
            "components_ms": {k: v * 1e3 for k, v in (mk.get("components_s") or {}).items()},
            "busy_ms": {k: v * 1e3 for k, v in (mk.get("busy_s") or {}).items()},
            "min_ms_core": need["total_bytes"] / hw.dma_bandwidth_core * 1e3,
            "full_model_ms_per_step": full_step_s * 1e3, "full_model_ms_per_token": full_step_s * 1e3 / batch,
            "full_model_min_ms_core": need_full["total_bytes"] / hw.dma_bandwidth_core * 1e3,
            "seconds": time.perf_counter() - t0}


TP_COLUMNS = [("model", "model"), ("target", "target"), ("tp", "TP"), ("lnc", "LNC"), ("cache_len", "cache"),
              ("batch", "B"), ("streamed_attention", "streamed"), ("blocks", "block x groups"),
              ("sbuf_peak_kib", "SBUF peak KiB"),
              ("hbm_read_gb", "rank HBM GB (built layers)"), ("min_gb_per_rank", "rank min GB"),
              ("hbm_vs_min", "HBM/min"), ("modeled_us_per_layer", "us/layer"),
              ("collective_us_per_layer", "collective us/layer"),
              ("collective_exposed_us_per_layer", "exposed us/layer"),
              ("full_model_ms_per_step", "full model ms/step"), ("full_model_ms_per_token", "full model ms/token"),
              ("full_model_min_ms_rank", "full min ms/step (rank)")]


ATTENTION_FLAGS = {"PIPELINE": ("0", "1"), "KT_BY_DMA": ("0", "1"), "PREFETCH": ("0", "1"),
                   "ROW_GROUPS": ("0", "1", "2", "4"), "BLOCK": "positions", "BLOCK_MAX": "positions"}


def attention_options(spec: str) -> dict[str, bool | int]:
    """``PIPELINE=0,KT_BY_DMA=1,PREFETCH=0,ROW_GROUPS=1,BLOCK=2048,BLOCK_MAX=4096`` -> the fusegraph options of the
    named switches (``{"attn_pipeline": False, ...}``; only those exist: an A/B of the pipelined block loop, of K^T
    by DMA transpose, of the first block read before the layer's KV write, of the row groups (0: the modeled
    choice, N: at most N, 1: off) and of the streamed block (``BLOCK``: forced to that many positions, 0: the
    modeled choice; ``BLOCK_MAX``: the largest the choice considers) against the defaults). Anything else is a
    usage error naming the accepted flags."""
    options: dict[str, bool | int] = {}
    for item in filter(None, spec.split(",")):
        name, _, value = item.partition("=")
        accepted = ATTENTION_FLAGS.get(name)
        positions = accepted == "positions" and value.isdigit() and int(value) % 128 == 0 \
            and (int(value) > 0 or name == "BLOCK")
        if accepted is None or not (positions or (accepted != "positions" and value in accepted)):
            raise SystemExit(f"--attention: {item!r} is not one of "
                             + ", ".join(f"{k}={'|'.join(v) if v != 'positions' else '<multiple of 128>'}"
                                         for k, v in ATTENTION_FLAGS.items()))
        options[f"attn_{name.lower()}"] = int(value) if name in ("ROW_GROUPS", "BLOCK", "BLOCK_MAX") else value == "1"
    return options


def attention_flags(options: dict[str, Any]) -> dict[str, bool | int]:
    """Every switch's value for this run (the defaults, with ``options`` applied and the environment's
    ``FUSEGRAPH_ATTN_*``), as the JSON records it."""
    from fusegraph.settings import Settings

    s = Settings.from_options(options)
    return {k: getattr(s, f"attn_{k.lower()}") for k in ATTENTION_FLAGS}


def blocks_label(choices: list[dict[str, Any]]) -> str:
    """``1024x2`` (block x row groups) of a kernel's streamed attentions (one label when they all agree), ``-``
    when none streams."""
    labels = sorted({f"{c['block']}x{c['row_groups']}" for c in choices})
    return ",".join(labels) or "-"


def run_tp(specs: str, lens: list[int], batches: list[int], layers: int, out: str,
           flags: dict[str, bool] | None = None, options: dict[str, Any] | None = None) -> int:
    """``--tp``: one rank of each TP row at every cache length and batch (``fusegraph.modelperf.tp``), written
    to ``out`` after every row (a long run keeps what it measured)."""
    from fusegraph.modelperf import tp

    known = {(r.model, r.target, r.tp, r.lnc): r for r in tp.DEFAULT_ROWS}
    base = []
    for spec in specs.split(","):
        model, target, n, lnc = spec.split(":")
        key = (model, target, int(n), int(lnc))
        base.append(known.get(key) or tp.TPConfig(*key))
    from dataclasses import replace

    base = [replace(r, layers=layers, options=tuple(r.options) + tuple(sorted((options or {}).items())))
            for r in base]
    rows: list[dict[str, Any]] = []
    for cfg in tp.serving_rows(base, lens, batches):
        t0 = time.perf_counter()
        r = tp.run_row(cfg)
        r.setdefault("cache_len", cfg.cache_len)
        r.setdefault("batch", cfg.batch)
        r["seconds"] = time.perf_counter() - t0
        r.setdefault("blocks", blocks_label(r.get("attention_blocks") or []))
        print(json.dumps({k: r.get(k) for k in ("model", "tp", "cache_len", "batch", "status", "blocks",
                                                "sbuf_peak_kib", "hbm_vs_min", "full_model_ms_per_token",
                                                "us_per_layer", "modeled_us_per_layer", "reason", "seconds")},
                         default=str), flush=True)
        rows.append(r)
        write_json(out, {"mode": "tp", "layers_built": layers, "assumed_position": "L - 1", "rows": rows,
                         "attention": flags,
                         "method": "one rank per row (fusegraph.modelperf.tp); full model = the built step's time "
                                   "outside the layers + per-layer time x the model's layers (modeled)"})
    print_table([r for r in rows if r.get("status") == "run"], TP_COLUMNS)
    for r in rows:
        if r.get("status") != "run":
            print(f"not run: {r['model']} TP={r['tp']} L={r['cache_len']} B={r['batch']}: {r.get('reason')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,llama3-8b")
    ap.add_argument("--target", default="trn3")
    ap.add_argument("--cache-lens", default=",".join(map(str, DEFAULT_LENS)))
    ap.add_argument("--batches", default="1")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", default=None, help="default: bench-results/serving.json (serving_tp.json with --tp)")
    ap.add_argument("--tp", action="store_true", help="the rows on the tensor-parallel configuration, one rank each")
    ap.add_argument("--tp-rows", default="qwen3-30b-a3b:trn3:4:2", help="model:target:tp:lnc,... (with --tp)")
    ap.add_argument("--attention", default="", metavar="FLAG=0|1,...",
                    help="A/B switches of the streamed attention template (the attn_* options): PIPELINE, KT_BY_DMA, "
                         "PREFETCH (0|1), ROW_GROUPS (0 = modeled|1|2|4), BLOCK (positions, 0 = modeled), "
                         "BLOCK_MAX (positions)")
    args = ap.parse_args(argv)
    options = attention_options(args.attention)
    flags = attention_flags(options)
    if args.tp:
        return run_tp(args.tp_rows, [int(x) for x in args.cache_lens.split(",")],
                      [int(x) for x in args.batches.split(",")], args.layers,
                      args.out or "bench-results/serving_tp.json", flags, options)
    args.out = args.out or "bench-results/serving.json"
    rows = []
    for model in args.models.split(","):
        for batch in map(int, args.batches.split(",")):
            for L in map(int, args.cache_lens.split(",")):
                r = measure(model, args.target, L, batch, args.layers, options)
                print(json.dumps({k: r.get(k) for k in ("model", "cache_len", "batch", "status", "blocks",
                                                        "sbuf_peak_kib", "hbm_vs_min", "us_per_layer",
                                                        "full_model_ms_per_token", "reason")}),
                      flush=True)
                rows.append(r)
    ok = [r for r in rows if r["status"] == "run"]
    print_table(ok, [("model", "model"), ("cache_len", "cache"), ("batch", "B"), ("streamed_attention", "streamed"),
                     ("blocks", "block x groups"),
                     ("sbuf_peak_kib", "SBUF peak KiB"), ("hbm_read_gb", f"HBM GB ({args.layers} layers)"),
                     ("min_gb", "min GB"), ("hbm_vs_min", "HBM/min"), ("us_per_layer", "us/layer"),
                     ("min_ms_core", "min ms (core)"), ("step_ms", "ms/step"),
                     ("full_model_ms_per_token", "full model ms/token"),
                     ("full_model_min_ms_core", "full min ms/step (core)")])
    for r in rows:
        if r["status"] != "run":
            print(f"not run: {r['model']} L={r['cache_len']} B={r['batch']}: {r['reason']}")
    write_json(args.out, {"target": args.target, "layers_built": args.layers, "assumed_position": "L - 1",
                          "attention": flags, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
