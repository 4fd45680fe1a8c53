"""``nl.dynamic_range``: a hardware loop whose body is traced once and replayed per iteration.

Real NKI does not run a ``dynamic_range`` body as Python once per iteration: the compiler traces it once into one
block of instructions that the hardware loop instruction re-executes (SDK 2.29 ``nki/deep-dives/
nki-dynamic-loops.rst``, "Hardware Lowering": "a single copy of the body is generated and the hardware iterates over
it at runtime"; "Register Allocation Implications": "Tensors allocated inside the loop body are allocated once and
reused across iterations").  So the interpreter does the same: the Python body runs once (iteration 0, executed as
it is traced), every NKI API call it makes is recorded with its arguments, and iterations 1..n-1 re-issue the
recorded calls with the induction register bound to the iteration's value.  What this means for a kernel:

* a tensor allocated in the body is the same tensor in every iteration (a replayed ``nl.zeros`` re-zeroes it);
* a Python name rebound in the body does not become a new tensor per iteration: the replayed instructions keep
  the operands they were traced with;
* a decision an instruction takes when it is traced is one static flag (``nc_matmul(accumulate=None)`` overwrites
  or accumulates in every iteration alike, as its single ``acc_flags`` does);
* the induction variable is a :class:`~.registers.InductionRegister`, a runtime value: a Python ``if`` on it,
  ``range()`` of it, arithmetic on it and writing it (``register_move`` / ``register_load``) are errors.

A dynamic ``while reg:`` loop (language guide, "Dynamic Control Flow") is the same kind of hardware loop: its body is
traced in its first iteration and replayed while the register is non-zero (:func:`while_test`); the register is
re-read after every iteration, so the body's own ``register_load`` / ``register_move`` decide when it stops.

A loop whose trip count is zero in the run is not traced (its body's Python never runs; a nested loop with zero
iterations when its outer body was traced and more later raises ``not-implemented``). The compiler traces such a
body anyway, so an error in it is a compile error on hardware and none here: the interpreter is looser there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from . import location
from .context import LoopState, ProgramContext, current, maybe_current  # noqa: F401 - LoopState re-exported
from .errors import NkiNotImplementedError, NkiValidationError
from .registers import InductionRegister, VirtualRegister

DOC = "nki/deep-dives/nki-dynamic-loops.rst"

#: official functions that are no instruction (allocation, queries, views, iterators): not recorded, so a replayed
#: iteration never re-allocates or re-initialises (a register is allocated and initialised once, like a tile)
NOT_INSTRUCTIONS = frozenset({
    "ndarray", "empty_like", "ds", "affine_range", "sequential_range", "static_range", "dynamic_range",
    "program_id", "num_programs", "program_ndim", "no_reorder", "is_hbm", "is_on_chip", "is_psum", "is_sbuf",
    "expand_dims", "register_alloc", "get_nc_version", "rank_id",
})


@dataclass(eq=False)
class Call:
    """One NKI API call of a traced loop body: what replaying it re-issues, where, and what its trace decided."""

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    site: tuple[str, int]
    where: str
    allocs: list = field(default_factory=list)  # tensors the call allocated when traced, reused when replayed
    statics: list = field(default_factory=list)  # static decisions taken when traced (accumulate flags)


@dataclass(eq=False)
class LoopRecord:
    """A ``dynamic_range`` loop: its bound operands (ints or registers), its induction register and traced body."""

    start: Any
    stop: Any
    step: int
    reg: InductionRegister
    where: str
    body: list | None = None  # None: not traced (zero iterations when it was reached)


@dataclass(eq=False)
class WhileRecord:
    """A dynamic ``while reg:`` loop: its condition register, the Python frame and line of its test, traced body."""

    reg: VirtualRegister
    key: tuple
    where: str
    body: list | None = None


#: iterations after which a replayed ``while reg:`` is taken for a runaway loop (the register never reaches 0)
WHILE_MAX_ITERATIONS = 1 << 20


def traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an official API function so a call made by a ``dynamic_range`` body being traced is recorded."""

    @functools.wraps(fn)
    def api(*args: Any, **kwargs: Any) -> Any:
        ctx = maybe_current()
        if ctx is None:
            return fn(*args, **kwargs)
        L = ctx.loops
        if not L.frames or L.call is not None:  # not tracing, or called by a recorded call
            return fn(*args, **kwargs)
        entry = Call(fn, args, kwargs, location.call_site(2), location.describe(ctx.run.kernel_file, 2))
        L.frames[-1].append(entry)
        L.call = entry
        try:
            return fn(*args, **kwargs)
        finally:
            L.call = None

    return api


