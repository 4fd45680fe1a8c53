"""Hardware loops (``nl.dynamic_range``) scheduled iteration by iteration instead of line by line.

Why: the cost model schedules a kernel *line* with all its executions as one work item. For a Python loop that
the trace unrolls into a few lines this is a fair picture, but a hardware loop with a long body -- the streamed
attention's block loop: K/V loads, transposes, score matmuls, a chain of Vector/Scalar softmax steps, P.V --
runs its iterations as a software pipeline: every engine walks its own instruction stream, so the Vector engine
works on block k while the DMA queues load block k+1. Scheduled line by line, a Vector line that waits for its
producer's *last* iteration holds the Vector engine until then and the next Vector line of the body starts only
after it, which serializes the body's engines (the streamed attention at 131,072 positions was modeled at about
1.4x the busiest resource's time). Here each hardware loop with more than one iteration is replaced by its
iterations in program order (at most :data:`MAX_COPIES` copies; beyond that each copy stands for an equal share
of the iterations), each iteration's lines carrying their share of the line's cost. Tiles allocated inside the
body are double-buffered (as the kernel's SBUF accounting assumes for streamed blocks): copy k and copy k + 2
share a buffer, so a write waits for the readers two copies back; values allocated before the loop (the running
max, sum and output) are true loop-carried dependencies. Loops the view does not mark as hardware loops, and
hardware loops that run once (the ``dynamic_range`` guards of skipped chunks), keep the line-by-line costing.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Iterable, Sequence

#: the most copies one hardware loop is unrolled into (each stands for ``ceil(T / MAX_COPIES)`` iterations)
MAX_COPIES = 64

_SCALED = ("busy", "occupancy", "own", "ideal")
_SCALED_INT = ("nbytes", "hbm_read", "hbm_write")


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


def _copy(w: Any, share: float, loops: tuple, rename: dict[str, str]) -> Any:
    """One iteration's share of work ``w`` (its cost fields scaled by ``share``), reading/writing renamed tiles."""
    kw: dict[str, Any] = {k: getattr(w, k) * share for k in _SCALED}
    kw.update({k: int(round(getattr(w, k) * share)) for k in _SCALED_INT})
    kw["count"] = max(1, int(round(w.count * share)))
    kw["loops"] = loops
    kw["reads"] = tuple(rename.get(v, v) for v in w.reads)
    kw["writes"] = tuple(rename.get(v, v) for v in w.writes)
    return replace(w, **kw)


def unroll_hardware_loops(works: Sequence[Any], buffers: dict[str, str], allocs: dict[int, list],
                          hw_loops: Iterable[int]) -> tuple[list[Any], dict[str, str], dict[int, list]]:
    """``(works, buffers, allocs)`` with every multi-iteration hardware loop of ``hw_loops`` (loop-header line
    numbers, as in :attr:`KernelLine.loops`) replaced by its iterations; the input is returned unchanged when
    there is none. Nested hardware loops: the outermost is unrolled (its copies' inner loops stay lines)."""
    hw = set(hw_loops)
    if not hw:
        return list(works), buffers, allocs
    out: list[Any] = []
    new_allocs: dict[int, list] = {}
    new_buffers = dict(buffers)
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
        if T <= 1:
            for k in range(i, j):
                if k in allocs:
                    new_allocs[len(out)] = list(allocs[k])
                out.append(works[k])
            i = j
            continue
        copies = min(T, MAX_COPIES)
        share = 1.0 / copies
        inner = {v for k in range(i, j) for v in allocs.get(k, ())}
        for c in range(copies):
            # the last copy keeps the tiles' own names (what follows the loop reads them); the others alternate
            parity = (copies - 1 - c) % 2
            rename = {v: f"{v}#{parity}" for v in inner} if parity else {}
            for v, r in rename.items():
                new_buffers[r] = buffers.get(v, "sbuf")
            for k, bw in enumerate(body):
                pos = bw.loops.index(loop)
                loops = tuple((lp, c) for lp in bw.loops[pos + 1:])
                if i + k in allocs:
                    new_allocs[len(out)] = [rename.get(v, v) for v in allocs[i + k]]
                out.append(_copy(bw, share, loops, rename))
        i = j
    return out, new_buffers, new_allocs
