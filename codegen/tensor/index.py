"""Ops with runtime indices on the tensor path: gathers (``index_select``, ``embedding``, ``gather``, advanced
indexing ``index.Tensor``) and scatters (``index_put``, ``index_copy``, ``scatter``, ``index_fill``, and their
in-place forms into state), by indirect DMA; ``scatter_add`` on chip.

Why indirect DMA: a runtime index is a row offset the DMA engine applies per partition
(``.ap(vector_offset=<[P, 1] int32 SBUF tile>, indirect_dim=0)``, nki_api.md "Data movement": the element offset
of partition ``p`` is ``offset + index[p] * prod(shape[1:])`` of the tensor ``.ap`` is called on). Every op here is
one form: over an iteration space, element ``i`` of the output (a gather) or of the destination (a scatter) is
element ``base(i) + sum_k index_k(i) * stride_k`` of the indexed buffer, where ``base`` is a strided view with
stride 0 along the indexed dims (:class:`Term` holds one ``index_k``). One dim of the iteration space goes on
partitions, dims along which no index varies go on the free axis (one contiguous run per partition), the rest are
trace-time loops. The buffer is addressed through a reshape ``(N, m)`` with ``m`` the gcd of the strides involved,
so the per-partition row index ``sum_k index_k * stride_k / m + p * stride_p / m`` is computed on chip (fp32,
exact below 2^24 rows: larger is refused) and the DMA multiplies it by ``m``.

Out-of-range indices: eager raises (or, for advanced indexing and ``index_fill``, counts a negative index from the
end, which the kernel does too). The kernel never reads or writes outside the indexed dim: a gather clamps the
index into range, a scatter points the row past the end of the buffer and drops it (``oob_mode.skip``, so a state
tensor is never written at a wrong row), and either raises the kernel's guard flag (``TensorOp.flag``): the
executor then recomputes the step eagerly, which raises eager's own error.

Duplicate indices in a plain scatter (``index_put``, ``index_copy``, ``scatter``): PyTorch leaves which write wins
undefined; here it is whichever DMA row lands last. ``scatter_add`` sums duplicates exactly in index order (on
chip, see :func:`_scatter_add`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..emitters import Context
from ..errors import CodegenError
from ..layout import PMAX
from .instruction import TensorOp, kernel_dtype, literal, register_emitter, register_guard, tile_alloc, tile_bytes
from .move import copy_view
from .tiles import FREE_MAX, MAX_FREE_DIMS, MAX_TILES, Code, Plan, Tile, plan, walk
from .view import TRef, broadcast_to, unsqueeze

#: rows the on-chip index arithmetic addresses exactly (fp32 integers)
ROWS_MAX = 1 << 24
OOB_REASON = "an index out of range (eager raises)"


@dataclass(frozen=True)
class Term:
    """One runtime index of an address: ``index`` (an integer view aligned with the iteration space) times
    ``stride`` elements of the indexed buffer; ``size`` is the indexed dim's extent; ``wrap``: a negative index
    counts from the end (advanced indexing), else it is out of range."""

    index: TRef
    stride: int
    size: int
    wrap: bool


def advanced(x: TRef, indices: Sequence[TRef | None], wrap: bool) -> tuple[tuple[int, ...], TRef, list[Term]]:
    """PyTorch's advanced indexing ``x[indices]`` (``None`` = a whole dim) as an iteration space, the view of
    ``x`` over it (stride 0 along the index dims) and the index terms: the index tensors broadcast together; their
    dims replace the indexed dims in place when those are adjacent, else they lead."""
    rank = len(x.shape)
    idx = list(indices) + [None] * (rank - len(indices))
    pos = [d for d, t in enumerate(idx) if t is not None]
    if not pos:
        raise CodegenError("indexing without an index tensor")
    bshape = tuple(torch.broadcast_shapes(*[tuple(t.shape) for t in idx if t is not None]))
    lead = pos[0] if pos == list(range(pos[0], pos[-1] + 1)) else 0
    rest = [d for d in range(rank) if d not in pos]
    before, after = [d for d in rest if d < lead], [d for d in rest if d >= lead]
    shape = tuple(x.shape[d] for d in before) + bshape + tuple(x.shape[d] for d in after)
    zeros_b, zeros_a = (0,) * len(before), (0,) * len(after)
    data = TRef(x.value, shape, tuple(x.strides[d] for d in before) + (0,) * len(bshape)
                + tuple(x.strides[d] for d in after), x.offset)
    terms = []
    for d in pos:
        b = broadcast_to(idx[d], bshape)
        terms.append(Term(TRef(b.value, shape, zeros_b + b.strides + zeros_a, b.offset), x.strides[d], x.shape[d],
                          wrap))
    return shape, data, terms


def index_plan(shape: Sequence[int], varying: set[int]) -> Plan:
    """A walk of ``shape`` whose tiles hold on the free axis only dims along which no index varies (a partition
    reads one run from one row offset); the partition dim is one along which an index varies where there is one."""
    shape = tuple(int(s) for s in shape)
    big = [d for d in range(len(shape)) if shape[d] > 1]
    cands = [d for d in big if d in varying] or big
    pdim = max(cands, key=lambda d: (min(shape[d], PMAX), -d)) if cands else None
    free: list[int] = []
    loops: list[int] = []
    elems = 1
    for d in reversed(big):
        if d == pdim:
            continue
        if d not in varying and len(free) < MAX_FREE_DIMS and elems * shape[d] <= FREE_MAX:
            free.insert(0, d)
            elems *= shape[d]
        else:
            loops.insert(0, d)
    chunk = 0
    if not free:
        inner = [d for d in big if d != pdim and d not in varying]
        if inner and shape[inner[-1]] > FREE_MAX:  # one long run: walked in chunks
            free, chunk = [inner[-1]], FREE_MAX
            loops.remove(inner[-1])
    p = Plan(shape, pdim, tuple(free), tuple(loops), chunk)
    if p.tiles() > MAX_TILES:
        raise CodegenError(f"an indexed value of shape {shape} needs {p.tiles()} tiles (more than {MAX_TILES})")
    return p


class Indexer:
    """The row offsets of one indirect DMA per tile of ``p`` over buffer view ``data`` (its strides 0 along the
    indexed dims), raising the op's guard flag for an index out of range. ``scatter``: out-of-range rows point
    past the buffer's end (dropped by ``oob_mode.skip``) instead of being clamped."""

    def __init__(self, ins: TensorOp, ctx: Context, code: Code, p: Plan, data: TRef, terms: list[Term],
                 scatter: bool) -> None:
        self.ins, self.ctx, self.code, self.plan, self.data, self.terms = ins, ctx, code, p, data, terms
        self.scatter = scatter
        self.name = ins.name_stem()
        numel = math.prod(data.value.shape) or 1
        strides = [t.stride for t in terms] + ([data.strides[p.pdim]] if p.pdim is not None else [])
        m = 0
        for s in strides:
            m = math.gcd(m, abs(int(s)))
        self.mult = math.gcd(m or 1, numel)
        self.rows = numel // self.mult
        if self.rows >= ROWS_MAX:
            raise CodegenError(f"{ins.op}: {self.rows} rows of {self.mult} elements are beyond the exact on-chip "
                               f"index arithmetic ({ROWS_MAX})")
        self.bad = ""

    def begin(self) -> None:
        """The op's out-of-range accumulator (one column, every partition), before the tiles."""
        if self.ins.flag is None:
            return
        self.bad = tile_alloc(self.code, (PMAX, 1), torch.float32, self.name, "bad")
        self.code(f"nisa.memset(dst={self.bad}, value=0.0, name=\"{self.name}.bad\")")

    def end(self) -> None:
        """Raise the kernel's flag when any tile saw an index out of range."""
        if self.ins.flag is not None:
            raise_flag(self.code, self.ctx, self.ins, self.bad)

    def offsets(self, tile: Tile) -> str:
        """Emit the int32 ``[p, 1]`` row offsets of ``tile``; returns the tile's variable."""
        code, name, P, m = self.code, self.name, tile.p, self.mult
        acc = tile_alloc(code, (P, 1), torch.float32, name, "row")
        sp = self.data.strides[self.plan.pdim] // m if self.plan.pdim is not None else 0
        if sp:
            code(f"nisa.iota(dst={acc}, pattern=[[0, 1]], offset=0, channel_multiplier={sp}, name=\"{name}.prow\")")
        else:
            code(f"nisa.memset(dst={acc}, value=0.0, name=\"{name}.prow\")")
        bad = ""
        for k, t in enumerate(self.terms):
            raw = tile_alloc(code, (P, 1), torch.int32, name, f"idx{k}_")
            code(f"nisa.dma_copy(dst={raw}, src={tile.ap(self.ctx.var(t.index.value), t.index, dims=())}, "
                 f"name=\"{name}.idx\")")
            f = tile_alloc(code, (P, 1), torch.float32, name, f"idxf{k}_")
            code(f"nisa.tensor_copy(dst={f}, src={raw}, name=\"{name}.idxf\")")
            if t.wrap:  # a negative index counts from the end: + size where < 0
                neg = tile_alloc(code, (P, 1), torch.float32, name, "neg")
                code(f"nisa.tensor_scalar(dst={neg}, data={f}, op0=nl.less, operand0=0.0, name=\"{name}.neg\")")
                code(f"nisa.scalar_tensor_tensor(dst={f}, data={neg}, op0=nl.multiply, operand0={float(t.size)!r}, "
                     f"op1=nl.add, operand1={f}, name=\"{name}.wrap\")")
            lo, hi = (tile_alloc(code, (P, 1), torch.float32, name, w) for w in ("lo", "hi"))
            code(f"nisa.tensor_scalar(dst={lo}, data={f}, op0=nl.less, operand0=0.0, name=\"{name}.lo\")")
            code(f"nisa.tensor_scalar(dst={hi}, data={f}, op0=nl.greater, operand0={float(t.size - 1)!r}, "
                 f"name=\"{name}.hi\")")
            if bad:
                code(f"nisa.tensor_tensor(dst={bad}, data1={bad}, data2={lo}, op=nl.maximum, name=\"{name}.oob\")")
            else:
                bad = lo
            code(f"nisa.tensor_tensor(dst={bad}, data1={bad}, data2={hi}, op=nl.maximum, name=\"{name}.oob\")")
            code(f"nisa.tensor_scalar(dst={f}, data={f}, op0=nl.maximum, operand0=0.0, op1=nl.minimum, "
                 f"operand1={float(t.size - 1)!r}, name=\"{name}.clamp\")")
            code(f"nisa.scalar_tensor_tensor(dst={acc}, data={f}, op0=nl.multiply, operand0={float(t.stride // m)!r}, "
                 f"op1=nl.add, operand1={acc}, name=\"{name}.addr\")")
        if self.bad and bad:
            code(f"nisa.tensor_tensor(dst={self.bad}[0:{P}, :], data1={self.bad}[0:{P}, :], data2={bad}, "
                 f"op=nl.maximum, name=\"{name}.bad\")")
        if self.scatter and bad:  # an out-of-range row goes past the end of the buffer: the DMA drops it
            pred = tile_alloc(code, (P, 1), torch.uint8, name, "skip")
            code(f"nisa.tensor_copy(dst={pred}, src={bad}, name=\"{name}.skip\")")
            code(f"nisa.tensor_copy_predicated(dst={acc}, src={float(self.rows)!r}, predicate={pred}, "
                 f"name=\"{name}.drop\")")
        rows = tile_alloc(code, (P, 1), torch.int32, name, "rows")
        code(f"nisa.tensor_copy(dst={rows}, src={acc}, name=\"{name}.rows\")")
        return rows

    def ap(self, tile: Tile, var: str, rows: str) -> str:
        """The indirect access pattern of ``tile`` in the indexed buffer (``var``)."""
        pattern = [[self.mult, tile.p]] + [[self.data.strides[d], tile.sizes[d]] for d in self.plan.free]
        if len(pattern) == 1:
            pattern.append([1, 1])
        return (f"{var}.reshape(({self.rows}, {self.mult})).ap(pattern={pattern}, offset={tile.offset(self.data)}, "
                f"vector_offset={rows}, indirect_dim=0)")


