"""Hardware loops (``nl.dynamic_range``) scheduled iteration by iteration, each iteration ending in a drain.

Why: the cost model schedules a kernel *line* with all its executions as one work item. For a Python loop that
the trace unrolls into a few lines this is a fair picture, but a hardware loop is one copy of its body that the
NeuronCore runs again and again, and the NKI docs say what that costs (docs/performance.md, "Hardware loops:
sourced entry"):

* the body's tiles are **allocated once and reused** across iterations (SDK 2.29 ``nki-dynamic-loops.rst``,
  "Register Allocation Implications"), so a body tile is *not* double-buffered: its next write waits for the
  previous iteration's last read (a write-after-read on the one buffer, PSUM included);
* **every iteration ends with a drain and a barrier across the engines** (the newer ``nki-control-flow`` page:
  its example runs 7.5 us unrolled and 17.9 us as a dynamic loop), so iteration k + 1 starts only when all of
  iteration k's work is done: the engines never work on two iterations at once, and every iteration pays its
  DMAs' fixed latency and its cross-engine semaphores again.

So each hardware loop with at least one iteration becomes its iterations in program order (at most
:data:`MAX_COPIES` copies; beyond that each copy stands for ``T / MAX_COPIES`` iterations: its cost, its DMAs'
fixed latency and its semaphore hand-offs scaled by that many), and a *drain* work item after every copy: it
starts when everything issued so far is done and holds every engine for ``loop_iteration_barrier`` per
iteration. Values allocated before the loop (the running max, sum and output) are loop-carried dependencies as
before. Loops the view does not mark as hardware loops keep the line-by-line costing. A kernel that wants its
engines to overlap across blocks must do it inside one iteration (the streamed attention's software-pipelined
loop computes block k's scores while block k - 1's softmax runs), or unroll.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Iterable, Sequence

#: the most copies one hardware loop is unrolled into (each stands for ``T / MAX_COPIES`` iterations)
MAX_COPIES = 64
#: the opcode and kind of the drain + cross-engine barrier that ends every iteration (engine: :data:`LOOP_ENGINE`)
BARRIER_OPCODE = "loop_barrier"
BARRIER_KIND = "barrier"
LOOP_ENGINE = "loop"

_SCALED = ("busy", "occupancy", "own", "ideal")
_SCALED_INT = ("nbytes", "hbm_read", "hbm_write")
_ZEROED = dict(occupancy=0.0, own=0.0, ideal=0.0, latency=0.0, nbytes=0, hbm_read=0, hbm_write=0, dep_ii=0.0,
               bytes_per_partition=0.0, descriptor_bytes=0.0, efficiency=1.0, tensor="", collective=None)


def trip_count(body: Sequence[Any], loop: int) -> int:
    """Iterations of hardware loop ``loop`` from its body's instruction counts: the gcd of the counts of the lines
    directly in the body (each runs once per iteration), 0 when some body line's count is not a multiple of it."""
    direct = [w.count for w in body if w.loops and w.loops[-1] == loop]
    t = 0
    for c in direct:
        t = math.gcd(t, int(c))
    if t <= 0 or any(int(w.count) % t for w in body):
        return 0
    return t


def _copy(w: Any, share: float, loops: tuple, iterations: float, copy: int) -> Any:
    """One copy's share of work ``w``: its cost fields scaled by ``share``; it stands for ``iterations`` drained
    iterations, so its DMA fixed latency is paid that many times (the queue is empty at each iteration's start)."""
    kw: dict[str, Any] = {k: getattr(w, k) * share for k in _SCALED}
    kw.update({k: int(round(getattr(w, k) * share)) for k in _SCALED_INT})
    kw["count"] = max(1, int(round(w.count * share)))
    kw["loops"] = loops
    kw["latency"] = w.latency * iterations
    kw["repeats"] = iterations
    kw["hw_copy"] = copy
    return replace(w, **kw)


def _barrier(last: Any, loop: int, iterations: float, barrier: float, copy: int) -> Any:
    """The drain + cross-engine barrier ending ``iterations`` iterations of hardware loop ``loop``."""
    return replace(last, kind=BARRIER_KIND, engine=LOOP_ENGINE, opcode=BARRIER_OPCODE, index=-loop,
                   count=max(1, int(round(iterations))), busy=barrier * iterations, name=f"{last.region}.loop_barrier",
                   line=loop, reads=(), writes=(), partial=False, loops=(), repeats=iterations, hw_copy=copy,
                   **_ZEROED)


def unroll_hardware_loops(works: Sequence[Any], buffers: dict[str, str], allocs: dict[int, list],
                          hw_loops: Iterable[int], *, barrier: float = 0.0
                          ) -> tuple[list[Any], dict[str, str], dict[int, list]]:
    """``(works, buffers, allocs)`` with every hardware loop of ``hw_loops`` (loop-header line numbers, as in
    :attr:`KernelLine.loops`) that ran at least once replaced by its iterations, each followed by a drain of
    ``barrier`` seconds (per iteration it stands for); the input is returned unchanged when there is none.
    The body's allocations happen once, before the first copy (tiles reused, not double-buffered). Nested
    hardware loops: the outermost is unrolled (its copies' inner loops stay lines)."""
    hw = set(hw_loops)
    if not hw:
        return list(works), buffers, allocs
    out: list[Any] = []
    new_allocs: dict[int, list] = {}
    i = 0
    n = len(works)
    while i < n:
        w = works[i]
        loop = next((lp for lp in w.loops if lp in hw), None)
        if loop is None:
            if i in allocs:
                new_allocs[len(out)] = list(allocs[i])
            out.append(w)
            i += 1
            continue
        j = i
        while j < n and loop in works[j].loops:
            j += 1
        body = list(works[i:j])
        T = trip_count(body, loop)
        if T < 1:  # no common trip count: the lines as they are
            for k in range(i, j):
                if k in allocs:
                    new_allocs[len(out)] = list(allocs[k])
                out.append(works[k])
            i = j
            continue
        copies = min(T, MAX_COPIES)
        share = 1.0 / copies
        per_copy = T / copies
        for c in range(copies):
            for k, bw in enumerate(body):
                pos = bw.loops.index(loop)
                loops = tuple((lp, c) for lp in bw.loops[pos + 1:])
                if c == 0 and i + k in allocs:
                    new_allocs[len(out)] = list(allocs[i + k])
                out.append(_copy(bw, share, loops, per_copy, c))
            out.append(_barrier(body[-1], loop, per_copy, barrier, c))
        i = j
    return out, dict(buffers), new_allocs


def drain_after(works: Sequence[Any], allocs: dict[int, list], ends: dict[int, int],
                barrier: float) -> tuple[list[Any], dict[int, list]]:
    """``(works, allocs)`` of a trace view (one work per executed instruction, iterations already separate) with a
    drain + barrier of ``barrier`` seconds after every work index in ``ends`` (index -> loop header line)."""
    out: list[Any] = []
    new_allocs: dict[int, list] = {}
    for i, w in enumerate(works):
        if i in allocs:
            new_allocs[len(out)] = list(allocs[i])
        out.append(w)
        if i in ends:
            out.append(_barrier(w, ends[i], 1.0, barrier, -1))
    return out, new_allocs
