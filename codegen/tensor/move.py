"""Data movement on the tensor path: concatenation, stacking, padding, scatters into slices, rolls, repeats,
fills and writes of state, as DMA copies between strided views.

Why DMAs and no engine: these ops only move elements, and a DMA copies HBM to HBM through two access patterns
(nki_api.md, ``nisa.dma_copy``: HBM<->HBM, element counts equal, shapes may differ), so a concatenation is one
copy per input into its slice of the output, a roll two copies, a ``repeat`` one copy from a source broadcast
with stride 0. Fills go through one memset SBUF tile. A write of state (``copy_`` into a state input: a
convolution's rolling window, an SSM's state) is a copy into the state tensor in place, as the KV cache's rows.
"""
from __future__ import annotations

from typing import Any


from ..emitters import Context
from ..errors import CodegenError
from .instruction import TensorOp, kernel_dtype, literal, register_emitter, tile_alloc, tile_bytes
from .tiles import Code, Tile, plan, walk
from .view import TRef, broadcast_to, contiguous_strides, select, slice_

#: dims of one DMA access pattern (partition entry + 4 free dims; nki_api.md "Rules that matter")
AP_DIMS = 5
#: elements of one access-pattern entry (uint16 counts)
COUNT_MAX = 65535


def _merged(dst: TRef, src: TRef) -> list[tuple[int, int, int]]:
    """``(count, dst stride, src stride)`` per dim of a copy, size-1 dims dropped and neighbours merged where both
    sides are contiguous across them (fewer, longer access-pattern entries)."""
    dims = [(n, a, b) for n, a, b in zip(dst.shape, dst.strides, src.strides) if n != 1]
    out: list[tuple[int, int, int]] = []
    for n, a, b in reversed(dims):
        if out and out[0][1] * out[0][0] == a and out[0][2] * out[0][0] == b and out[0][0] * n <= COUNT_MAX:
            m, sa, sb = out[0]
            out[0] = (m * n, sa, sb)
        else:
            out.insert(0, (n, a, b))
    return out or [(1, 1, 1)]


def copy_view(code: Code, ctx: Context, dst: TRef, src: TRef, label: str) -> None:
    """``dst[...] = src[...]`` (same shape) by HBM->HBM DMAs; leading dims beyond one access pattern become loops."""
    if tuple(dst.shape) != tuple(src.shape):
        raise CodegenError(f"copy of {src.shape} into {dst.shape}")
    dims = _merged(dst, src)
    if any(n > COUNT_MAX for n, _, _ in dims):
        raise CodegenError(f"a copy of {dst.numel} elements with a run longer than {COUNT_MAX}")
    loops, inner = dims[:-AP_DIMS] if len(dims) > AP_DIMS else [], dims[-AP_DIMS:]
    offs_d, offs_s = [str(dst.offset)], [str(src.offset)]
    depth = 0
    for n, a, b in loops:
        var = code.fresh("m")
        code(f"for {var} in range({n}):")
        code.depth += 1
        depth += 1
        offs_d.append(f"{var} * {a}")
        offs_s.append(f"{var} * {b}")
    pd = [[a, n] for n, a, _ in inner]
    ps = [[b, n] for n, _, b in inner]
    code(f"nisa.dma_copy(dst={ctx.var(dst.value)}.ap(pattern={pd}, offset={' + '.join(offs_d)}), "
         f"src={ctx.var(src.value)}.ap(pattern={ps}, offset={' + '.join(offs_s)}), name=\"{label}\")")
    code.depth -= depth


def fill(code: Code, ctx: Context, dst: TRef, value: Any, label: str) -> int:
    """Every element of ``dst`` set to ``value``: one memset tile per tile of the walk, stored."""
    dt = kernel_dtype(dst.dtype)
    lit = literal(value, dt)
    scratch = [0]

    def body(tile: Tile) -> None:
        t = tile_alloc(code, tile.shape(), dst.dtype, label, "fill")
        code(f"nisa.memset(dst={t}, value={lit}, name=\"{label}.fill\")")
        code(f"nisa.dma_copy(dst={tile.ap(ctx.var(dst.value), dst)}, src={t}, name=\"{label}.store\")")
        scratch[0] = tile_bytes(tile.shape(), dst.dtype)
    walk(code, plan(dst.shape), body)
    return scratch[0]


def _out(ins: TensorOp) -> TRef:
    return ins.outs[0]


@register_emitter("aten.cat.default")
def _cat(ins: TensorOp, ctx: Context, code: Code) -> int:
    parts = [p for p in ins.args[0] if isinstance(p, TRef)]
    dim = ins.args[1] if len(ins.args) > 1 else ins.kwargs.get("dim", 0)
    out = _out(ins)
    dim %= len(out.shape)
    start = 0
    for k, p in enumerate(parts):
        if p.numel == 0:
            continue
        n = p.shape[dim]
        copy_view(code, ctx, slice_(out, dim, start, start + n), p, f"{ins.name_stem()}.part{k}")
        start += n
    return 0


@register_emitter("aten.stack.default")
def _stack(ins: TensorOp, ctx: Context, code: Code) -> int:
    parts = ins.args[0]
    dim = ins.args[1] if len(ins.args) > 1 else ins.kwargs.get("dim", 0)
    out = _out(ins)
    dim %= len(out.shape)
    for k, p in enumerate(parts):
        copy_view(code, ctx, select(out, dim, k), p, f"{ins.name_stem()}.part{k}")
    return 0


