"""Selection on the tensor path: ``topk``, ``max.dim`` / ``min.dim`` (values and indices), ``argmax`` /
``argmin``, ``sort`` of short rows.

How: the selected dim goes on the free axis of every tile (one row per partition, every other dim a partition or a
loop), converted to fp32 (negated for the smallest: the engines only find the largest). ``max8`` gives a row's 8
largest values in descending order and ``nc_match_replace8`` the index of each and knocks it out (replaced by
``-FLT_MAX``), so equal values get distinct indices, lowest index first, and ``k > 8`` is more rounds of the two
on what is left (a sort is ``n / 8`` rounds). Rows shorter than 8 are padded with the row's minimum, which
never outranks a real element (a pad sits at a higher index than every equal real value). A row longer than one
tile (an argmax over a vocabulary) is walked in chunks: each chunk's top values and their indices are
candidates, and the row's top is the candidates' (see :class:`_Selection`).

Tie-breaking, eager's where eager defines it: ``max.dim`` / ``argmax`` (and ``min`` / ``argmin``) return the
first occurrence of the extreme (PyTorch's documentation), which is what the kernel picks, exactly. ``topk`` and
``sort`` (not ``stable=True``) leave the order of equal values to the implementation, and eager's CPU kernels
do not order them by index (``torch.topk`` partial-sorts by value alone): a row with tied values among the
``k + 1`` largest (so the chosen set or its order could differ) raises the kernel's guard flag, and the step is
recomputed eagerly. ``sort(stable=True)`` is defined (equal values keep their order) and matched without a
guard. NaN: eager ranks NaN above every number; the engines do not compare NaN, so a NaN in a row raises the
flag for every op here. ``topk(sorted=False)`` returns the values sorted (an order eager allows: it leaves the
order unspecified). A value equal to ``-FLT_MAX`` among the selected ones of a multi-round selection raises the
flag too (the knock-out value could be selected again, and a ``-inf`` would lose to it; in a chunked row a chunk's
pad has that value). Integer values are compared in fp32, exact below 2^24: a larger one raises the flag.
"""
from __future__ import annotations

from typing import Any

import torch

from ..emitters import Context
from ..errors import CodegenError
from ..layout import PMAX
from .index import raise_flag
from .instruction import TensorOp, register_emitter, register_guard, tile_alloc, tile_bytes
from .reduce import FLT_MAX
from .tiles import FREE_MAX, Code, Tile, plan, walk
from .view import TRef, reshape, unsqueeze

ORDER_REASON = ("tied values, NaN or integers beyond 2^24 in a top-k or sort (eager orders equal values its own way, "
                "NaN first; the engines compare in fp32)")
NAN_REASON = "NaN or integers beyond 2^24 in a max/min/argmax/argmin (eager picks the NaN; the engines compare in fp32)"
#: integers the engines' fp32 compares exactly
INT_EXACT = 1 << 24


def _aligned(out: TRef, xshape: tuple[int, ...], dim: int, k: int, flat: bool) -> TRef:
    """``out`` as a view over ``x``'s space with ``k`` along ``dim`` (a dropped dim restored with size 1)."""
    if flat:
        ref = TRef(out.value, (1,), (1,), out.offset)
    elif len(out.shape) == len(xshape):
        ref = out
    else:
        ref = unsqueeze(out, dim)
    return TRef(ref.value, xshape[:dim] + (k,) + xshape[dim + 1:], ref.strides, ref.offset)


def _store_ap(ctx: Context, tile: Tile, ref: TRef, dim: int, k: int) -> str:
    pd = tile.plan.pdim
    pattern = [[ref.strides[pd] if pd is not None else 1, tile.p], [ref.strides[dim], k]]
    return f"{ctx.var(ref.value)}.ap(pattern={pattern}, offset={tile.offset(ref)})"


def select(ins: TensorOp, ctx: Context, code: Code, x: TRef, dim: int, k: int, largest: bool, ties: bool,
           values: TRef | None, indices: TRef | None, flat: bool = False) -> int:
    """The ``k`` largest (``largest``) or smallest of every row of ``x`` along ``dim``, in order, into
    ``values`` / ``indices`` (either may be None); ``ties``: tied values among the ``k + 1`` first raise the
    flag (see the module docstring)."""
    rank = len(x.shape)
    dim %= rank
    n = x.shape[dim]
    if not 1 <= k <= n:
        raise CodegenError(f"{ins.op}: k={k} of {n} values")
    sel = _Selection(ins, ctx, code, x, dim, k, largest, ties, values, indices, flat)
    walk(code, sel.plan, sel.body, before=sel.before, after=sel.after)
    if sel.bad_acc:
        raise_flag(code, ctx, ins, sel.bad_acc)
    return sel.scratch


