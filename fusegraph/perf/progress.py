"""Terminal progress for the long steps (capture, codegen, shape-only profiling of 48 layers, the cost model).

Progress goes to stderr, and only when stderr is a terminal or it was asked for (``enabled=True`` or
``FUSEGRAPH_PROGRESS=1``), so piped output and logs stay clean. The shape-only run of a megakernel is one long
Python call; :class:`KernelLineMonitor` reports which decoder layer it is in by sampling, from a helper thread,
the line the kernel's frame is executing (no hook on the hot path).
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TextIO

_LAYER_HEADER = re.compile(r"^\s*# =+ decoder layer (\d+) =+")


def _wanted(enabled: bool | None, stream: TextIO) -> bool:
    if enabled is not None:
        return enabled
    env = os.environ.get("FUSEGRAPH_PROGRESS", "").strip().lower()
    if env in ("1", "true", "yes", "on"):
        return True
    if env in ("0", "false", "no", "off"):
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """Step-by-step progress lines on stderr (no-op when disabled)."""

    def __init__(self, enabled: bool | None = None, stream: TextIO | None = None, prefix: str = "fusegraph") -> None:
        self.stream = stream or sys.stderr
        self.enabled = _wanted(enabled, self.stream)
        self.prefix = prefix
        self._lock = threading.Lock()
        self._live = False

    def _write(self, text: str, end: str = "\n") -> None:
        if not self.enabled:
            return
        with self._lock:
            if self._live:
                self.stream.write("\r\033[K")
            self.stream.write(f"[{self.prefix}] {text}{end}")
            self.stream.flush()
            self._live = end != "\n"

    def note(self, text: str) -> None:
        self._write(text)

    def update(self, text: str) -> None:
        """Overwrite the current status line (a running step)."""
        self._write(text, end="")

    @contextmanager
    def step(self, label: str) -> Iterator[None]:
        t0 = time.perf_counter()
        self.update(f"{label} ...")
        try:
            yield
        finally:
            self._write(f"{label}: {time.perf_counter() - t0:.1f} s")


def layer_of_lines(source: str) -> list[int]:
    """``layers[i]`` = the decoder layer whose code contains source line ``i + 1`` (-1 outside the layers)."""
    layers = []
    current = -1
    for text in source.splitlines():
        m = _LAYER_HEADER.match(text)
        if m:
            current = int(m.group(1))
        elif text.lstrip().startswith("# ======== outside"):
            current = -1
        layers.append(current)
    return layers


class KernelLineMonitor:
    """While a kernel runs in this thread, report its current decoder layer every ``interval`` seconds."""

    def __init__(self, source: str, function: str, report: Callable[[str], None], total_layers: int,
                 interval: float = 0.5) -> None:
        self.layers = layer_of_lines(source)
        self.function = function
        self.report = report
        self.total = total_layers
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _current_layer(self) -> int | None:
        from fusegraph.nkisim.location import frame_line  # (lazy: importing the interpreter is not free)

        for frame in sys._current_frames().values():  # the kernel may run in a worker thread (LNC=2)
            while frame is not None:
                if frame.f_code.co_name == self.function:
                    line = frame_line(frame)  # O(1), unlike f_lineno on a huge generated function
                    return self.layers[line - 1] if 0 < line <= len(self.layers) else None
                frame = frame.f_back
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            layer = self._current_layer()
            el = time.perf_counter() - self._t0
            if layer is None:
                continue
            where = f"layer {layer + 1}/{self.total}" if layer >= 0 else "outside the layers"
            self.report(f"profiling (shape-only): {where}, {el:.0f} s")

    def __enter__(self) -> "KernelLineMonitor":
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="fusegraph-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
