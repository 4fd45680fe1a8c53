"""Entry points of the report: ``fusegraph.explain(...)`` and the report of a compile's capture session."""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import torch

from ..matching.analyze import analyze
from .model import Report, build_report

log = logging.getLogger(__name__)


def report_for_session(session: Any) -> Report:
    """Analyze what a capture session holds (every graph of the step so far) and build its report."""
    analysis = analyze(session.program, session.settings)
    return build_report(analysis, session)


def explain(model_or_fn: Callable | torch.nn.Module, *args: Any, options: Mapping[str, Any] | None = None,
            **kwargs: Any) -> Report:
    """Capture ``model_or_fn(*args, **kwargs)`` with the backend in dry-run mode and return its fused-region report.

    Dry run: capture, match and form regions, no codegen; the call itself runs eagerly (its result is on
    ``report.outputs``). ``options`` are fusegraph options (``min_region_size``, ``fallback_ops``...).
    """
    from ..inspection import capture_step

    opts = dict(options or {})
    opts.setdefault("dryrun", True)
    cap = capture_step(model_or_fn, *args, options=opts, **kwargs)
    report = build_report(analyze(cap.program, cap.session.settings), cap.session)
    report.outputs = cap.outputs
    return report
