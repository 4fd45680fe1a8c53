"""Kernel source locations of API calls.

Errors must name the kernel ``file:line`` of the offending call and the profile attributes every instruction
to a source line.  We walk the Python stack from the API entry point outwards, skipping the interpreter's
own frames: the first frame outside this package is the *call site*; the first frame whose file is the
kernel's file is the *kernel line* (they differ when the kernel calls helpers in other files).

Line numbers come from :func:`frame_line`, not ``frame.f_lineno``: CPython (3.11 unless the code object happens
to have its line array, 3.12+ always) computes ``f_lineno`` by scanning the code object's line table from the
start, which is O(length of the function) per lookup -- quadratic over a generated straight-line megakernel
(one function of tens of thousands of lines).  :func:`frame_line` maps the frame's bytecode offset
(``f_lasti``) through a per-code-object table built once from ``code.co_lines()`` (the same table ``f_lineno``
reads), so each lookup is O(1).
"""

from __future__ import annotations

import os
import sys
import threading
from array import array
from types import CodeType, FrameType

_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

#: code objects with fewer code units than this use ``f_lineno`` directly (the scan is short)
SMALL_CODE_UNITS = 512
#: at most this many line tables are kept (the cache is cleared, not evicted one by one, when it is full)
MAX_TABLES = 256

# id(code) -> (code, table).  Keyed by id: hashing a code object hashes its constants (O(size) per lookup);
# the code object itself is kept in the value so its id cannot be reused while the entry exists.
_tables: dict[int, tuple[CodeType, array | None]] = {}
_tables_lock = threading.Lock()


def _is_internal(filename: str) -> bool:
    return filename.startswith(_PKG_DIR)


def line_table(code: CodeType) -> array | None:
    """``table[f_lasti // 2]`` is the source line of the instruction at that offset (0: no line).

    ``None`` for small code objects (``f_lineno`` is cheap there).  Built once per code object and cached.
    """
    hit = _tables.get(id(code))
    if hit is not None and hit[0] is code:
        return hit[1]
    units = len(code.co_code) // 2
    table: array | None = None
    if units >= SMALL_CODE_UNITS:
        table = array("I", bytes(4 * units))
        for start, end, line in code.co_lines():
            lo, hi = start >> 1, min(end >> 1, units)
            if line is not None and line > 0 and hi > lo:
                table[lo:hi] = array("I", (line,)) * (hi - lo)
    with _tables_lock:
        if len(_tables) >= MAX_TABLES:
            _tables.clear()
        _tables[id(code)] = (code, table)
    return table


def frame_line(f: FrameType) -> int:
    """``f.f_lineno`` in O(1) (see the module docstring)."""
    code = f.f_code
    hit = _tables.get(id(code))  # (the hot path of line_table, inlined)
    table = hit[1] if hit is not None and hit[0] is code else line_table(code)
    if table is not None:
        i = f.f_lasti >> 1
        if 0 <= i < len(table):
            line = table[i]
            if line:
                return line
    return f.f_lineno


def clear_cache() -> None:
    """Forget every cached line table (tests; code objects are otherwise kept alive by the cache)."""
    with _tables_lock:
        _tables.clear()


def call_site(depth: int = 2) -> tuple[str, int]:
    """(filename, line) of the innermost frame outside fusegraph.nkisim."""
    f: FrameType | None = sys._getframe(depth)
    while f is not None and _is_internal(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return ("<unknown>", 0)
    return (f.f_code.co_filename, frame_line(f))


def describe(kernel_file: str | None, depth: int = 2) -> str:
    """Human-readable location: ``kernel.py:12`` or ``helper.py:40 (kernel kernel.py:12)``."""
    f: FrameType | None = sys._getframe(depth)
    while f is not None and _is_internal(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return "<unknown>"
    inner = f"{f.f_code.co_filename}:{frame_line(f)}"
    if kernel_file is None or f.f_code.co_filename == kernel_file:
        return inner
    g: FrameType | None = f.f_back
    while g is not None and g.f_code.co_filename != kernel_file:
        g = g.f_back
    if g is None:
        return inner
    return f"{g.f_code.co_filename}:{frame_line(g)} (via {inner})"