def raise_flag(code: Code, ctx: Context, ins: TensorOp, bad: str) -> None:
    """OR a ``[128, 1]`` 0/1 column into the kernel's guard flag (one partition, a column per token): the max over
    partitions (GpSimd), then a max with every token's column."""
    name = ins.name_stem()
    one = tile_alloc(code, (1, 1), torch.float32, name, "any")
    code(f"nisa.tensor_partition_reduce(dst={one}, op=nl.maximum, data={bad}, name=\"{name}.any\")")
    flag = ctx.var(ins.flag)
    code(f"nisa.tensor_scalar(dst={flag}, data={flag}, op0=nl.maximum, operand0={one}, name=\"{name}.flag\")")


def gather(ins: TensorOp, ctx: Context, code: Code, shape: tuple[int, ...], data: TRef, terms: list[Term]) -> int:
    """``out[i] = buffer[data(i) + sum_k index_k(i) * stride_k]`` over ``shape`` (the output's shape)."""
    out = ins.outs[0]
    if tuple(out.shape) != tuple(shape):
        raise CodegenError(f"{ins.op}: the indexed shape {shape} is not the output's {tuple(out.shape)}")
    p = index_plan(shape, {d for t in terms for d, s in enumerate(t.index.strides) if s and shape[d] > 1})
    ix = Indexer(ins, ctx, code, p, data, terms, scatter=False)
    name, dv, ov = ins.name_stem(), ctx.var(data.value), ctx.var(out.value)
    scratch = [0]

    def body(tile: Tile) -> None:
        rows = ix.offsets(tile)
        t = tile_alloc(code, tile.shape(), data.dtype, name, "g")
        code(f"nisa.dma_copy(dst={t}, src={ix.ap(tile, dv, rows)}, name=\"{name}.gather\")")
        code(f"nisa.dma_copy(dst={tile.ap(ov, out)}, src={t}, name=\"{name}.store\")")
        scratch[0] = max(scratch[0], tile_bytes(tile.shape(), data.dtype) + 64)
    ix.begin()
    walk(code, p, body)
    ix.end()
    return scratch[0]