class _Selection:
    """One selection's tiles. A row that fits one tile: its top ``need`` by rounds of max8 / match_replace8. A
    longer row (the plan chunks it): each chunk's top ``need`` (values, and indices offset by the chunk's start)
    are candidates, which hold the row's top ``need`` (every chunk gave its own); after the last chunk the
    candidates' top ``need`` is the row's, its positions mapped back to the candidates' indices. Candidates are in
    chunk order and each chunk's equal values in index order, so the first of equal values is still the lowest
    index (argmax's first occurrence holds across chunks)."""

    def __init__(self, ins: TensorOp, ctx: Context, code: Code, x: TRef, dim: int, k: int, largest: bool,
                 ties: bool, values: TRef | None, indices: TRef | None, flat: bool) -> None:
        self.ins, self.ctx, self.code, self.x, self.dim, self.k = ins, ctx, code, x, dim, k
        self.largest, self.ties, self.values, self.indices = largest, ties, values, indices
        self.name = ins.name_stem()
        self.n = n = x.shape[dim]
        self.plan = plan(x.shape, inner=(dim,), loops_outer=True)
        self.chunk = self.plan.chunk
        self.need = min(k + 1, n) if ties else k
        self.rounds = -(-self.need // 8)
        self.outs = [(r, _aligned(r, x.shape, dim, k, flat)) for r in (values, indices) if r is not None]
        self.integer = not x.dtype.is_floating_point
        self.bad_acc = self.bad = self.cv = self.ci = ""
        if ins.flag is not None:
            self.bad_acc = tile_alloc(code, (PMAX, 1), torch.float32, self.name, "bad")
            code(f"nisa.memset(dst={self.bad_acc}, value=0.0, name=\"{self.name}.bad\")")
        width = self.chunk or n
        self.C = -(-n // self.chunk) * 8 * self.rounds if self.chunk else 0
        self.scratch = (tile_bytes((1, width), x.dtype) + (self.rounds + 3) * tile_bytes((1, max(width, 8)), torch.float32)
                        + 2 * tile_bytes((1, self.C), torch.float32) + 16 * self.rounds * 8 + 4 * k * 4 + 64)

    # ---- per row tile --------------------------------------------------------------------------------------
    def before(self, tile: Tile) -> None:
        code, name, P = self.code, self.name, tile.p
        if self.ins.flag is not None:
            self.bad = tile_alloc(code, (P, 1), torch.float32, name, "rowbad")
            code(f"nisa.memset(dst={self.bad}, value=0.0, name=\"{name}.rowbad\")")
        if self.chunk:  # the candidates of every chunk
            self.cv = tile_alloc(code, (P, self.C), torch.float32, name, "cand")
            self.ci = tile_alloc(code, (P, self.C), torch.float32, name, "candidx")

    def body(self, tile: Tile) -> None:
        code, name, P = self.code, self.name, tile.p
        width = tile.sizes.get(self.dim, 1) if self.chunk else self.n
        w = self._load(tile, width)
        W = max(width, 8)
        if width < 8:
            self._pad(w, width, P, row_min=not self.chunk)
        vals, idx = self._top(w, W, P)
        if not self.chunk:
            self._finish(tile, vals, idx)
            return
        R8 = 8 * self.rounds
        start = tile.start[self.dim]
        col = f"({start}) // {self.chunk} * {R8}"
        code(f"nisa.tensor_copy(dst={self.cv}[:, {col}:{col} + {R8}], src={vals}, name=\"{name}.cand\")")
        code(f"nisa.tensor_scalar(dst={self.ci}[:, {col}:{col} + {R8}], data={idx}, op0=nl.add, "
             f"operand0=({start}) * 1.0, name=\"{name}.candidx\")")

    def after(self, tile: Tile) -> None:
        code, name, P = self.code, self.name, tile.p
        if self.chunk:  # the row's top among the candidates; positions back to the candidates' indices
            vals, pos = self._top(self.cv, self.C, P)
            posf = tile_alloc(code, (P, self.k), torch.float32, name, "pos")
            code(f"nisa.tensor_copy(dst={posf}, src={pos}[:, 0:{self.k}], name=\"{name}.pos\")")
            slots = tile_alloc(code, (P, self.C), torch.float32, name, "slots")
            code(f"nisa.iota(dst={slots}, pattern=[[1, {self.C}]], offset=0, channel_multiplier=0, "
                 f"name=\"{name}.slots\")")
            gidx = tile_alloc(code, (P, self.k), torch.float32, name, "gidx")
            for j in range(self.k):  # indices are finite: a one-hot product is exact here
                hit = tile_alloc(code, (P, self.C), torch.float32, name, "hit")
                code(f"nisa.tensor_scalar(dst={hit}, data={slots}, op0=nl.equal, operand0={posf}[:, {j}:{j + 1}], "
                     f"name=\"{name}.hit\")")
                code(f"nisa.tensor_tensor(dst={hit}, data1={hit}, data2={self.ci}, op=nl.multiply, "
                     f"name=\"{name}.pick\")")
                code(f"nisa.tensor_reduce(dst={gidx}[:, {j}:{j + 1}], op=nl.add, data={hit}, axis=(1,), "
                     f"name=\"{name}.gidx\")")
            self._finish(tile, vals, gidx)
        if self.bad:
            code(f"nisa.tensor_tensor(dst={self.bad_acc}[0:{P}, :], data1={self.bad_acc}[0:{P}, :], "
                 f"data2={self.bad}, op=nl.maximum, name=\"{name}.bad\")")

    # ---- steps -----------------------------------------------------------------------------------------------
    def _load(self, tile: Tile, width: int) -> str:
        """The row (chunk) in fp32, negated for the smallest, NaN zeroed (and flagged), integers beyond 2^24
        flagged."""
        code, name, P, x = self.code, self.name, tile.p, self.x
        t = tile_alloc(code, tile.shape(), x.dtype, name, "x")
        code(f"nisa.dma_copy(dst={t}, src={tile.ap(self.ctx.var(x.value), x)}, name=\"{name}.load\")")
        w = tile_alloc(code, (P, max(width, 8)), torch.float32, name, "w")
        if self.largest:
            code(f"nisa.tensor_copy(dst={w}[:, 0:{width}], src={t}, name=\"{name}.f32\")")
        else:  # the smallest are the largest of the negated values
            code(f"nisa.tensor_scalar(dst={w}[:, 0:{width}], data={t}, op0=nl.multiply, operand0=-1.0, "
                 f"name=\"{name}.negate\")")
        if not self.bad:
            return w
        if self.integer:  # fp32 compares integers exactly below 2^24
            big = tile_alloc(code, (P, width), torch.float32, name, "big")
            code(f"nisa.tensor_scalar(dst={big}, data={w}[:, 0:{width}], op0=nl.abs, operand0=0.0, op1=nl.greater_equal, "
                 f"operand1={float(INT_EXACT)!r}, name=\"{name}.big\")")
            _or_row(code, name, self.bad, big, P)
        else:  # NaN raises the flag and is zeroed: max8 / match_replace8 cannot find a NaN again (NaN != NaN),
            # which is undefined behaviour on the hardware
            ne = tile_alloc(code, (P, width), torch.uint8, name, "nan")
            code(f"nisa.tensor_tensor(dst={ne}, data1={w}[:, 0:{width}], data2={w}[:, 0:{width}], "
                 f"op=nl.not_equal, name=\"{name}.nan\")")
            _or_row(code, name, self.bad, ne, P)
            code(f"nisa.tensor_copy_predicated(dst={w}[:, 0:{width}], src=0.0, predicate={ne}, "
                 f"name=\"{name}.nonan\")")
        return w

    def _pad(self, w: str, width: int, P: int, row_min: bool) -> None:
        """Columns ``width..8`` of a short row: its minimum (never ranked above a real element: it sits at a
        higher index than the equal real value), or in a chunk ``-FLT_MAX`` (a chunk's pad must lose to every other
        chunk's values; selecting one raises the flag, see :meth:`_finish`)."""
        code, name = self.code, self.name
        if not row_min:
            code(f"nisa.memset(dst={w}[:, {width}:8], value={-FLT_MAX!r}, name=\"{name}.pad\")")
            return
        mn = tile_alloc(code, (P, 1), torch.float32, name, "min")
        code(f"nisa.tensor_reduce(dst={mn}, op=nl.minimum, data={w}[:, 0:{width}], axis=(1,), name=\"{name}.min\")")
        code(f"nisa.memset(dst={w}[:, {width}:8], value=0.0, name=\"{name}.pad0\")")
        code(f"nisa.tensor_scalar(dst={w}[:, {width}:8], data={w}[:, {width}:8], op0=nl.add, operand0={mn}, "
             f"name=\"{name}.pad\")")

    def _top(self, w: str, W: int, P: int) -> tuple[str, str]:
        """The top ``8 * rounds`` of ``w`` ([P, W] fp32): values (descending) and uint32 positions."""
        code, name = self.code, self.name
        R8 = 8 * self.rounds
        vals = tile_alloc(code, (P, R8), torch.float32, name, "vals")
        idx = code.fresh("idx")  # uint32: what nc_match_replace8 writes (no torch dtype the templates map)
        code(f"{idx} = nl.ndarray(shape=({P}, {R8}), dtype=nl.uint32, buffer=nl.sbuf, name=\"{name}.idx\")")
        cur = w
        for r in range(self.rounds):
            sl = f"[:, {8 * r}:{8 * r + 8}]"
            code(f"nisa.max8(dst={vals}{sl}, src={cur}, name=\"{name}.max8\")")
            nxt = tile_alloc(code, (P, W), torch.float32, name, "rest")
            code(f"nisa.nc_match_replace8(dst={nxt}, data={cur}, vals={vals}{sl}, imm={-FLT_MAX!r}, "
                 f"dst_idx={idx}{sl}, name=\"{name}.find8\")")
            cur = nxt
        return vals, idx

    def _finish(self, tile: Tile, vals: str, idx: str) -> None:
        """Guards on the row's sorted values, then the outputs."""
        code, name, P, k = self.code, self.name, tile.p, self.k
        if self.bad and self.ties and self.need > 1:  # equal neighbours among the first k + 1
            pairs = self.need - 1
            eq = tile_alloc(code, (P, pairs), torch.float32, name, "tie")
            code(f"nisa.tensor_tensor(dst={eq}, data1={vals}[:, 0:{pairs}], data2={vals}[:, 1:{pairs + 1}], "
                 f"op=nl.equal, name=\"{name}.tie\")")
            _or_row(code, name, self.bad, eq, P)
        if self.bad and (self.rounds > 1 or self.chunk):  # the knock-out (or a chunk's pad) value among the
            # selected: it may stand for another element (and a -inf would lose to it)
            imm = tile_alloc(code, (P, k), torch.float32, name, "imm")
            code(f"nisa.tensor_scalar(dst={imm}, data={vals}[:, 0:{k}], op0=nl.less_equal, operand0={-FLT_MAX!r}, "
                 f"name=\"{name}.imm\")")
            _or_row(code, name, self.bad, imm, P)
        for out, al in self.outs:
            o = tile_alloc(code, (P, k), out.dtype, name, "o")
            if out is self.indices:
                code(f"nisa.tensor_copy(dst={o}, src={idx}[:, 0:{k}], name=\"{name}.indices\")")
            elif self.largest:
                code(f"nisa.tensor_copy(dst={o}, src={vals}[:, 0:{k}], name=\"{name}.values\")")
            else:
                code(f"nisa.tensor_scalar(dst={o}, data={vals}[:, 0:{k}], op0=nl.multiply, operand0=-1.0, "
                     f"name=\"{name}.values\")")
            code(f"nisa.dma_copy(dst={_store_ap(self.ctx, tile, al, self.dim, k)}, src={o}, name=\"{name}.store\")")


def _or_row(code: Code, name: str, bad: str, cond: str, P: int) -> None:
    """``bad = max(bad, any(cond))`` for a ``[P, m]`` 0/1 tile."""
    one = tile_alloc(code, (P, 1), torch.float32, name, "any")
    code(f"nisa.tensor_reduce(dst={one}, op=nl.maximum, data={cond}, axis=(1,), name=\"{name}.any\")")
    code(f"nisa.tensor_tensor(dst={bad}, data1={bad}, data2={one}, op=nl.maximum, name=\"{name}.or\")")


def _arg(ins: TensorOp, i: int, key: str, default: Any) -> Any:
    return ins.args[i] if len(ins.args) > i else ins.kwargs.get(key, default)


@register_emitter("aten.topk.default")
def _topk(ins: TensorOp, ctx: Context, code: Code) -> int:
    x, k = ins.args[0], int(ins.args[1])
    dim, largest = _arg(ins, 2, "dim", -1), bool(_arg(ins, 3, "largest", True))
    if not x.shape:
        x = TRef(x.value, (1,), (1,), x.offset)
    return select(ins, ctx, code, x, dim, k, largest, True, ins.outs[0], ins.outs[1])


@register_emitter("aten.max.dim", "aten.min.dim")
def _max_dim(ins: TensorOp, ctx: Context, code: Code) -> int:
    x, dim = ins.args[0], ins.args[1]
    if not x.shape:
        raise CodegenError(f"{ins.op} of a 0-d value")
    return select(ins, ctx, code, x, dim, 1, ins.op == "aten.max.dim", False, ins.outs[0], ins.outs[1])


@register_emitter("aten.argmax.default", "aten.argmin.default")
def _argmax(ins: TensorOp, ctx: Context, code: Code) -> int:
    x = ins.args[0]
    dim = _arg(ins, 1, "dim", None)
    largest = ins.op == "aten.argmax.default"
    if dim is None or not x.shape:
        flat = reshape(x, (x.numel,))
        if flat is None:
            raise CodegenError(f"{ins.op} over every dim of a non-contiguous value")
        return select(ins, ctx, code, flat, 0, 1, largest, False, None, ins.outs[0], flat=True)
    return select(ins, ctx, code, x, dim, 1, largest, False, None, ins.outs[0])


@register_emitter("aten.sort.default", "aten.sort.stable")
def _sort(ins: TensorOp, ctx: Context, code: Code) -> int:
    x = ins.args[0]
    if ins.op == "aten.sort.stable":
        stable = bool(ins.kwargs.get("stable", ins.args[1] if len(ins.args) > 1 else False))
        dim, descending = ins.kwargs.get("dim", -1), bool(ins.kwargs.get("descending", False))
    else:
        stable = False
        dim, descending = _arg(ins, 1, "dim", -1), bool(_arg(ins, 2, "descending", False))
    if not x.shape:
        x = TRef(x.value, (1,), (1,), x.offset)
    n = x.shape[dim % len(x.shape)]
    return select(ins, ctx, code, x, dim, n, descending, not stable, ins.outs[0], ins.outs[1])


# ---- guards: the same conditions on the reference VM -------------------------------------------------------------
def _unexact(x: torch.Tensor) -> bool:
    """NaN, or an integer the engines' fp32 does not hold exactly."""
    if x.dtype.is_floating_point:
        return bool(torch.isnan(x).any())
    return bool((x.long().abs() >= INT_EXACT).any()) if x.numel() else False


def _order_trips(x: torch.Tensor, dim: int, k: int, largest: bool, ties: bool) -> bool:
    if x.dim() == 0:
        x = x.reshape(1)
    if _unexact(x):
        return True
    xf = x.float()
    w = (xf if largest else -xf).movedim(dim, -1)
    n = w.shape[-1]
    need = min(k + 1, n) if ties else k
    v = torch.sort(w, dim=-1, descending=True).values[..., :need]
    if ties and need > 1 and bool((v[..., :-1] == v[..., 1:]).any()):
        return True
    chunked = n > FREE_MAX
    return (-(-need // 8) > 1 or chunked) and bool((v[..., :k] <= -FLT_MAX).any())


@register_guard("aten.topk.default", reason=ORDER_REASON)
def _check_topk(args: tuple, kwargs: dict) -> bool:
    x, k = args[0], int(args[1])
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
    return _order_trips(x, dim, k, bool(largest), True)


@register_guard("aten.sort.default", reason=ORDER_REASON)
def _check_sort(args: tuple, kwargs: dict) -> bool:
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
    descending = bool(args[2] if len(args) > 2 else kwargs.get("descending", False))
    return _order_trips(x, dim, x.shape[dim] if x.dim() else 1, descending, True)


@register_guard("aten.sort.stable", reason=ORDER_REASON)
def _check_sort_stable(args: tuple, kwargs: dict) -> bool:
    x = args[0]
    dim, descending = kwargs.get("dim", -1), bool(kwargs.get("descending", False))
    return _order_trips(x, dim, x.shape[dim] if x.dim() else 1, descending, not kwargs.get("stable"))


def _extreme_trips(args: tuple, kwargs: dict, largest: bool) -> bool:
    """NaN / inexact integers; in a row longer than one tile (candidates per chunk) also an extreme at
    ``-FLT_MAX`` (in the selection's sign), which the kernel cannot tell from a chunk's pad."""
    x = args[0]
    if _unexact(x):
        return True
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    w = x.float() if largest else -x.float()
    rows = w.reshape(1, -1) if dim is None or x.dim() == 0 else w.movedim(dim, -1)
    return rows.shape[-1] > FREE_MAX and bool(rows.amax(-1).le(-FLT_MAX).any())


@register_guard("aten.max.dim", "aten.argmax.default", reason=NAN_REASON)
def _check_max(args: tuple, kwargs: dict) -> bool:
    return _extreme_trips(args, kwargs, True)


@register_guard("aten.min.dim", "aten.argmin.default", reason=NAN_REASON)
def _check_min(args: tuple, kwargs: dict) -> bool:
    return _extreme_trips(args, kwargs, False)


__all__ = ["NAN_REASON", "ORDER_REASON", "select"]
