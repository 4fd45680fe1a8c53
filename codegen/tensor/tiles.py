"""How one op of the tensor path walks its iteration space: which dim goes on partitions, which dims a tile
holds, which dims Python loops walk, and the DMA access pattern of every operand for one tile.

Why this shape of code: an op's operands are strided views of HBM buffers (:mod:`.view`) of any rank, aligned
with the op's iteration space (broadcast dims have stride 0). A tile is ``[p, f1, ..., fk]`` in SBUF: one
iteration dim on partitions (at most 128 per tile, the remainder as a smaller tile), up to
:data:`MAX_FREE_DIMS` dims on the free axis (at most :data:`FREE_MAX` elements per partition, the innermost dim
chunked when it alone is larger), every other dim a trace-time Python loop whose index enters the access
pattern's offset. The free-axis limits follow the DMA access-pattern rules (up to 4 free dims per partition,
nki_api.md, "Rules that matter"); keeping tiles small keeps each op's scratch small in the SBUF budget.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from ..errors import CodegenError
from ..layout import PMAX
from .view import TRef

#: elements per partition of one operand tile (8 KiB in fp32)
FREE_MAX = 2048
#: free dims per tile (the DMA access pattern's free dims, minus one kept for a chunked innermost dim)
MAX_FREE_DIMS = 3
#: tiles one op may take (trace-time loop iterations); more is a value no decode step computes generically
MAX_TILES = 4096


class Code:
    """Lines of Python at a nesting depth, and fresh variable names (unique in the kernel through ``stem``)."""

    def __init__(self, stem: str) -> None:
        self.lines: list[str] = []
        self.depth = 0
        self.stem = stem
        self.count = 0

    def __call__(self, text: str) -> None:
        self.lines.append("    " * self.depth + text)

    @contextmanager
    def block(self, header: str) -> Iterator[None]:
        self(header)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def fresh(self, what: str) -> str:
        self.count += 1
        return f"{self.stem}_{what}{self.count}"

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


@dataclass
class Plan:
    """How an iteration space of ``shape`` is walked (see the module docstring)."""

    shape: tuple[int, ...]
    pdim: int | None  # the dim on partitions (None: one partition)
    free: tuple[int, ...]  # dims a tile holds, in order
    loops: tuple[int, ...]  # dims Python loops walk
    chunk: int = 0  # > 0: the last free dim is walked in chunks of this many elements

    def tiles(self) -> int:
        n = math.prod(self.shape[d] for d in self.loops)
        if self.pdim is not None:
            n *= -(-self.shape[self.pdim] // PMAX)
        if self.chunk:
            n *= -(-self.shape[self.free[-1]] // self.chunk)
        return n


def plan(shape: Sequence[int], *, inner: Sequence[int] = (), loops_outer: bool = False,
         free_max: int = FREE_MAX) -> Plan:
    """A walk of ``shape``. ``inner``: dims that must be whole in every tile (a reduction's dims; the last of them
    may be chunked); ``loops_outer``: every dim but the partition dim and ``inner`` is a loop (tiles ``[p, inner]``,
    so a per-row result is a per-partition scalar)."""
    shape = tuple(int(s) for s in shape)
    rank = len(shape)
    inner = tuple(d % rank for d in inner) if rank else ()
    cands = [d for d in range(rank) if d not in inner and shape[d] > 1]
    pdim = max(cands, key=lambda d: (min(shape[d], PMAX), -d)) if cands else None
    free: list[int] = [d for d in inner if shape[d] > 1]
    rest = [d for d in range(rank) if d != pdim and d not in inner]
    loops: list[int] = []
    elems = math.prod(shape[d] for d in free)
    for d in reversed(rest):  # innermost first: contiguous runs stay in the tile
        if shape[d] == 1:
            continue
        if not loops_outer and not loops and len(free) < MAX_FREE_DIMS and elems * shape[d] <= free_max:
            free.insert(0, d)
            elems *= shape[d]
        else:
            loops.insert(0, d)
    chunk = 0
    if elems > free_max:
        if len(free) > 1 and not inner:
            while len(free) > 1 and math.prod(shape[d] for d in free) > free_max:
                loops.append(free.pop(0))
                loops.sort()
        if math.prod(shape[d] for d in free) > free_max:
            if len(free) != 1 and inner:
                raise CodegenError(f"a reduction over {math.prod(shape[d] for d in free)} elements in "
                                   f"{len(free)} dims does not fit one tile")
            chunk = free_max
    p = Plan(shape, pdim, tuple(free), tuple(loops), chunk)
    if p.tiles() > MAX_TILES:
        raise CodegenError(f"a value of shape {shape} needs {p.tiles()} tiles (more than {MAX_TILES})")
    return p


@dataclass
class Tile:
    """One tile of a :class:`Plan`: its extents and the start index (a Python expression) of every dim."""

    plan: Plan
    p: int
    sizes: dict[int, int]  # free dim -> extent in this tile
    start: dict[int, str] = field(default_factory=dict)

    @property
    def free_shape(self) -> tuple[int, ...]:
        return tuple(self.sizes[d] for d in self.plan.free)

    def shape(self, dims: Sequence[int] | None = None) -> tuple[int, ...]:
        """The SBUF tile shape ``(p, *free)`` (``dims``: a subset of the free dims, e.g. a reduction's output)."""
        free = self.plan.free if dims is None else dims
        return (self.p,) + (tuple(self.sizes[d] for d in free) or (1,))

    def ap(self, buf: str, ref: TRef, dims: Sequence[int] | None = None) -> str:
        """The access pattern of ``ref`` (aligned with the iteration space) over this tile: partitions, then the
        free dims (``dims``: a subset, the others fixed at their start)."""
        free = self.plan.free if dims is None else tuple(dims)
        pd = self.plan.pdim
        pattern = [[ref.strides[pd] if pd is not None else 1, self.p]]
        pattern += [[ref.strides[d], self.sizes[d]] for d in free] or [[1, 1]]
        return f"{buf}.ap(pattern={pattern}, offset={self.offset(ref)})"

    def offset(self, ref: TRef) -> str:
        terms = [str(ref.offset)] if ref.offset else []
        for d, s in sorted(self.start.items()):
            st = ref.strides[d]
            if st == 0 or s == "0":
                continue
            terms.append(f"{s} * {st}" if st != 1 else s)
        return " + ".join(terms) or "0"


def walk(code: Code, p: Plan, body: Callable[[Tile], None], *, before: Callable[[Tile], None] | None = None,
         after: Callable[[Tile], None] | None = None) -> int:
    """Emit the loops of ``p`` around ``body(tile)`` (once per distinct tile size: full partition and free chunks,
    then the remainders); returns the number of tile bodies emitted. ``before``/``after``: code around the chunks
    of one tile (a chunked reduction's accumulator: set before the first chunk, stored after the last)."""
    variants = 0

    def with_chunk(tile: Tile) -> None:
        if before is not None:
            before(tile)
        chunks(tile)
        if after is not None:
            after(tile)

    def chunks(tile: Tile) -> None:
        nonlocal variants
        if not p.chunk:
            body(tile)
            variants += 1
            return
        d = p.free[-1]
        n = p.shape[d]
        full, rem = divmod(n, p.chunk)
        if full:
            var = code.fresh("c")
            with code.block(f"for {var} in range({full}):"):
                body(_with(tile, d, p.chunk, f"{var} * {p.chunk}"))
                variants += 1
        if rem:
            body(_with(tile, d, rem, str(full * p.chunk)))
            variants += 1

    def with_partitions(tile: Tile) -> None:
        if p.pdim is None:
            with_chunk(tile)
            return
        n = p.shape[p.pdim]
        full, rem = divmod(n, PMAX)
        if n <= PMAX:
            with_chunk(_part(tile, n, "0"))
            return
        if full:
            var = code.fresh("p")
            with code.block(f"for {var} in range({full}):"):
                with_chunk(_part(tile, PMAX, f"{var} * {PMAX}"))
        if rem:
            with_chunk(_part(tile, rem, str(full * PMAX)))

    def loops(tile: Tile, rest: tuple[int, ...]) -> None:
        if not rest:
            with_partitions(tile)
            return
        d = rest[0]
        var = code.fresh("i")
        with code.block(f"for {var} in range({p.shape[d]}):"):
            loops(Tile(p, tile.p, tile.sizes, {**tile.start, d: var}), rest[1:])

    sizes = {d: p.shape[d] for d in p.free}
    loops(Tile(p, 1, sizes, {}), p.loops)
    return variants


def _with(tile: Tile, d: int, size: int, start: str) -> Tile:
    return Tile(tile.plan, tile.p, {**tile.sizes, d: size}, {**tile.start, d: start})


def _part(tile: Tile, p: int, start: str) -> Tile:
    d = tile.plan.pdim
    return Tile(tile.plan, p, tile.sizes, {**tile.start, d: start} if d is not None else tile.start)


__all__ = ["Code", "FREE_MAX", "MAX_FREE_DIMS", "MAX_TILES", "Plan", "Tile", "plan", "walk"]