def scatter(ins: TensorOp, ctx: Context, code: Code, base: TRef | None, shape: tuple[int, ...], dst: TRef,
            terms: list[Term], src: Any) -> int:
    """``out = base`` (None: the op writes ``outs[0]`` in place), then ``buffer[dst(i) + sum_k index_k(i) *
    stride_k] = src(i)`` over ``shape`` (``src`` a view aligned with it, or a scalar)."""
    out = ins.outs[0]
    name = ins.name_stem()
    if base is not None:
        copy_view(code, ctx, out, base, f"{name}.base")
    p = index_plan(shape, {d for t in terms for d, s in enumerate(t.index.strides) if s and shape[d] > 1})
    ix = Indexer(ins, ctx, code, p, dst, terms, scatter=True)
    ov = ctx.var(dst.value)
    odt = kernel_dtype(dst.dtype)
    scratch = [0]

    def body(tile: Tile) -> None:
        rows = ix.offsets(tile)
        t = tile_alloc(code, tile.shape(), dst.dtype, name, "s")
        if isinstance(src, TRef):
            code(f"nisa.dma_copy(dst={t}, src={tile.ap(ctx.var(src.value), src)}, name=\"{name}.load\")")
        else:
            lit = literal(src, odt)
            code(f"nisa.memset(dst={t}, value={lit}, name=\"{name}.value\")")
        code(f"nisa.dma_copy(dst={ix.ap(tile, ov, rows)}, src={t}, oob_mode=nisa.oob_mode.skip, "
             f"name=\"{name}.scatter\")")
        scratch[0] = max(scratch[0], tile_bytes(tile.shape(), dst.dtype) + 64)
    ix.begin()
    walk(code, p, body)
    ix.end()
    return scratch[0]


