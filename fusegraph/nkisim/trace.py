"""An optional per-instruction trace: every instruction in program order with what it read and wrote.

The profile aggregates per source line, which is what a straight-line generated kernel needs.  A third-party kernel
(a layer loop calling helpers in other files) executes one helper line many times, in different layers, on
different tensors; costing it needs the instruction stream itself.  With ``run(..., trace=True)`` every program
records one :class:`TraceEvent` per instruction: its site, engine and sizes (as the profile counts them), the DMA
details, the tensors (storages) it read and wrote -- the dependencies -- and optionally the value of a Python
variable of the kernel (``trace_layer="function:variable"``, e.g. the layer loop's index) so time can be attributed
to decoder layers.  ``Profile.trace`` holds the events per ``(rank, program)``; it is not part of ``to_dict()``.

Off by default: tracing costs a list append per operand and a stack walk per instruction.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from .location import frame_line


@dataclass(slots=True)
class TraceEvent:
    """One instruction of one program."""

    index: int
    file: str
    line: int
    opcode: str
    engine: str
    partitions: int
    free: int
    dtype: str  # output dtype
    name: str  # the instruction's name= ('' when absent)
    inputs: tuple  # ((argument, dtype), ...) of its input tensors
    reads: tuple[str, ...]  # storages (and registers) read: "s<id>" / "r<id>"
    writes: tuple[str, ...]
    partial: bool  # some write covers only part of its storage
    buffers: tuple[tuple[str, str], ...]  # (storage key, memory: sbuf/psum/hbm) of every operand
    dma: dict[str, Any] | None = None  # bytes, read/write bytes, partitions, descriptors, queue, dge_mode, ...
    layer: int | None = None  # value of the traced layer variable, None outside it


class Tracer:
    """Collects the events of one program; :meth:`touch` is called for every operand of the running instruction."""

    __slots__ = ("events", "reads", "writes", "partial", "buffers", "pending_dma", "layer_func", "layer_var")

    def __init__(self, layer: str | None = None):
        self.events: list[TraceEvent] = []
        self.reads: list[str] = []
        self.writes: list[str] = []
        self.partial = False
        self.buffers: dict[str, str] = {}
        self.pending_dma: dict[str, Any] | None = None
        self.layer_func, self.layer_var = _parse_layer(layer)

    def begin(self) -> None:
        """A new instruction starts: forget the operands of the previous one."""
        self.reads = []
        self.writes = []
        self.partial = False
        self.buffers = {}
        self.pending_dma = None

    def touch(self, key: str, write: bool, partial: bool = False, buffer: str = "") -> None:
        (self.writes if write else self.reads).append(key)
        if write and partial:
            self.partial = True
        if buffer:
            self.buffers[key] = buffer

    def event(self, index: int, site: tuple[str, int], opcode: str, engine: str, partitions: int, free: int,
              dtype: str, name: str | None, inputs: tuple) -> None:
        writes = tuple(dict.fromkeys(self.writes))
        reads = tuple(dict.fromkeys(self.reads))
        self.events.append(TraceEvent(
            index, site[0], site[1], opcode, engine, partitions, free, dtype, name or "", inputs, reads, writes,
            self.partial, tuple(self.buffers.items()), self.pending_dma, self._layer(),
        ))
        self.begin()

    def _layer(self) -> int | None:
        """The layer variable's value while the frame of ``layer_func`` is inside a ``for <layer_var> in`` loop body
        (after the loop Python keeps the last value: the epilogue belongs to no layer)."""
        if self.layer_func is None:
            return None
        f = sys._getframe(2)
        while f is not None:
            if f.f_code.co_name == self.layer_func:
                spans = _loop_spans(f.f_code, self.layer_var)
                line = frame_line(f)
                if spans is not None and not any(a <= line <= b for a, b in spans):
                    return None
                v = f.f_locals.get(self.layer_var)
                return int(v) if isinstance(v, int) and not isinstance(v, bool) else None
            f = f.f_back
        return None


_SPANS: dict[tuple[int, str], tuple[Any, list[tuple[int, int]] | None]] = {}


def _loop_spans(code: Any, var: str) -> list[tuple[int, int]] | None:
    """Line ranges of the bodies of ``for <var> in ...`` loops in ``code``'s function (None: source unavailable,
    the variable is then trusted wherever it is set)."""
    hit = _SPANS.get((id(code), var))
    if hit is not None and hit[0] is code:
        return hit[1]
    spans: list[tuple[int, int]] | None = None
    try:
        import ast
        import inspect
        import textwrap

        lines, start = inspect.getsourcelines(code)
        tree = ast.parse(textwrap.dedent("".join(lines)))
        spans = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.For, ast.AsyncFor)) and any(
                    isinstance(n, ast.Name) and n.id == var for n in ast.walk(node.target)):
                first = node.body[0].lineno
                last = max(getattr(n, "end_lineno", n.lineno) or n.lineno for n in node.body)
                spans.append((first + start - 1, last + start - 1))
    except (OSError, TypeError, SyntaxError):
        spans = None
    _SPANS[(id(code), var)] = (code, spans)
    return spans


def _parse_layer(spec: str | None) -> tuple[str | None, str | None]:
    if not spec:
        return None, None
    func, sep, var = spec.partition(":")
    if not sep or not func or not var:
        raise ValueError(f"trace_layer must be 'function:variable', got {spec!r}")
    return func, var


def storage_key(t: Any) -> str:
    return f"s{t._st.id}"


def covers_storage(t: Any) -> bool:
    """Whether a view spans its whole storage (a full write ends the earlier writers' reach)."""
    st = t._st
    return t._ind is None and t._offset == 0 and t.size * t.dtype.itemsize == st.nbytes
