"""Performance without hardware: a Trainium2/3 cost model on the NKI interpreter's profile.

The interpreter counts what a generated kernel does (instructions per engine, every DMA with its bytes,
partitions and descriptors, per kernel line); this package turns those counts into time with parameters that
each have a public source (``data/trainium.json``), compares execution strategies on the same model, calibrates
against the published Qwen3-30B-A3B trn3 figures, and costs third-party kernels the same way. See
``docs/performance.md``.

Main entry points:

* :func:`estimate_kernel` / :func:`build_view` — any kernel source + its profile -> an :class:`Estimate`;
* :func:`cost_strategies` / :func:`profile_shape_only` — every strategy on one :class:`KernelBuild`;
* :func:`load_params` / :func:`published` — the sourced parameters and published figures.

It needs a kernel and its profile, never a capture (the LLM writer costs its kernels with it, below the
executors). Whole models — capture, build, cost, the benchmark, the HTML report, ``fusegraph bench`` — are
:mod:`fusegraph.modelperf`, above the API.
"""
from .analysis import KernelBuild, cost_strategies, profile_shape_only, shard_overrides
from .baselines import bytes_per_token, per_op, physical_limit
from .calibration import calibrate, goal
from .costmodel import Estimate, classify, estimate, estimate_kernel
from .kernelview import KernelView, build_view
from .params import HardwareParams, load_params, published, validate
from .progress import Progress

__all__ = [
    "Estimate", "HardwareParams", "KernelBuild", "KernelView", "Progress", "build_view", "bytes_per_token",
    "calibrate", "classify", "cost_strategies", "estimate", "estimate_kernel", "goal", "load_params", "per_op",
    "physical_limit", "profile_shape_only", "published", "shard_overrides", "validate",
]