def _dim(d: int, rank: int) -> int:
    return d % rank if rank else 0


def _vector(index: TRef) -> TRef:
    """A 0-d index as a one-element vector (index_select and friends keep the dim)."""
    return TRef(index.value, (1,), (0,), index.offset) if not index.shape else index


# ---- gathers -----------------------------------------------------------------------------------------------------
@register_emitter("aten.index_select.default")
def _index_select(ins: TensorOp, ctx: Context, code: Code) -> int:
    x, dim, index = ins.args[0], ins.args[1], _vector(ins.args[2])
    dim = _dim(dim, len(x.shape))
    shape, data, terms = advanced(x, [None] * dim + [index], wrap=False)
    return gather(ins, ctx, code, shape, data, terms)


@register_emitter("aten.embedding.default")
def _embedding(ins: TensorOp, ctx: Context, code: Code) -> int:
    weight, indices = ins.args[0], ins.args[1]
    shape, data, terms = advanced(weight, [indices], wrap=False)
    return gather(ins, ctx, code, shape, data, terms)


@register_emitter("aten.index.Tensor")
def _index(ins: TensorOp, ctx: Context, code: Code) -> int:
    x, indices = ins.args[0], ins.args[1]
    shape, data, terms = advanced(x, indices, wrap=True)
    return gather(ins, ctx, code, shape, data, terms)


