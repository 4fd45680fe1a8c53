"""Kernel source locations of API calls.

Errors must name the kernel ``file:line`` of the offending call and the profile attributes every instruction
to a source line.  We walk the Python stack from the API entry point outwards, skipping the interpreter's
own frames: the first frame outside this package is the *call site*; the first frame whose file is the
kernel's file is the *kernel line* (they differ when the kernel calls helpers in other files).
"""

from __future__ import annotations

import os
import sys
from types import FrameType

_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _is_internal(filename: str) -> bool:
    return filename.startswith(_PKG_DIR)


def call_site(depth: int = 2) -> tuple[str, int]:
    """(filename, line) of the innermost frame outside fusegraph.nkisim."""
    f: FrameType | None = sys._getframe(depth)
    while f is not None and _is_internal(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return ("<unknown>", 0)
    return (f.f_code.co_filename, f.f_lineno)


def describe(kernel_file: str | None, depth: int = 2) -> str:
    """Human-readable location: ``kernel.py:12`` or ``helper.py:40 (kernel kernel.py:12)``."""
    f: FrameType | None = sys._getframe(depth)
    while f is not None and _is_internal(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return "<unknown>"
    inner = f"{f.f_code.co_filename}:{f.f_lineno}"
    if kernel_file is None or f.f_code.co_filename == kernel_file:
        return inner
    g: FrameType | None = f.f_back
    while g is not None and g.f_code.co_filename != kernel_file:
        g = g.f_back
    if g is None:
        return inner
    return f"{g.f_code.co_filename}:{g.f_lineno} (via {inner})"
