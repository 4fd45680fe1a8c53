"""Performance without hardware: a Trainium2/3 cost model on the NKI interpreter's profile.

The interpreter counts what a generated kernel does (instructions per engine, every DMA with its bytes,
partitions and descriptors, per kernel line); this package turns those counts into time with parameters that
each have a public source (``data/trainium.json``), compares execution strategies on the same model, calibrates
against the published Qwen3-30B-A3B trn3 figures, and renders a self-contained HTML report. See
``docs/performance.md``.

Main entry points:

* :func:`analyze_model` — bundled model -> megakernel (the pipeline's) -> shape-only profile -> every strategy,
  the limit, and (for the published model/target) the like-for-like calibration; a :class:`NotRun` with the
  reason where the pipeline builds no kernel;
* :func:`estimate_kernel` / :func:`build_view` — any kernel source + its profile -> an :class:`Estimate`;
* :func:`load_params` / :func:`published` — the sourced parameters and published figures;
* :mod:`fusegraph.perf.html` — the HTML report; :mod:`fusegraph.perf.bench` — the benchmark.
"""
from .analysis import ModelPerf, NotRun, analyze_model, build_kernel, build_kernels, shard_overrides
from .baselines import bytes_per_token, per_op, physical_limit
from .calibration import calibrate, goal
from .costmodel import Estimate, classify, estimate, estimate_kernel
from .kernelview import KernelView, build_view
from .params import HardwareParams, load_params, published, validate
from .progress import Progress

__all__ = [
    "Estimate", "HardwareParams", "KernelView", "ModelPerf", "NotRun", "Progress", "analyze_model", "build_kernel",
    "build_kernels", "build_view", "bytes_per_token", "calibrate", "classify", "estimate", "estimate_kernel", "goal",
    "load_params", "per_op", "physical_limit", "published", "shard_overrides", "validate",
]
