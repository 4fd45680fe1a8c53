"""Modeled decode performance of fusegraph's megakernel vs per-op / hybrid baselines and the physical limit.

    python benchmarks/bench_perf.py [--models qwen3-30b-a3b,llama3-8b] [--targets trn2,trn3] [--layers N]
                                    [--out bench-results/perf.json] [--html-dir bench-results]

For every model and target: capture, match and generate the megakernel (fusegraph.api), profile it in
the interpreter's shape-only mode, and turn the profile into time with the cost model (fusegraph.perf, every
parameter sourced in fusegraph/perf/data/trainium.json). Prints the whole-model table (one core) and, for
Qwen3-30B-A3B on trn3, the like-for-like table (one core's shard of the published TP=4 x LNC=2 runs) with the
published figure and the error beside each modeled one. Writes JSON (and optionally one HTML report per run).
A model/target the pipeline refuses (e.g. a KV cache too long for SBUF) is reported as "not run: <reason>"; the
other rows still run and the exit code is 0.
"""
from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    from fusegraph.modelperf import bench

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(bench.DEFAULT_MODELS))
    ap.add_argument("--targets", default=",".join(bench.DEFAULT_TARGETS))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    ap.add_argument("--cache-len", type=int, default=640, help="KV-cache positions (640 = the published runs)")
    ap.add_argument("--out", default="bench-results/perf.json")
    ap.add_argument("--html-dir", default=None, help="also write one HTML report per model/target here")
    ap.add_argument("--no-per-op", action="store_true", help="skip the per-op baselines")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    bench.run_and_write(args.models.split(","), args.targets.split(","), layers=args.layers, cache_len=args.cache_len,
                        per_op=not args.no_per_op, json_path=args.out,
                        html_dir=args.html_dir)
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
