"""Progress of the long steps (capture, codegen, shape-only profiling of 48 layers, the cost model) on stderr.

Library calls print progress only when stderr is a terminal or it was asked for (``enabled=True`` or
``FUSEGRAPH_PROGRESS=1``), so piped output and logs stay clean; the ``fusegraph`` commands
(:meth:`Progress.for_cli`) print it unless ``FUSEGRAPH_PROGRESS=0``, because a command that is silent for
minutes in a CI log or behind a pipe looks hung. On a terminal one status line is rewritten in place and finished
(:meth:`Progress.finish`) before a result is printed; elsewhere every stage is its own flushed line and a
repeated status (the same text up to its numbers) is printed at most once per heartbeat. While a step runs, a
heartbeat names it and its elapsed time whenever nothing was printed for ``heartbeat`` seconds. The shape-only
run of a megakernel is one long Python call; :class:`KernelLineMonitor` reports which decoder layer it is in by
sampling, from a helper thread, the line the kernel's frame is executing (no hook on the hot path).
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
_NUMBERS = re.compile(r"[0-9.]+")


class UsageError(ValueError):
    """A command was given input it cannot use (unknown model, bad option value): the CLI prints its one-line
    message as ``fusegraph: error: ...`` and exits 2, the argparse convention, instead of a traceback."""


def _env_choice() -> bool | None:
    env = os.environ.get("FUSEGRAPH_PROGRESS", "").strip().lower()
    if env in ("1", "true", "yes", "on"):
        return True
    if env in ("0", "false", "no", "off"):
        return False
    return None


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _wanted(enabled: bool | None, stream: TextIO) -> bool:
    if enabled is not None:
        return enabled
    env = _env_choice()
    return env if env is not None else _isatty(stream)


class Progress:
    """Step-by-step progress on stderr (no-op when disabled): a live status line on a terminal, lines elsewhere."""

    def __init__(self, enabled: bool | None = None, stream: TextIO | None = None, prefix: str = "fusegraph", *,
                 live: bool | None = None, heartbeat: float | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = _wanted(enabled, self.stream)
        self.live = _isatty(self.stream) if live is None else live
        self.heartbeat = heartbeat if heartbeat is not None else (1.0 if self.live else 10.0)
        self.prefix = prefix
        self._lock = threading.Lock()
        self._live = False  # a status line without its newline is on the terminal
        self._last_write = time.monotonic()
        self._last_key: str | None = None
        self._steps: list[tuple[str, float]] = []
        self._status = ""  # the last status text (a terminal heartbeat adds the elapsed time to it)
        self._beat: threading.Thread | None = None
        self._beat_stop = threading.Event()

    @classmethod
    def for_cli(cls, stream: TextIO | None = None, heartbeat: float | None = None) -> "Progress":
        """The progress of a ``fusegraph`` command: on unless ``FUSEGRAPH_PROGRESS=0``, terminal or not."""
        env = _env_choice()
        return cls(True if env is None else env, stream, heartbeat=heartbeat)

    def _write(self, text: str, end: str = "\n") -> None:
        if not self.enabled:
            return
        with self._lock:
            now = time.monotonic()
            if not self.live:
                if end != "\n":  # a status: once per distinct stage, else once per heartbeat
                    key = _NUMBERS.sub("#", text)
                    if key == self._last_key and now - self._last_write < self.heartbeat:
                        return
                    self._last_key = key
                else:
                    self._last_key = None
                end = "\n"
            elif self._live:
                self.stream.write("\r\033[K")
            self.stream.write(f"[{self.prefix}] {text}{end}")
            self.stream.flush()
            self._live = end != "\n"
            self._last_write = now

    def note(self, text: str) -> None:
        self._write(text)

    def update(self, text: str) -> None:
        """Overwrite the current status line (a running step); off a terminal, a line when the stage changed."""
        self._status = text
        self._write(text, end="")

    def finish(self) -> None:
        """End a pending status line, so that what is printed next starts on a line of its own."""
        if not self.enabled:
            return
        with self._lock:
            if self._live:
                self.stream.write("\n")
                self.stream.flush()
                self._live = False

    @contextmanager
    def step(self, label: str) -> Iterator[None]:
        t0 = time.perf_counter()
        self.update(f"{label} ...")
        with self._lock:
            self._steps.append((label, t0))
        self._start_heartbeat()
        try:
            yield
        finally:
            with self._lock:
                self._steps.pop()
                last = not self._steps
            if last:
                self._stop_heartbeat()
            self._write(f"{label}: {time.perf_counter() - t0:.1f} s")

    # ---- heartbeat ------------------------------------------------------------------------------------------------
    def _start_heartbeat(self) -> None:
        if not self.enabled or self._beat is not None:
            return
        self._beat_stop.clear()
        self._beat = threading.Thread(target=self._beats, name="fusegraph-heartbeat", daemon=True)
        self._beat.start()

    def _stop_heartbeat(self) -> None:
        beat, self._beat = self._beat, None
        if beat is not None:
            self._beat_stop.set()
            beat.join(timeout=2)

    def _beats(self) -> None:
        tick = min(self.heartbeat, 1.0) / 2
        while not self._beat_stop.wait(tick):
            with self._lock:
                quiet = time.monotonic() - self._last_write
                label, t0 = self._steps[-1] if self._steps else ("", 0.0)
            if label and quiet >= self.heartbeat:
                elapsed = time.perf_counter() - t0
                if self.live:  # the status stays what it was, with the step's time: "... layer 3/48 [12 s]"
                    self._write(f"{self._status or label} [{elapsed:.0f} s]", end="")
                else:
                    self._write(f"{label} ... {elapsed:.0f} s", end="")


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
