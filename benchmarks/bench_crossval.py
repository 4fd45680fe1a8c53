"""The cost model fitted jointly to every measured kernel here and cross-validated by leaving each out (issue 28).

    MK=/path/to/nki-moe-megakernel NKILIB=/path/to/nkilib-fixed MK_GPTOSS_EXP7=/path/to/tree-9a3c4b5 ... \
        python benchmarks/bench_crossval.py [--layers 4] [--out bench-results/crossval.json]

(``shared/tools/prepare_anchors.sh`` extracts the Qwen3 checkout and nki-library, ``benchmarks/prepare_gpt_oss_trees.sh``
the GPT-OSS trees the published profiles ran; each prints its exports.) A kernel whose checkout is not set is
listed as not here. Prints each kernel's measured per-layer figures beside the model's under the sourced
parameters, the recorded single-kernel calibration, the joint fit and the fit that left it out; the parameters of
every fit with their physical ranges; and the band: the largest error of each figure on a kernel left out of the
fit. Every modeled number is MODELED (nothing runs on Trainium here); the measured ones are the authors'.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import write_json  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from fusegraph.modelperf import crossvalidate

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=None, help="layers traced per kernel (default: each entry's)")
    ap.add_argument("--max-evaluations", type=int, default=1500)
    ap.add_argument("--out", default="bench-results/crossval.json")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        r = crossvalidate.run(layers=a.layers, max_evaluations=a.max_evaluations)
    except RuntimeError as e:
        print(f"not run: {e}", file=sys.stderr)
        return 2
    r["timings"]["total_s"] = time.perf_counter() - t0
    print(crossvalidate.format_report(r))
    write_json(a.out, r, quiet=True)
    print(f"wrote {a.out} ({r['timings']['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
