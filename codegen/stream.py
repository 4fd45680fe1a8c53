"""Weight streaming: every weight chunk of the kernel in use order, loaded through a ring of SBUF buffers.

The kernel reads far more weight bytes than SBUF holds, so weights stream from HBM in chunks. Chunk ``c`` is
loaded into ring buffer ``c % R`` and its DMA is issued ``R - 1`` chunks ahead of its use — across instruction
and layer boundaries, so the next layer's first weights load while this layer computes. A chunk whose address
depends on a value computed in the kernel (an expert id) cannot be issued before the instruction that uses it
starts (``earliest``). The emitters place :class:`ChunkUse` markers; :func:`resolve` turns them into code.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from .render import render

_ids = itertools.count()


@dataclass
class Chunk:
    shape: tuple[int, ...]
    dtype: str  # nl dtype expression
    src: str  # source expression (an HBM slice or access pattern)
    name: str  # instruction name= for the DMA
    earliest: int  # index of the first instruction allowed to issue the DMA
    nbytes_per_partition: int
    uid: int = field(default_factory=lambda: next(_ids))

    @property
    def token(self) -> str:
        """Placeholder for the buffer variable, replaced once the ring slot is known."""
        return f"@@chunk{self.uid}@@"


@dataclass
class ChunkUse:
    chunk: Chunk
    instruction: int


def resolve(pieces: list, ring: int, indent: int = 4) -> tuple[str, dict]:
    """Join code pieces, inserting chunk loads ``ring - 1`` ahead of use; return (code, stats)."""
    uses = [p for p in pieces if isinstance(p, ChunkUse)]
    order = {u.chunk.uid: i for i, u in enumerate(uses)}
    names = {u.chunk.uid: f"wbuf{i % ring}" for i, u in enumerate(uses)}
    loaded = 0
    out: list[str] = []
    max_ahead = 0
    for p in pieces:
        if isinstance(p, ChunkUse):
            i = order[p.chunk.uid]
            target = min(i + ring - 1, len(uses) - 1)
            while loaded <= target:
                nxt = uses[loaded]
                if loaded > i and nxt.chunk.earliest > p.instruction:
                    break  # depends on a value this point of the kernel does not have yet
                out.append(render("dma_chunk.j2", indent=indent, var=names[nxt.chunk.uid], shape=nxt.chunk.shape,
                                  dtype=nxt.chunk.dtype, src=nxt.chunk.src, name=nxt.chunk.name))
                loaded += 1
            max_ahead = max(max_ahead, loaded - 1 - i)
        else:
            out.append(p)
    code = "".join(out)
    for uid, name in names.items():
        code = code.replace(f"@@chunk{uid}@@", name)
    per_partition = max((u.chunk.nbytes_per_partition for u in uses), default=0)
    return code, {"chunks": len(uses), "ring": ring, "max_lookahead": max_ahead,
                  "ring_bytes_per_partition": per_partition * min(ring, max(1, len(uses)))}