@register_emitter("aten.gather.default")
def _gather(ins: TensorOp, ctx: Context, code: Code) -> int:
    x, dim, index = ins.args[0], ins.args[1], ins.args[2]
    rank = len(x.shape)
    if not rank:
        x, index = TRef(x.value, (1,), (1,), x.offset), _vector(index)
        rank = 1
    dim = _dim(dim, rank)
    shape = tuple(index.shape)
    data = TRef(x.value, shape, tuple(0 if d == dim else s for d, s in enumerate(x.strides)), x.offset)
    return gather(ins, ctx, code, shape, data, [Term(index, x.strides[dim], x.shape[dim], False)])


# ---- scatters ----------------------------------------------------------------------------------------------------
def _base(ins: TensorOp) -> TRef | None:
    """What a functional scatter copies first (its input); None for an in-place write of state."""
    return ins.args[0] if (ins.fresh or (True,))[0] else None


@register_emitter("aten.index_put.default", "aten.index_put_.default")
def _index_put(ins: TensorOp, ctx: Context, code: Code) -> int:
    x, indices, values = ins.args[0], ins.args[1], ins.args[2]
    accumulate = ins.args[3] if len(ins.args) > 3 else ins.kwargs.get("accumulate", False)
    if accumulate:
        raise CodegenError("index_put with accumulate=True")
    out = ins.outs[0]
    shape, dst, terms = advanced(out, indices, wrap=True)
    return scatter(ins, ctx, code, _base(ins), shape, dst, terms, broadcast_to(values, shape))


@register_emitter("aten.index_copy.default", "aten.index_copy_.default")
def _index_copy(ins: TensorOp, ctx: Context, code: Code) -> int:
    x, dim, index, source = ins.args[0], ins.args[1], _vector(ins.args[2]), ins.args[3]
    out = ins.outs[0]
    dim = _dim(dim, len(out.shape))
    shape, dst, terms = advanced(out, [None] * dim + [index], wrap=False)
    if len(source.shape) < len(shape):  # a 0-d index with a source lacking the dim
        source = unsqueeze(source, dim)
    return scatter(ins, ctx, code, _base(ins), shape, dst, terms, broadcast_to(source, shape))


@register_emitter("aten.index_fill.int_Scalar", "aten.index_fill.int_Tensor")
def _index_fill(ins: TensorOp, ctx: Context, code: Code) -> int:
    x, dim, index, value = ins.args[0], ins.args[1], _vector(ins.args[2]), ins.args[3]
    out = ins.outs[0]
    dim = _dim(dim, len(out.shape))
    shape, dst, terms = advanced(out, [None] * dim + [index], wrap=True)
    if isinstance(value, TRef):  # a 0-d tensor value: every written element reads it (stride 0)
        value = broadcast_to(value, shape)
    return scatter(ins, ctx, code, _base(ins), shape, dst, terms, value)


@register_emitter("aten.scatter.src", "aten.scatter.value")
def _scatter(ins: TensorOp, ctx: Context, code: Code) -> int:
    x, dim, index, src = ins.args[0], ins.args[1], ins.args[2], ins.args[3]
    if ins.kwargs.get("reduce") is not None:
        raise CodegenError(f"{ins.op} with reduce={ins.kwargs['reduce']!r}")
    out = ins.outs[0]
    rank = len(out.shape)
    if not rank:
        raise CodegenError(f"{ins.op} of a 0-d value")
    dim = _dim(dim, rank)
    shape = tuple(index.shape)
    dst = TRef(out.value, shape, tuple(0 if d == dim else s for d, s in enumerate(out.strides)), out.offset)
    if isinstance(src, TRef):
        src = TRef(src.value, shape, src.strides, src.offset)  # the leading index.shape block of src
    return scatter(ins, ctx, code, _base(ins), shape, dst, [Term(index, out.strides[dim], out.shape[dim], False)],
                   src)


