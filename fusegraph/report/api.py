"""The report of a compile's capture session (what ``report=``/``dryrun`` and ``fusegraph report`` show).

``fusegraph.explain`` captures a step first, so it lives above the pipeline, in :mod:`fusegraph.api`.
"""
from __future__ import annotations

import logging

from ..capture.session import CaptureSession
from ..codegen.registry import check as lowerable
from ..matching.analyze import analyze
from .model import Report, build_report

log = logging.getLogger(__name__)


def report_for_session(session: CaptureSession) -> Report:
    """Analyze what a capture session holds (every graph of the step so far) and build its report."""
    analysis = analyze(session.program, session.settings, lowerable=lowerable)
    return build_report(analysis, session)