def reused_allocation(ctx: ProgramContext) -> Any:
    """The tensor the replayed call allocated when it was traced (None outside a replay: allocate a new one)."""
    L = ctx.loops
    c = L.call
    if c is None or not L.replaying:
        return None
    if L.alloc_pos >= len(c.allocs):
        raise NkiValidationError(
            "a replayed nl.dynamic_range iteration allocates more tensors than its traced body did", rule="loop",
            location=c.where,
        )
    t = c.allocs[L.alloc_pos]
    L.alloc_pos += 1
    return t


def keep_allocation(ctx: ProgramContext, t: Any) -> Any:
    """Remember a tensor allocated by a call being traced (its replays reuse it); returns ``t``."""
    L = ctx.loops
    if L.call is not None and not L.replaying:
        L.call.allocs.append(t)
    return t


def static_choice(ctx: ProgramContext, decide: Callable[[], Any]) -> Any:
    """A decision the compiler takes once per instruction: computed when traced, reused by every replay."""
    L = ctx.loops
    c = L.call
    if c is None:
        return decide()
    if L.replaying:
        v = c.statics[L.static_pos]
        L.static_pos += 1
        return v
    v = decide()
    c.statics.append(v)
    return v


def _bound(v: Any, arg: str, where: str) -> int:
    if isinstance(v, VirtualRegister):
        if v.value is None:
            raise NkiValidationError(f"nl.dynamic_range: {arg} register {v.name} is read before it was written",
                                     rule="register", location=where)
        return int(v.value)
    return int(v)


def _trips(rec: LoopRecord) -> tuple[int, int]:
    lo = _bound(rec.start, "start", rec.where)
    hi = _bound(rec.stop, "stop", rec.where)
    return lo, len(range(lo, hi, rec.step))


def _check_args(ctx: ProgramContext, start: Any, stop: Any, step: Any) -> None:
    where = ctx.where()
    if isinstance(step, VirtualRegister):
        raise NkiValidationError(
            f"nl.dynamic_range: step must be a compile-time positive int, got register {step.name} (the hardware "
            f"loop instruction encodes the step as an immediate; {DOC}, 'Parameter Constraints')",
            rule="loop", location=where)
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step <= 0:
        raise NkiValidationError(f"nl.dynamic_range: step must be a compile-time positive int, got {step!r} ({DOC})",
                                 rule="loop", location=where)
    for arg, v in (("start", start), ("stop", stop)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer, VirtualRegister)):
            raise NkiValidationError(f"nl.dynamic_range: {arg} must be an int or a VirtualRegister, got {v!r}",
                                     rule="loop", location=where)
    if ctx.loops.no_reorder:
        raise NkiValidationError(
            f"nl.dynamic_range inside nl.no_reorder() is not supported ({DOC}, 'Interaction with no_reorder'); "
            f"put the no_reorder block inside the loop body", rule="loop", location=where)


class DynamicLoop:
    """The iterator of one ``for i in nl.dynamic_range(...)``: yields the induction register once (the trace),
    then replays the traced body for the remaining iterations."""

    def __init__(self, start: Any, stop: Any = None, step: Any = 1):
        ctx = current("nl.dynamic_range")
        if stop is None:
            start, stop = 0, start
        _check_args(ctx, start, stop, step)
        self.ctx = ctx
        self.rec = LoopRecord(start, stop, int(step), InductionRegister(name="dynamic_range"), ctx.where())
        self.state = 0
        self.lo = 0
        self.trips = 0

    def __iter__(self) -> "DynamicLoop":
        return self

    def __next__(self) -> InductionRegister:
        if self.state == 0:
            return self._begin()
        if self.state == 1:
            self._finish()
        raise StopIteration

    def _begin(self) -> InductionRegister:
        L = self.ctx.loops
        rec = self.rec
        if L.frames:  # nested in a body being traced: the outer replays re-run this loop as a whole
            L.frames[-1].append(rec)
        self.lo, self.trips = _trips(rec)
        if self.trips == 0:
            self.state = 2
            raise StopIteration
        rec.body = []
        rec.reg.value = self.lo
        L.frames.append(rec.body)
        L.open.append(rec)
        self.state = 1
        return rec.reg

    def _finish(self) -> None:
        L = self.ctx.loops
        if not L.open or L.open[-1] is not self.rec:
            raise NkiValidationError("nl.dynamic_range: loops closed out of order", rule="loop", location=self.rec.where)
        L.frames.pop()
        L.open.pop()
        self.state = 2
        rec = self.rec
        for k in range(1, self.trips):
            rec.reg.value = self.lo + k * rec.step
            replay(self.ctx, rec.body)


