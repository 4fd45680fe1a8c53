"""Modeled performance of whole models: build a model's megakernel through :mod:`fusegraph.api`, cost it with
the cost model (:mod:`fusegraph.perf`), compare strategies and the published figures, and show it.

* ``analysis`` — :func:`analyze_model`: bundled model -> megakernel (the pipeline's) -> shape-only profile ->
  every strategy, the limit and (for the published model/target) the like-for-like calibration; a
  :class:`NotRun` with the reason where the pipeline builds no kernel;
* ``bench`` — the benchmark (``fusegraph bench``, ``benchmarks/bench_perf.py``); ``html`` — the self-contained HTML
  report (``fusegraph report --html``); ``against`` — a third-party kernel beside the generated one
  (``fusegraph bench --against``); ``cli`` — those commands.

It captures and reports, so it sits above the API (docs/architecture.md, "Layers"). The names load with their
module on first use: ``fusegraph`` builds its parser from :mod:`.cli` on every start, without torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {name: "analysis" for name in ("ModelPerf", "NotRun", "analyze_model", "build_kernel", "build_kernels")}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