@register_emitter("aten.scatter_add.default")
def _scatter_add(ins: TensorOp, ctx: Context, code: Code) -> int:
    """``out = x`` then ``out[.., index[.., i, ..], ..] += src[.., i, ..]`` along ``dim``, duplicates summed.

    Why on chip: a DMA read-modify-write (``dma_compute``) needs unique indices. Each line along ``dim`` (the other
    coordinates fixed) is a partition holding the ``n`` output slots; for every source position ``i`` (a
    loop of the kernel) the slots equal to ``index[i]`` (iota == index) take ``slot + src[i]``, a predicated copy
    of the sum, so the additions happen in eager's order and nothing is multiplied by a one-hot (``0 * inf`` would
    be NaN). The accumulator is fp32, rounded to the output's type once at the end: eager's CPU kernel does the
    same for reduced-precision types (a bf16 test checks it), and an fp32 sum in index order is eager's own."""
    x, dim, index, src = ins.args[0], ins.args[1], ins.args[2], ins.args[3]
    out = ins.outs[0]
    rank = len(out.shape)
    if not rank:
        raise CodegenError("scatter_add of a 0-d value")
    dim = _dim(dim, rank)
    n, m = out.shape[dim], index.shape[dim]
    if n > FREE_MAX:
        raise CodegenError(f"scatter_add into {n} slots per line (more than one tile)")
    name = ins.name_stem()
    copy_view(code, ctx, out, x, f"{name}.base")
    # the lines: index's extent in every other dim, the output's slots along dim
    shape = tuple(n if d == dim else s for d, s in enumerate(index.shape))
    line = TRef(out.value, shape, out.strides, out.offset)
    p = plan(shape, inner=(dim,), loops_outer=True)
    dt = kernel_dtype(out.dtype)
    scratch = [0]
    bad_acc = ""
    if ins.flag is not None:
        bad_acc = tile_alloc(code, (PMAX, 1), torch.float32, name, "bad")
        code(f"nisa.memset(dst={bad_acc}, value=0.0, name=\"{name}.bad\")")

    def body(tile: Tile) -> None:
        P = tile.p
        acc = tile_alloc(code, (P, n), torch.float32, name, "acc")
        code(f"nisa.dma_copy(dst={acc}, src={_line_ap(ctx, tile, line, dim, n, 0)}, name=\"{name}.load\")")
        slots = tile_alloc(code, (P, n), torch.float32, name, "slot")
        code(f"nisa.iota(dst={slots}, pattern=[[1, {n}]], offset=0, channel_multiplier=0, name=\"{name}.slots\")")
        bad = tile_alloc(code, (P, 1), torch.float32, name, "oob")
        code(f"nisa.memset(dst={bad}, value=0.0, name=\"{name}.oob0\")")
        iv = code.fresh("i")
        with code.block(f"for {iv} in range({m}):"):  # every source position, in eager's order
            ir_, sr = (tile_alloc(code, (P, 1), r.dtype, name, w) for r, w in ((index, "i"), (src, "v")))
            code(f"nisa.dma_copy(dst={ir_}, src={_line_ap(ctx, tile, index, dim, 1, iv)}, name=\"{name}.idx\")")
            code(f"nisa.dma_copy(dst={sr}, src={_line_ap(ctx, tile, src, dim, 1, iv)}, name=\"{name}.src\")")
            fi, fv = (tile_alloc(code, (P, 1), torch.float32, name, w) for w in ("fi", "fv"))
            code(f"nisa.tensor_copy(dst={fi}, src={ir_}, name=\"{name}.fi\")")
            code(f"nisa.tensor_copy(dst={fv}, src={sr}, name=\"{name}.fv\")")
            lo, hi = (tile_alloc(code, (P, 1), torch.float32, name, w) for w in ("lo", "hi"))
            code(f"nisa.tensor_scalar(dst={lo}, data={fi}, op0=nl.less, operand0=0.0, name=\"{name}.lo\")")
            code(f"nisa.tensor_scalar(dst={hi}, data={fi}, op0=nl.greater, operand0={float(n - 1)!r}, "
                 f"name=\"{name}.hi\")")
            code(f"nisa.tensor_tensor(dst={bad}, data1={bad}, data2={lo}, op=nl.maximum, name=\"{name}.oob\")")
            code(f"nisa.tensor_tensor(dst={bad}, data1={bad}, data2={hi}, op=nl.maximum, name=\"{name}.oob\")")
            hit = tile_alloc(code, (P, n), torch.uint8, name, "hit")
            code(f"nisa.tensor_scalar(dst={hit}, data={slots}, op0=nl.equal, operand0={fi}, name=\"{name}.hit\")")
            summed = tile_alloc(code, (P, n), torch.float32, name, "sum")
            code(f"nisa.tensor_scalar(dst={summed}, data={acc}, op0=nl.add, operand0={fv}, name=\"{name}.add\")")
            code(f"nisa.tensor_copy_predicated(dst={acc}, src={summed}, predicate={hit}, name=\"{name}.acc\")")
        if bad_acc:
            code(f"nisa.tensor_tensor(dst={bad_acc}[0:{P}, :], data1={bad_acc}[0:{P}, :], data2={bad}, "
                 f"op=nl.maximum, name=\"{name}.bad\")")
        res = tile_alloc(code, (P, n), out.dtype, name, "res")
        code(f"nisa.tensor_copy(dst={res}, src={acc}, name=\"{name}.round\")")
        code(f"nisa.dma_copy(dst={_line_ap(ctx, tile, line, dim, n, 0)}, src={res}, name=\"{name}.store\")")
        scratch[0] = max(scratch[0], tile_bytes((P, n), dt) + 3 * tile_bytes((P, n), torch.float32)
                         + tile_bytes((P, n), torch.uint8) + 64)
    walk(code, p, body)
    if bad_acc:
        raise_flag(code, ctx, ins, bad_acc)
    return scratch[0]


