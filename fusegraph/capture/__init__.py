"""Capture: dynamo graph -> ATen graph (aot_autograd) -> fusegraph program, linked across graph breaks."""
from .checks import CaptureRefused, check_capturable
from .session import CaptureSession, explicit_session, last_session, session_for

__all__ = ["CaptureRefused", "CaptureSession", "check_capturable", "explicit_session", "last_session", "session_for"]
