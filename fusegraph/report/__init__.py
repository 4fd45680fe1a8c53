"""The fused-region report: data model (``model``), terminal table (``text``), and ``explain`` (``api``).

JSON schema: ``docs/report.md``.
"""
from .api import explain, report_for_session
from .model import SCHEMA, Report, build_report
from .text import format_report

__all__ = ["SCHEMA", "Report", "build_report", "explain", "format_report", "report_for_session"]