def _line_ap(ctx: Context, tile: Tile, ref: TRef, dim: int, count: int, at: int | str) -> str:
    """Access pattern of ``count`` elements along ``dim`` from position ``at`` (a loop variable or a constant) of
    every partition's line."""
    pd = tile.plan.pdim
    pattern = [[ref.strides[pd] if pd is not None else 1, tile.p], [ref.strides[dim], count]]
    off = tile.offset(ref)
    if isinstance(at, str) and ref.strides[dim]:
        off = f"{off} + {at} * {ref.strides[dim]}"
    elif isinstance(at, int) and at:
        off = f"{off} + {at * ref.strides[dim]}"
    return f"{ctx.var(ref.value)}.ap(pattern={pattern}, offset={off})"


# ---- guards: the same condition on the reference VM --------------------------------------------------------------
def _out_of_range(index: torch.Tensor, size: int, wrap: bool) -> bool:
    lo = -size if wrap else 0
    return bool(((index < lo) | (index >= size)).any()) if index.numel() else False


@register_guard("aten.index_select.default", "aten.index_copy.default", "aten.index_copy_.default",
                reason=OOB_REASON)
def _check_dim_index(args: tuple, kwargs: dict) -> bool:
    x, dim, index = args[0], args[1], args[2]
    return _out_of_range(index, x.shape[dim] if x.dim() else 1, wrap=False)


@register_guard("aten.index_fill.int_Scalar", "aten.index_fill.int_Tensor", reason=OOB_REASON)
def _check_fill_index(args: tuple, kwargs: dict) -> bool:
    x, dim, index = args[0], args[1], args[2]
    return _out_of_range(index, x.shape[dim] if x.dim() else 1, wrap=True)


@register_guard("aten.embedding.default", reason=OOB_REASON)
def _check_embedding(args: tuple, kwargs: dict) -> bool:
    return _out_of_range(args[1], args[0].shape[0], wrap=False)


@register_guard("aten.gather.default", "aten.scatter.src", "aten.scatter.value", "aten.scatter_add.default",
                reason=OOB_REASON)
def _check_gather(args: tuple, kwargs: dict) -> bool:
    x, dim, index = args[0], args[1], args[2]
    return _out_of_range(index, x.shape[dim] if x.dim() else 1, wrap=False)


@register_guard("aten.index.Tensor", "aten.index_put.default", "aten.index_put_.default", reason=OOB_REASON)
def _check_advanced(args: tuple, kwargs: dict) -> bool:
    x, indices = args[0], args[1]
    return any(t is not None and _out_of_range(t, x.shape[d], wrap=True) for d, t in enumerate(indices))


__all__ = ["Indexer", "Term", "advanced", "gather", "index_plan", "raise_flag", "scatter"]
