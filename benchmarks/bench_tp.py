"""Tensor-parallel decode, one rank per configuration, modeled (issue 13 item 5).

    python benchmarks/bench_tp.py [--rows qwen3-30b-a3b:trn3:4:2,llama3-8b:trn2:8:1,...] [--layers N]
                                  [--cache-lens 640,32768] [--batches 1,8] [--out bench-results/tp.json]

Each row is rank 0 of a real TP deployment: the model on the meta device, sharded by HF's tp_plan="auto" on
torch's fake process group (world size = TP, no peers), captured by fusegraph (local shards + functional
collectives), its kernels built as the NKI executor builds them, profiled shape-only in the interpreter and timed
by the cost model (program 0 of the rank = one physical core). Collectives inside a kernel are scheduled there;
collectives between kernels are added serially (ring model). Every time is MODELED. Default rows: Qwen3-30B-A3B
trn3 TP=4 x LNC=2 (vs the published hand-written megakernel), Llama-3-8B trn2 TP=8, Qwen3-235B-A22B trn2
TP=16 / TP=32 x LNC=2 (4 / 8 chips). See docs/tp.md, "Benchmark". With ``--cache-lens`` / ``--batches`` every
row runs at every cache length and batch, profiled with each sequence at the cache's last position (serving rows;
``bench_serving.py --tp`` uses this).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    from fusegraph.modelperf import tp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=None, help="model:target:tp:lnc,... (default: the rows of issue 13 item 5)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    ap.add_argument("--cache-len", type=int, default=640)
    ap.add_argument("--cache-lens", default=None, help="comma list: every row at each cache length (full cache)")
    ap.add_argument("--batches", default=None, help="comma list: every row at each batch (full cache)")
    ap.add_argument("--out", default="bench-results/tp.json")
    args = ap.parse_args(argv)
    from dataclasses import replace

    rows = [replace(r, layers=args.layers, cache_len=args.cache_len) for r in tp.DEFAULT_ROWS]
    if args.rows:
        known = {(r.model, r.target, r.tp, r.lnc): r for r in rows}  # a default row keeps its reason and options
        rows = []
        for spec in args.rows.split(","):
            model, target, n, lnc = spec.split(":")
            key = (model, target, int(n), int(lnc))
            rows.append(known.get(key) or tp.TPConfig(*key, layers=args.layers, cache_len=args.cache_len))
    if args.cache_lens or args.batches:
        lens = [int(x) for x in (args.cache_lens or str(args.cache_len)).split(",")]
        batches = [int(x) for x in (args.batches or "1").split(",")]
        rows = tp.serving_rows(rows, lens, batches)
    t0 = time.perf_counter()
    result = tp.run(rows)
    print(tp.format_table(result))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"wrote {args.out}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
