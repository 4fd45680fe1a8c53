"""Modeled decode performance of fusegraph's megakernel vs per-op / hybrid baselines and the physical limit.

    python benchmarks/bench_perf.py [--models qwen3-30b-a3b,llama3-8b] [--targets trn2,trn3] [--layers N]
                                    [--out bench-results/perf.json] [--html-dir bench-results]

For every model and target: capture, match and generate the megakernel (fusegraph.api), profile it in
the interpreter's shape-only mode, and turn the profile into time with the cost model (fusegraph.perf, every
parameter sourced in fusegraph/perf/data/trainium.json). Prints the whole-model table (one core) and, for
Qwen3-30B-A3B on trn3, the like-for-like tables: the real TP=4 x LNC=2 rank (HF tp_plan="auto" captured on a
fake process group, fusegraph.modelperf.tp; also ``benchmarks/bench_tp.py``) and the synthetic one-core shard (the
config divided 8 ways, kept for the per-engine calibration rows), with the published figure beside each modeled one. Writes JSON (and optionally one HTML report per run).
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
    ap.add_argument("--no-tp", action="store_true", help="skip the real TP=4 x LNC=2 like-for-like rank")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    bench.run_and_write(args.models.split(","), args.targets.split(","), layers=args.layers, cache_len=args.cache_len,
                        per_op=not args.no_per_op, json_path=args.out,
                        html_dir=args.html_dir)
    if not args.no_tp:
        _tp_like_for_like(args)
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


def _tp_like_for_like(args: argparse.Namespace) -> None:
    """The like-for-like row as a real configuration: rank 0 of TP=4 x LNC=2 (fusegraph.modelperf.tp), printed
    after the synthetic shard and added to the JSON as ``like_for_like_tp``."""
    import json
    from dataclasses import replace

    from fusegraph.modelperf import tp
    from fusegraph.perf.params import published

    pub = published()
    if pub["model"] not in args.models.split(",") or pub["target"] not in args.targets.split(","):
        return
    cfg = next(r for r in tp.DEFAULT_ROWS if r.model == pub["model"] and r.target == pub["target"])
    result = tp.run([replace(cfg, layers=args.layers, cache_len=args.cache_len)])
    print()
    print("Like for like, real configuration (replaces the synthetic shard above for ms/token and us/layer):")
    print(tp.format_table(result))
    if args.out:
        with open(args.out) as f:
            data = json.load(f)
        data["like_for_like_tp"] = result["rows"][0]
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
