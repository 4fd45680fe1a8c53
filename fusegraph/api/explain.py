"""``fusegraph.explain``: capture a call in dry-run mode and return its fused-region report."""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from ..codegen.registry import check as lowerable
from ..matching import analyze
from ..report import Report, build_report
from .capture import capture_step


def explain(model_or_fn: Callable | torch.nn.Module, *args: Any, options: Mapping[str, Any] | None = None,
            **kwargs: Any) -> Report:
    """Capture ``model_or_fn(*args, **kwargs)`` with the backend in dry-run mode and return its fused-region report.

    Dry run: capture, match and form regions, no codegen; the call itself runs eagerly (its result is on
    ``report.outputs``). ``options`` are fusegraph options (``min_region_size``, ``fallback_ops``...).
    """
    opts = dict(options or {})
    opts.setdefault("dryrun", True)
    cap = capture_step(model_or_fn, *args, options=opts, **kwargs)
    report = build_report(analyze(cap.program, cap.session.settings, lowerable=lowerable), cap.session)
    report.outputs = cap.outputs
    return report
