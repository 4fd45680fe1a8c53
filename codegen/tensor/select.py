"""Selection on the tensor path: ``topk``, ``max.dim`` / ``min.dim`` (values and indices), ``argmax`` /
``argmin``, ``sort`` of short rows.

How: the selected dim goes on the free axis of every tile (one row per partition, every other dim a partition or a
loop), converted to fp32 (negated for the smallest: the engines only find the largest). ``max8`` gives a row's 8
largest values in descending order and ``nc_match_replace8`` the index of each and knocks it out (replaced by
``-FLT_MAX``), so equal values get distinct indices, lowest index first, and ``k > 8`` is more rounds of the two
on what is left (a sort is ``n / 8`` rounds). Rows shorter than 8 are padded with the row's minimum, which
never outranks a real element (a pad sits at a higher index than every equal real value).

Tie-breaking, eager's where eager defines it: ``max.dim`` / ``argmax`` (and ``min`` / ``argmin``) return the
first occurrence of the extreme (PyTorch's documentation), which is what the kernel picks, exactly. ``topk`` and
``sort`` (not ``stable=True``) leave the order of equal values to the implementation, and eager's CPU kernels
do not order them by index (``torch.topk`` partial-sorts by value alone): a row with tied values among the
``k + 1`` largest (so the chosen set or its order could differ) raises the kernel's guard flag, and the step is
recomputed eagerly. ``sort(stable=True)`` is defined (equal values keep their order) and matched without a
guard. NaN: eager ranks NaN above every number; the engines do not compare NaN, so a NaN in a row raises the
flag for every op here. ``topk(sorted=False)`` returns the values sorted (an order eager allows: it leaves the
order unspecified). A value equal to ``-FLT_MAX`` among the selected ones of a multi-round selection raises the
flag too (the knock-out value could be selected again, and a ``-inf`` would lose to it). Integer inputs are
refused by matching (the engines compare in fp32).
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
from .tiles import Code, Tile, plan, walk
from .view import TRef, reshape, unsqueeze

ORDER_REASON = "tied or NaN values in a top-k or sort (eager orders equal values its own way)"
NAN_REASON = "NaN among the values of a max/min/argmax/argmin (eager picks the NaN)"


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
    p = plan(x.shape, inner=(dim,), loops_outer=True)
    if p.chunk:
        raise CodegenError(f"{ins.op} over {n} values (longer than one tile)")
    name = ins.name_stem()
    W = max(n, 8)
    need = min(k + 1, n) if ties else k
    rounds = -(-need // 8)
    outs = [(r, _aligned(r, x.shape, dim, k, flat)) for r in (values, indices) if r is not None]
    bad_acc = ""
    if ins.flag is not None:
        bad_acc = tile_alloc(code, (PMAX, 1), torch.float32, name, "bad")
        code(f"nisa.memset(dst={bad_acc}, value=0.0, name=\"{name}.bad\")")

    def body(tile: Tile) -> None:
        P = tile.p
        t = tile_alloc(code, tile.shape(), x.dtype, name, "x")
        code(f"nisa.dma_copy(dst={t}, src={tile.ap(ctx.var(x.value), x)}, name=\"{name}.load\")")
        w = tile_alloc(code, (P, W), torch.float32, name, "w")
        if largest:
            code(f"nisa.tensor_copy(dst={w}[:, 0:{n}], src={t}, name=\"{name}.f32\")")
        else:  # the smallest are the largest of the negated values
            code(f"nisa.tensor_scalar(dst={w}[:, 0:{n}], data={t}, op0=nl.multiply, operand0=-1.0, "
                 f"name=\"{name}.negate\")")
        bad = ""
        if ins.flag is not None:  # NaN anywhere in the row raises the flag, and is zeroed: max8 / match_replace8
            # cannot find a NaN again (NaN != NaN), which is undefined behaviour on the hardware
            ne = tile_alloc(code, (P, n), torch.uint8, name, "nan")
            code(f"nisa.tensor_tensor(dst={ne}, data1={w}[:, 0:{n}], data2={w}[:, 0:{n}], op=nl.not_equal, "
                 f"name=\"{name}.nan\")")
            bad = tile_alloc(code, (P, 1), torch.float32, name, "rowbad")
            code(f"nisa.tensor_reduce(dst={bad}, op=nl.maximum, data={ne}, axis=(1,), name=\"{name}.anynan\")")
            code(f"nisa.tensor_copy_predicated(dst={w}[:, 0:{n}], src=0.0, predicate={ne}, name=\"{name}.nonan\")")
        if n < 8:  # pad with the row's minimum: never ranked above a real element
            mn = tile_alloc(code, (P, 1), torch.float32, name, "min")
            code(f"nisa.tensor_reduce(dst={mn}, op=nl.minimum, data={w}[:, 0:{n}], axis=(1,), name=\"{name}.min\")")
            code(f"nisa.memset(dst={w}[:, {n}:8], value=0.0, name=\"{name}.pad0\")")
            code(f"nisa.tensor_scalar(dst={w}[:, {n}:8], data={w}[:, {n}:8], op0=nl.add, operand0={mn}, "
                 f"name=\"{name}.pad\")")
        vals = tile_alloc(code, (P, 8 * rounds), torch.float32, name, "vals")
        idx = code.fresh("idx")  # uint32: what nc_match_replace8 writes (no torch dtype the templates map)
        code(f"{idx} = nl.ndarray(shape=({P}, {8 * rounds}), dtype=nl.uint32, buffer=nl.sbuf, name=\"{name}.idx\")")
        cur = w
        for r in range(rounds):
            sl = f"[:, {8 * r}:{8 * r + 8}]"
            code(f"nisa.max8(dst={vals}{sl}, src={cur}, name=\"{name}.max8\")")
            nxt = tile_alloc(code, (P, W), torch.float32, name, "rest")
            code(f"nisa.nc_match_replace8(dst={nxt}, data={cur}, vals={vals}{sl}, imm={-FLT_MAX!r}, "
                 f"dst_idx={idx}{sl}, name=\"{name}.find8\")")
            cur = nxt
        if bad and ties and need > 1:  # equal neighbours among the first k + 1
            pairs = need - 1
            eq = tile_alloc(code, (P, pairs), torch.float32, name, "tie")
            code(f"nisa.tensor_tensor(dst={eq}, data1={vals}[:, 0:{pairs}], data2={vals}[:, 1:{pairs + 1}], "
                 f"op=nl.equal, name=\"{name}.tie\")")
            _or_row(code, name, bad, eq, P)
        if bad and rounds > 1:  # the knock-out value among the selected: it may have been selected again
            imm = tile_alloc(code, (P, k), torch.float32, name, "imm")
            code(f"nisa.tensor_scalar(dst={imm}, data={vals}[:, 0:{k}], op0=nl.less_equal, operand0={-FLT_MAX!r}, "
                 f"name=\"{name}.imm\")")
            _or_row(code, name, bad, imm, P)
        if bad:
            code(f"nisa.tensor_tensor(dst={bad_acc}[0:{P}, :], data1={bad_acc}[0:{P}, :], data2={bad}, "
                 f"op=nl.maximum, name=\"{name}.bad\")")
        for out, al in outs:
            o = tile_alloc(code, (P, k), out.dtype, name, "o")
            if out is indices:
                code(f"nisa.tensor_copy(dst={o}, src={idx}[:, 0:{k}], name=\"{name}.indices\")")
            elif largest:
                code(f"nisa.tensor_copy(dst={o}, src={vals}[:, 0:{k}], name=\"{name}.values\")")
            else:
                code(f"nisa.tensor_scalar(dst={o}, data={vals}[:, 0:{k}], op0=nl.multiply, operand0=-1.0, "
                     f"name=\"{name}.values\")")
            code(f"nisa.dma_copy(dst={_store_ap(ctx, tile, al, dim, k)}, src={o}, name=\"{name}.store\")")
    walk(code, p, body)
    if bad_acc:
        raise_flag(code, ctx, ins, bad_acc)
    return (tile_bytes((1, n), x.dtype) + (rounds + 2) * tile_bytes((1, W), torch.float32)
            + rounds * 8 * 8 + 2 * k * 4 + 64)


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
def _order_trips(x: torch.Tensor, dim: int, k: int, largest: bool, ties: bool) -> bool:
    if x.dim() == 0:
        x = x.reshape(1)
    xf = x.float()
    if bool(torch.isnan(xf).any()):
        return True
    w = (xf if largest else -xf).movedim(dim, -1)
    n = w.shape[-1]
    need = min(k + 1, n) if ties else k
    v = torch.sort(w, dim=-1, descending=True).values[..., :need]
    if ties and need > 1 and bool((v[..., :-1] == v[..., 1:]).any()):
        return True
    return -(-need // 8) > 1 and bool((v[..., :k] <= -FLT_MAX).any())


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


@register_guard("aten.max.dim", "aten.min.dim", "aten.argmax.default", "aten.argmin.default", reason=NAN_REASON)
def _check_nan(args: tuple, kwargs: dict) -> bool:
    return bool(torch.isnan(args[0].float()).any())


__all__ = ["NAN_REASON", "ORDER_REASON", "select"]
