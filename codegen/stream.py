"""Weight streaming: every weight chunk of the kernel in use order, loaded through rings of SBUF buffers.

The kernel reads far more weight bytes than SBUF holds, so weights stream from HBM in chunks. There are two
streams, each with its own ring of ``R`` buffers:

* ``static``: weights whose address is known when the kernel is built (projections, norms, routers). Chunk ``c``
  is loaded into buffer ``c % R`` and its DMA is issued ``R - 1`` chunks ahead of its use, across instruction and
  layer boundaries, so the next layer's first weights load while this layer computes.
* ``dynamic``: weights addressed by a value the kernel computes (the experts a router picked). Their DMAs cannot
  start before the router has run (``earliest``); they go through their own ring and DMA queue so that, while
  they wait, the static stream keeps prefetching the next layer's weights.

A chunk may be *guarded* (``guard = (start, stop)``, two registers): its DMA runs inside
``for _ in nl.dynamic_range(start=start, stop=stop)``, i.e. only when the kernel decided at run time that the chunk
is needed (an expert slot no token chose skips its weight reads). Its ring slot is allocated either way; the code
that reads the chunk carries the same guard, so a skipped chunk is never read.

The emitters place :class:`ChunkUse` markers; :func:`resolve` turns them into code.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

from .render import render

_ids = itertools.count()
_TOKEN = re.compile(r"@@chunk(\d+)@@")
STREAMS = {"static": "wbuf", "dynamic": "xbuf", "small": "nbuf"}
#: static chunks of at most this many bytes per partition (norm weights, biases) stream through their own ring
SMALL_CHUNK_BYTES = 512
#: buffers of the small ring (a few bytes each: several layers of norm weights ahead)
SMALL_RING = 8


def stream_of(chunk: "Chunk") -> str:
    """The stream a chunk goes through. Why a third one: a norm's weight is a few bytes per partition, but in the
    static ring it would take a slot as big as a projection's chunk and shorten how far ahead the projections are
    prefetched (a layer's static chunks alternate norm, projection, norm, ...)."""
    if chunk.stream == "static" and chunk.nbytes_per_partition <= SMALL_CHUNK_BYTES:
        return "small"
    return chunk.stream


@dataclass
class Chunk:
    shape: tuple[int, ...]
    dtype: str  # nl dtype expression
    src: str  # source expression (an HBM slice or access pattern)
    name: str  # instruction name= for the DMA
    earliest: int  # index of the first instruction allowed to issue the DMA
    nbytes_per_partition: int
    stream: str = "static"
    guard: tuple[str, str] | None = None  # (start, stop) registers: the DMA runs only when range(start, stop) has one step
    uid: int = field(default_factory=lambda: next(_ids))

    @property
    def token(self) -> str:
        """Placeholder for the buffer variable, replaced once the ring slot is known."""
        return f"@@chunk{self.uid}@@"


@dataclass
class ChunkUse:
    chunk: Chunk
    instruction: int


@dataclass
class PrefetchPoint:
    """Where the kernel is about to wait without using its DMA queues (after a collective is issued: the
    all-reduce after o_proj or the MLP). Why: the DMA queues serve transfers in the order they are issued, so a
    weight prefetch issued as early as its ring slot allows sits in front of the loads the next instructions wait
    for (the KV write and the cache reads of attention, a router's experts). In a kernel with such points the
    static stream is issued there as far ahead as the ring allows; elsewhere it looks ahead only to the chunks used
    before the end of the next :class:`CriticalEnd` (the loads in between go first), so its transfers fill the
    collective's idle time instead."""
    instruction: int


@dataclass
class CriticalEnd:
    """After an instruction whose own loads are latency-critical (attention reading the cache this step's KV write
    just updated; experts fetching the router's choices): with prefetch points, static chunks used after it are not
    issued before it (see :class:`PrefetchPoint`). Placed by :func:`~.megakernel.generate`."""
    instruction: int


def resolve(pieces: list, ring: int, indent: int = 4) -> tuple[str, dict]:
    """Join code pieces, inserting chunk loads ahead of use per stream; return (code, stats)."""
    uses = {s: [p for p in pieces if isinstance(p, ChunkUse) and stream_of(p.chunk) == s] for s in STREAMS}
    rings = {s: (max(ring, SMALL_RING) if s == "small" else ring) for s in STREAMS}
    index = {u.chunk.uid: i for s in STREAMS for i, u in enumerate(uses[s])}
    names = {u.chunk.uid: f"{STREAMS[s]}{i % rings[s]}" for s in STREAMS for i, u in enumerate(uses[s])}
    # with prefetch points the static stream is issued there (and when needed); otherwise as early as the ring allows
    deferred = any(isinstance(p, PrefetchPoint) for p in pieces)
    # with prefetch points: at each piece, the static chunks that may be issued there are those used before the
    # next critical end (at a critical end itself: before the following one); no cap after the last one
    cap = [len(uses["static"])] * len(pieces)
    if deferred:
        before, seen = [0] * len(pieces), 0
        for k, p in enumerate(pieces):
            before[k] = seen
            seen += isinstance(p, ChunkUse) and stream_of(p.chunk) == "static"
        nxt = len(uses["static"])
        for k in range(len(pieces) - 1, -1, -1):
            cap[k] = nxt
            if isinstance(pieces[k], CriticalEnd):
                nxt = before[k]

    def upto(st: str, want: int, k: int) -> int:
        return min(want, cap[k] - 1) if st == "static" else want
    loaded = {s: 0 for s in STREAMS}  # chunks of each stream whose DMA has been emitted
    used = {s: 0 for s in STREAMS}  # chunks of each stream whose compute has been emitted
    out: list[str] = []
    max_ahead = 0

    def load(s: str, upto: int, instruction: int, must: int) -> None:
        """Emit DMAs of stream ``s`` up to chunk ``upto`` (at least up to ``must``, which the code now needs)."""
        while loaded[s] <= min(upto, len(uses[s]) - 1):
            nxt = uses[s][loaded[s]]
            if loaded[s] > must and nxt.chunk.earliest > instruction:
                break  # depends on a value this point of the kernel does not have yet
            c = nxt.chunk
            dge = ", dge_mode=nisa.dge_mode.swdge" if s == "dynamic" else ""
            if c.guard is None:
                out.append(render("dma_chunk.j2", indent=indent, var=names[c.uid], shape=c.shape, dtype=c.dtype,
                                  src=c.src, name=c.name, dge=dge))
            else:
                out.append(render("dma_chunk_guarded.j2", indent=indent, var=names[c.uid], shape=c.shape,
                                  dtype=c.dtype, src=c.src, name=c.name, dge=dge, start=c.guard[0], stop=c.guard[1]))
            loaded[s] += 1

    for k, p in enumerate(pieces):
        if isinstance(p, ChunkUse):
            s = stream_of(p.chunk)
            i = index[p.chunk.uid]
            load(s, upto(s, i + rings[s] - 1, k), p.instruction, must=i)
            max_ahead = max(max_ahead, loaded[s] - 1 - i)
            used[s] = i + 1
            for other in STREAMS:  # the other stream may prefetch now too (its ring slots are free)
                if other != s:
                    load(other, upto(other, used[other] + rings[other] - 1, k), p.instruction,
                         must=used[other] - 1)
        elif isinstance(p, (PrefetchPoint, CriticalEnd)):
            for st in STREAMS:
                want = used[st] + rings[st] - 1
                load(st, want if isinstance(p, PrefetchPoint) else upto(st, want, k), p.instruction,
                     must=used[st] - 1)
                max_ahead = max(max_ahead, loaded[st] - used[st])
        else:
            out.append(p)
    code = _TOKEN.sub(lambda m: names[int(m.group(1))], "".join(out))
    per_partition = {s: max((u.chunk.nbytes_per_partition for u in uses[s]), default=0) for s in STREAMS}
    ring_bytes = sum(per_partition[s] * min(rings[s], max(1, len(uses[s]))) for s in STREAMS if uses[s])
    return code, {"chunks": sum(len(v) for v in uses.values()), "dynamic_chunks": len(uses["dynamic"]),
                  "ring": ring, "max_lookahead": max_ahead, "ring_bytes_per_partition": ring_bytes}
