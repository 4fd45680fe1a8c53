"""The fused-region report: data model (``model``), terminal table (``text``), a session's report (``api``).

JSON schema: ``docs/report.md``. ``fusegraph.explain()`` (capture + report) is in :mod:`fusegraph.api`.
"""
from .api import report_for_session
from .model import SCHEMA, Report, build_report
from .text import format_report

__all__ = ["SCHEMA", "Report", "build_report", "format_report", "report_for_session"]
