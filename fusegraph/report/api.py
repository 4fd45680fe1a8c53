"""The report of a compile's capture session (what ``report=``/``dryrun`` and ``fusegraph report`` show).

``fusegraph.explain`` captures a step first, so it lives above the pipeline, in :mod:`fusegraph.api`.
"""
from __future__ import annotations

import logging
from typing import Any

from ..capture.session import CaptureSession
from ..codegen.registry import check as lowerable
from ..matching.analyze import analyze
from .model import Report, build_report

log = logging.getLogger(__name__)


def report_for_session(session: CaptureSession) -> Report:
    """Analyze what a capture session holds (every graph of the step so far) and build its report."""
    analysis = analyze(session.program, session.settings, lowerable=lowerable)
    return build_report(_with_inlined_islands(analysis, session), session)


def _with_inlined_islands(analysis: Any, session: CaptureSession) -> Any:
    """The regions as the kernels hold them: with the LLM-written islands the executors inlined (their records'
    ``inlined_match``, docs/llm.md), formed again; the dry-run regions if that fails (a report never fails)."""
    extra = [m for rec in session.program.execution.values() for isl in rec.llm
             if (m := getattr(isl, "inlined_match", None)) is not None]
    if not extra or analysis.view is None or analysis.reach is None:
        return analysis
    from ..codegen.registry import is_host_side
    from ..matching.regions import with_extra_matches

    try:
        return with_extra_matches(analysis, extra, lambda m: m.pattern.template != "llm_island"
                                  and not is_host_side(m.pattern.template), note="inlined LLM-written kernel")[0]
    except Exception as e:  # noqa: BLE001
        log.warning("could not place the inlined LLM islands in the report's regions (%s: %s)", type(e).__name__, e)
        return analysis
