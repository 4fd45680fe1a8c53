"""Scans on the tensor path: ``cumsum`` and ``cumprod`` along any dim.

How: the scanned dim goes on the free axis of every tile (the Vector engine's ``tensor_tensor_scan`` runs along
the free axis: ``r[i] = op1(op0(data0[i], r[i-1]), data1[i])``), one other dim on partitions, the rest loops. A
cumsum is ``r[i] = (1 * r[i-1]) + x[i]``, a cumprod ``r[i] = (x[i] * r[i-1]) * 1`` (no ``+ 0``, which would
turn a ``-0.0`` product into ``+0.0``). A dim longer than one tile is scanned chunk by chunk, each chunk starting
from the previous chunk's last value. The engine accumulates in fp32 and the result is rounded to the output's
type: eager's reduced-precision scans accumulate in fp32 too; its fp32 scan accumulates in double, so an fp32
cumsum here may differ from eager's in the last bits. Integer scans (``mask.cumsum(-1)``, positions) are exact
below 2^24.
"""
from __future__ import annotations

import torch

from ..emitters import Context
from .instruction import TensorOp, register_emitter, tile_alloc, tile_bytes
from .tiles import Code, Tile, plan, walk
from .view import TRef, contiguous_strides


@register_emitter("aten.cumsum.default", "aten.cumprod.default")
def _scan(ins: TensorOp, ctx: Context, code: Code) -> int:
    x: TRef = ins.args[0]
    out = ins.outs[0]
    if not x.shape:  # a 0-d value: the scan is the value
        x = TRef(x.value, (1,), (1,), x.offset)
    dim = (ins.args[1] if len(ins.args) > 1 else ins.kwargs["dim"]) % len(x.shape)
    out = TRef(out.value, x.shape, contiguous_strides(x.shape), out.offset)
    prod = ins.op == "aten.cumprod.default"
    name = ins.name_stem()
    p = plan(x.shape, inner=(dim,), loops_outer=True)
    carry = [""]
    scratch = [0]

    def before(tile: Tile) -> None:
        if p.chunk:
            carry[0] = tile_alloc(code, (tile.p, 1), torch.float32, name, "carry")
            code(f"nisa.memset(dst={carry[0]}, value={1.0 if prod else 0.0!r}, name=\"{name}.carry0\")")

    def body(tile: Tile) -> None:
        shape = tile.shape()
        t = tile_alloc(code, shape, x.dtype, name, "x")
        code(f"nisa.dma_copy(dst={t}, src={tile.ap(ctx.var(x.value), x)}, name=\"{name}.load\")")
        ones = tile_alloc(code, shape, torch.float32, name, "ones")
        code(f"nisa.memset(dst={ones}, value=1.0, name=\"{name}.ones\")")
        r = tile_alloc(code, shape, torch.float32, name, "scan")
        initial = carry[0] or repr(1.0 if prod else 0.0)
        if prod:
            code(f"nisa.tensor_tensor_scan(dst={r}, data0={t}, data1={ones}, initial={initial}, op0=nl.multiply, "
                 f"op1=nl.multiply, name=\"{name}\")")
        else:
            code(f"nisa.tensor_tensor_scan(dst={r}, data0={ones}, data1={t}, initial={initial}, op0=nl.multiply, "
                 f"op1=nl.add, name=\"{name}\")")
        if carry[0]:
            last = shape[-1] - 1
            code(f"nisa.tensor_copy(dst={carry[0]}, src={r}[:, {last}:{last + 1}], name=\"{name}.carry\")")
        o = tile_alloc(code, shape, out.dtype, name, "o")
        code(f"nisa.tensor_copy(dst={o}, src={r}, name=\"{name}.round\")")
        code(f"nisa.dma_copy(dst={tile.ap(ctx.var(out.value), out)}, src={o}, name=\"{name}.store\")")
        scratch[0] = max(scratch[0], tile_bytes(shape, x.dtype) + 2 * tile_bytes(shape, torch.float32)
                         + tile_bytes(shape, out.dtype) + 8)
    walk(code, p, body, before=before)
    return scratch[0]


__all__: list[str] = []