def _truth(reg: VirtualRegister, where: str) -> bool:
    if reg.value is None:
        raise NkiValidationError(f"register {reg.name} is read before it was written", rule="register", location=where)
    return bool(reg.value)


def while_test(ctx: ProgramContext, reg: VirtualRegister, frame: Any) -> bool:
    """Python's test of ``while reg:`` (``reg.__bool__``), at ``frame``'s line. The first test opens the loop: false,
    the body never runs (not traced); true, the body's first iteration runs as it is traced. The next test from the
    same frame and line closes the trace and replays the body while the register is non-zero, then answers False so
    Python leaves its ``while`` (the hardware ran the other iterations)."""
    L = ctx.loops
    key = (id(frame), frame.f_code, frame.f_lineno)
    top = L.open[-1] if L.open else None
    if isinstance(top, WhileRecord) and top.key == key:
        L.frames.pop()
        L.open.pop()
        _run_while(ctx, top)
        return False
    where = ctx.where()
    if not _truth(reg, where):
        return False
    rec = WhileRecord(reg, key, where, [])
    if L.frames:  # nested in a body being traced: the outer replays re-run this loop as a whole
        L.frames[-1].append(rec)
    L.frames.append(rec.body)
    L.open.append(rec)
    return True


def _run_while(ctx: ProgramContext, rec: WhileRecord) -> None:
    """The hardware iterations after a ``while reg:`` body's traced one: replay while the register is non-zero."""
    n = 0
    while _truth(rec.reg, rec.where):
        n += 1
        if n > WHILE_MAX_ITERATIONS:
            raise NkiValidationError(
                f"while {rec.reg.name}: still non-zero after {WHILE_MAX_ITERATIONS} replayed iterations (the body "
                f"never writes the register to 0?)", rule="loop", location=rec.where)
        replay(ctx, rec.body)


def replay(ctx: ProgramContext, body: list) -> None:
    """Re-issue a traced body's calls (and nested loops) in order."""
    for e in body:
        if isinstance(e, LoopRecord):
            _replay_loop(ctx, e)
        elif isinstance(e, WhileRecord):
            _replay_while(ctx, e)
        else:
            _replay_call(ctx, e)


def _replay_while(ctx: ProgramContext, rec: WhileRecord) -> None:
    if not _truth(rec.reg, rec.where):
        return
    if rec.body is None:
        raise NkiNotImplementedError(
            "a nested while loop had no iteration when its outer loop's body was traced and has some now",
            rule="not-implemented", location=rec.where)
    replay(ctx, rec.body)
    _run_while(ctx, rec)


def _replay_loop(ctx: ProgramContext, rec: LoopRecord) -> None:
    lo, trips = _trips(rec)
    if trips and rec.body is None:
        raise NkiNotImplementedError(
            "a nested nl.dynamic_range had no iteration when its outer loop's body was traced and has some now; "
            "fusegraph's interpreter traces a body only when it runs (give the inner loop an iteration in the "
            "outer loop's first iteration)", rule="not-implemented", location=rec.where)
    for k in range(trips):
        rec.reg.value = lo + k * rec.step
        replay(ctx, rec.body)


def _replay_call(ctx: ProgramContext, c: Call) -> None:
    L = ctx.loops
    saved = (L.call, L.replaying, L.alloc_pos, L.static_pos, L.site, L.where)
    L.call, L.replaying, L.alloc_pos, L.static_pos, L.site, L.where = c, True, 0, 0, c.site, c.where
    try:
        c.fn(*c.args, **c.kwargs)
    finally:
        L.call, L.replaying, L.alloc_pos, L.static_pos, L.site, L.where = saved


def check_closed(ctx: ProgramContext) -> None:
    """At the kernel's end: a body left by ``break`` / ``return`` never finished its hardware loop."""
    L = ctx.loops
    if L.open:
        rec = L.open[-1]
        L.open.clear()
        L.frames.clear()
        if isinstance(rec, WhileRecord):
            raise NkiValidationError(
                f"register {rec.reg.name} was tested as a Python condition and its loop never came back to the test: "
                f"only `while reg:` is NKI (a hardware loop, language guide 'Dynamic Control Flow'); `if reg:` is "
                f"not, and a while body left by break/return never finished its hardware loop", rule="loop",
                location=rec.where)
        raise NkiValidationError(
            "the body of a nl.dynamic_range was left by break/return: a hardware loop has one body that runs every "
            f"iteration ({DOC})", rule="loop", location=rec.where)
