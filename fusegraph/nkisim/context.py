"""Per-run and per-program interpreter state.

A *run* executes one kernel launch: ``lnc`` programs (LNC=2 runs two Python threads) on each of ``ranks``
simulated ranks.  Each program has private SBUF/PSUM accounting, engine accumulator registers and a profile
recorder; HBM ``shared_hbm`` allocations are shared between the programs of a rank.  The current program is
found through a thread-local, so the NKI API functions need no extra arguments.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import location
from .errors import NkiUsageError
from .memory import MemoryTracker
from .profile import Recorder
from .targets import Target
from .trace import Tracer

_tls = threading.local()


@dataclass
class RunState:
    """State shared by all programs/ranks of one kernel launch."""

    target: Target
    lnc: int
    ranks: int
    shape_only: bool
    assume: Any
    kernel_name: str
    kernel_file: str | None
    sbuf_budget: int
    max_records: int
    sbuf_overflow: str = "error"  # memory.resolve_sbuf_overflow: live SBUF beyond the budget raises or is recorded
    grid_ndim: int = 0
    trace: bool = False  # record every instruction (fusegraph.nkisim.trace)
    trace_layer: str | None = None  # "function:variable" read into every trace event
    sync: Any = None  # fusegraph.nkisim.sync.SyncHub
    transport: Any = None  # fusegraph.nkisim.transport: where nki.collectives data goes (threads or torch.distributed)
    lock: threading.Lock = field(default_factory=threading.Lock)
    shared_allocs: dict[tuple, Any] = field(default_factory=dict)


class LoopState:
    """Per-program ``nl.dynamic_range`` tracing state (``ProgramContext.loops``; used by :mod:`.loops`)."""

    __slots__ = ("frames", "open", "call", "replaying", "alloc_pos", "static_pos", "site", "where", "no_reorder")

    def __init__(self) -> None:
        self.frames: list[list] = []  # body lists being traced, innermost last
        self.open: list[Any] = []  # loops (loops.LoopRecord) whose body is being traced
        self.call: Any = None  # the recorded call (loops.Call) running now, traced or replayed
        self.replaying = False
        self.alloc_pos = 0
        self.static_pos = 0
        self.site: tuple[str, int] | None = None  # a replayed call's kernel site (ProgramContext.site)
        self.where: str | None = None  # and its description (ProgramContext.where)
        self.no_reorder = 0  # depth of nl.no_reorder() blocks


class ProgramContext:
    """One program (physical core) of one rank."""

    def __init__(self, run: RunState, program_id: int, rank: int):
        self.run = run
        self.program_id = program_id
        self.rank = rank
        self.target = run.target
        self.shape_only = run.shape_only
        self.mem = MemoryTracker(run.target, run.sbuf_budget, run.sbuf_overflow)
        tracer = Tracer(run.trace_layer) if run.trace else None
        self.rec = Recorder(program_id, rank, run.max_records, tracer)
        self.act_regs = np.zeros(128, dtype=np.float32)  # ScalarE reduce registers
        self.vec_regs = np.zeros(128, dtype=np.float32)  # VectorE accumulator registers
        self.shared_counts: dict[tuple, int] = {}
        self.alloc_seq = 0
        self.collective_seq = 0
        self.collective_log: dict[tuple, dict] = {}  # nki.collectives per call site (Profile.collectives)
        self.sendrecv_seq: dict[int, int] = {}
        # runtime-offset views resolved by the running instruction: id(view) -> (view, direct view)
        self.ind_cache: dict[int, tuple[Any, Any]] = {}
        self.instr_name = ""  # the running instruction (set by checks.Instr), for errors raised below it
        self.loops = LoopState()  # nl.dynamic_range bodies traced / replayed (fusegraph.nkisim.loops)

    # ---- location helpers (hot path) ----
    def where(self, depth: int = 3) -> str:
        w = self.loops.where  # a replayed loop iteration: the line the call was traced at
        return w if w is not None else location.describe(self.run.kernel_file, depth)

    def site(self, depth: int = 3) -> tuple[str, int]:
        s = self.loops.site
        return s if s is not None else location.call_site(depth)


def current(api: str = "this NKI API") -> ProgramContext:
    """The program executing on this thread; error if no kernel is running."""
    ctx = getattr(_tls, "ctx", None)
    if ctx is None:
        raise NkiUsageError(
            f"{api} was called outside a running kernel; call the kernel (an @nki.jit function) inside "
            f"fusegraph.nkisim.as_nki() or through fusegraph.nkisim.run()",
            rule="no-kernel",
        )
    return ctx


def maybe_current() -> ProgramContext | None:
    return getattr(_tls, "ctx", None)


class activate:
    """Context manager binding a ProgramContext to the current thread."""

    def __init__(self, ctx: ProgramContext):
        self.ctx = ctx
        self.prev: ProgramContext | None = None

    def __enter__(self) -> ProgramContext:
        self.prev = getattr(_tls, "ctx", None)
        _tls.ctx = self.ctx
        return self.ctx

    def __exit__(self, *exc: object) -> None:
        _tls.ctx = self.prev


# Session-level defaults set by as_nki() / the CLI (target and LNC of kernels launched without explicit ones).
_session: dict[str, Any] = {"target": None, "lnc": None}


def session_lnc() -> int | None:
    return _session.get("lnc")


def set_session_lnc(lnc: int | None) -> int | None:
    prev = _session.get("lnc")
    _session["lnc"] = lnc
    return prev


def session_target() -> Any:
    return _session.get("target")


def set_session_target(target: Any) -> Any:
    prev = _session.get("target")
    _session["target"] = target
    return prev