@register_emitter("aten.copy_.default", "aten.copy.default")
def _copy(ins: TensorOp, ctx: Context, code: Code) -> int:
    """``copy_(state, src)`` writes the state in place (``outs[0]`` is the state's view); the functional ``copy``
    writes a fresh buffer. Either way ``src`` broadcasts to the destination and converts to its type."""
    dst, src = _out(ins), ins.args[1]
    if not isinstance(src, TRef):
        return fill(code, ctx, dst, src, ins.name_stem())
    copy_view(code, ctx, dst, broadcast_to(src, dst.shape), ins.name_stem())
    return 0


@register_emitter("aten.constant_pad_nd.default")
def _pad(ins: TensorOp, ctx: Context, code: Code) -> int:
    x, pads = ins.args[0], list(ins.args[1])
    value = ins.args[2] if len(ins.args) > 2 else 0
    out = _out(ins)
    if any(p < 0 for p in pads):
        raise CodegenError("constant_pad_nd with negative padding (a crop)")
    scratch = fill(code, ctx, out, value, ins.name_stem())
    inner = out
    for i in range(len(pads) // 2):
        d = len(out.shape) - 1 - i
        inner = slice_(inner, d, pads[2 * i], pads[2 * i] + x.shape[d])
    copy_view(code, ctx, inner, x, f"{ins.name_stem()}.inner")
    return scratch


@register_emitter("aten.slice_scatter.default", "aten.select_scatter.default")
def _scatter_view(ins: TensorOp, ctx: Context, code: Code) -> int:
    x, src = ins.args[0], ins.args[1]
    out = _out(ins)
    copy_view(code, ctx, out, x, f"{ins.name_stem()}.base")
    rest = list(ins.args[2:])
    if ins.op == "aten.select_scatter.default":
        region = select(out, rest[0], rest[1])
    else:
        dim, start, end, step = (rest + [0, None, None, 1][len(rest):])[:4]
        region = slice_(out, dim, start, end, step)
    copy_view(code, ctx, region, broadcast_to(src, region.shape), f"{ins.name_stem()}.src")
    return 0


@register_emitter("aten.roll.default")
def _roll(ins: TensorOp, ctx: Context, code: Code) -> int:
    x, shifts = ins.args[0], ins.args[1]
    dims = ins.args[2] if len(ins.args) > 2 else []
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = [dims] if isinstance(dims, int) else list(dims)
    out = _out(ins)
    if not dims:  # roll of the flattened value
        flat = TRef(out.value, (out.numel,), (1,), out.offset)
        src = TRef(x.value, (x.numel,), (1,), x.offset) if x.contiguous() else None
        if src is None:
            raise CodegenError("roll without dims of a non-contiguous value")
        return _roll_dim(code, ctx, flat, src, shifts[0], 0, ins.name_stem())
    if len(dims) != 1:
        raise CodegenError(f"roll over {len(dims)} dims")
    return _roll_dim(code, ctx, out, x, shifts[0], dims[0], ins.name_stem())


def _roll_dim(code: Code, ctx: Context, out: TRef, x: TRef, shift: int, dim: int, label: str) -> int:
    dim %= len(out.shape)
    n = out.shape[dim]
    s = shift % n
    if s == 0:
        copy_view(code, ctx, out, x, label)
        return 0
    copy_view(code, ctx, slice_(out, dim, s, n), slice_(x, dim, 0, n - s), f"{label}.a")
    copy_view(code, ctx, slice_(out, dim, 0, s), slice_(x, dim, n - s, n), f"{label}.b")
    return 0


#: the longest dim a flip reverses (one copy per index)
FLIP_MAX = 64


@register_emitter("aten.flip.default")
def _flip(ins: TensorOp, ctx: Context, code: Code) -> int:
    """``x.flip(dims)`` (Inkling-2's short convolution reverses its window): one copy per index of each flipped
    dim, index i to n - 1 - i (an access pattern cannot step backwards), for dims of up to FLIP_MAX."""
    x, dims = ins.args[0], ins.args[1]
    dims = sorted({d % len(x.shape) for d in ([dims] if isinstance(dims, int) else dims)}, reverse=True)
    if any(x.shape[d] > FLIP_MAX for d in dims):
        raise CodegenError(f"flip of a dim longer than {FLIP_MAX} ({[x.shape[d] for d in dims]})")
    pairs = [(_out(ins), x)]
    for d in dims:
        n = x.shape[d]
        pairs = [(select(o, d, i), select(src, d, n - 1 - i)) for o, src in pairs for i in range(n)]
    for k, (o, src) in enumerate(pairs):
        copy_view(code, ctx, o, src, f"{ins.name_stem()}.{k}")
    return 0


@register_emitter("aten.repeat.default")
def _repeat(ins: TensorOp, ctx: Context, code: Code) -> int:
    x, reps = ins.args[0], list(ins.args[1])
    out = _out(ins)
    src = broadcast_to(x, (1,) * (len(reps) - len(x.shape)) + x.shape) if len(reps) > len(x.shape) else x
    shape, dst_strides, src_strides = [], [], []
    out_strides = contiguous_strides(out.shape)
    for r, n, so, ss in zip(reps, src.shape, out_strides, src.strides):
        shape += [r, n]
        dst_strides += [so * n, so]
        src_strides += [0, ss]
    copy_view(code, ctx, TRef(out.value, tuple(shape), tuple(dst_strides), out.offset),
              TRef(src.value, tuple(shape), tuple(src_strides), src.offset), ins.name_stem())
    return 0


@register_emitter("aten.fill.Scalar", "aten.zeros_like.default", "aten.ones_like.default",
                  "aten.full_like.default")
def _fill_like(ins: TensorOp, ctx: Context, code: Code) -> int:
    value = {"aten.zeros_like.default": 0, "aten.ones_like.default": 1}.get(ins.op)
    if value is None:
        value = ins.args[1]
    return fill(code, ctx, _out(ins), value, ins.name_stem())


__all__ = ["AP_DIMS", "COUNT_MAX", "copy_view", "fill"]

