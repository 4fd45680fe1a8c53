"""The cost model calibrated on the hand-written Qwen3-30B-A3B megakernel's measured profile, its held-out errors,
and the headline ratio in one run (issue 14 items 3-4).

    MK=/path/to/nki-moe-megakernel NKILIB=/path/to/nkilib-fixed \
        python benchmarks/bench_calibration.py [--layers 48] [--fit-layers 4] [--parameter-set o1_hand_megakernel]
                                               [--out bench-results/calibration.json]

(``shared/tools/prepare_anchors.sh`` extracts both checkouts and prints the exports.) One run: trace the hand kernel
once and fit the low-confidence parameters to O1 (wall, Sync, DMA active, Tensor per layer) by re-costing the
trace; run the hand kernel (48 layers) and build fusegraph's kernels for the same configuration (TP=4 x LNC=2, 640
positions): one core's shard of the divided config, and rank 0 of the real TP deployment with its collectives
(``fusegraph.modelperf.tp``; skipped with a warning if it cannot be built); cost them all with the sourced and with the calibrated parameter set (the one recorded in
``fusegraph/perf/data/trainium.json``); print both per layer and per engine, the ratio, the held-out errors and the
ratio's sensitivity to each low-confidence parameter (x0.5, x1.5). About 10-12 minutes here (2 shared cores).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import write_json  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from fusegraph.modelperf import calibrate

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--fit-layers", type=int, default=4)
    ap.add_argument("--parameter-set", default=calibrate.CALIBRATION)
    ap.add_argument("--cache-len", type=int, default=640)
    ap.add_argument("--out", default="bench-results/calibration.json")
    a = ap.parse_args(argv)
    for var in ("MK", "NKILIB"):
        if not os.environ.get(var):
            print(f"set {var} (see shared/tools/prepare_anchors.sh): the hand-written kernel is read from a checkout",
                  file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    r = calibrate.run(layers=a.layers, fit_layers=a.fit_layers, parameter_set=a.parameter_set,
                      cache_len=a.cache_len)
    r["timings"]["total_s"] = time.perf_counter() - t0
    print(calibrate.format_report(r))
    write_json(a.out, r, quiet=True)
    print(f"wrote {a.out} ({r['timings']['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
