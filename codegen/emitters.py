"""The toolkit every instruction's ``emit`` uses: the emission context, the result type, shared code pieces.

``Instruction.emit(ctx, i)`` (see :mod:`.ir`) returns :class:`Emitted`: code pieces (strings and
:class:`~.stream.ChunkUse` markers) plus the SBUF scratch it needs per partition and the PSUM banks it holds at
once, which the budget check adds up. Code comes from Jinja2 templates (:meth:`Emitted.code`); helpers here
are the pieces several ops share (chunked weight-stationary matmuls, streamed per-feature parameters).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from fusegraph.matching.activations import activation

from . import ir
from .errors import CodegenError
from .layout import PMAX, Layout
from .render import expr, nl_dtype, render
from .stream import Chunk, ChunkUse

IND = 4  # kernel body indentation
PSUM_FREE_FP32 = 512  # one 2 KiB PSUM bank of fp32 per partition
MOVING_MAX = 512


def code(template: str, **ctx: Any) -> str:
    """A template rendered at the kernel body's indentation."""
    return render(template, indent=IND, **ctx)


@dataclass
class Emitted:
    pieces: list = field(default_factory=list)
    sbuf: int = 0  # scratch bytes per partition
    psum_banks: int = 0
    #: code placed at the start of the instruction's layer, before the layer's other instructions (a cache read that
    #: needs no value of this layer: the attention's first block, see ``attention.PREFETCH``); its tiles take
    #: ``early_sbuf`` bytes per partition from there until the instruction
    early: list = field(default_factory=list)
    early_sbuf: int = 0

    def code(self, template: str, **ctx: Any) -> None:
        self.pieces.append(code(template, **ctx))


@dataclass
class Context:
    tokens: int
    layouts: dict[str, Layout]
    target: str
    chunk_bytes: int
    consts: dict[str, str]  # constant role -> SBUF variable
    inputs: dict[str, str]  # per-step input role -> SBUF variable (ids, kv index, cos/sin, mask)
    specs: dict = field(default_factory=dict)  # kernel argument name -> bind.ArgSpec (kernel shapes/dtypes)
    lnc: int = 1  # 2: the two cores of a logical core split the work (program id `pid`)
    store_only: set = field(default_factory=set)  # values read only by Store instructions (no exchange needed)
    stores: dict = field(default_factory=dict)  # value read by exactly one Store -> that Store's HBM output
    stored: set = field(default_factory=set)  # values their producer wrote to HBM itself (their Store: nothing)
    hbm_consts: set = field(default_factory=set)  # constant arguments that stay in HBM (ir.Constant.on_chip=False)

    def split(self, n: int) -> int:
        """Items per core when ``n`` items are split between the LNC=2 cores (0: not split)."""
        return n // 2 if self.lnc == 2 and n >= 2 and n % 2 == 0 else 0

    def shape(self, v: ir.Value) -> tuple[int, ...]:
        return tuple(self.specs[v.name].shape) if v.name in self.specs else tuple(v.shape)

    def kdtype(self, v: ir.Value) -> torch.dtype:
        return self.specs[v.name].dtype if v.name in self.specs else v.dtype

    def var(self, v: ir.Value) -> str:
        return f"x_{v.name}" if v.kind in (ir.ValueKind.ACT, ir.ValueKind.ROUTING) else v.name

    def layout(self, v: ir.Value) -> Layout:
        return self.layouts[v.name]


def inst_name(ins: ir.Instruction) -> str:
    """The instruction's unique name in its kernel (``name=`` of its NKI calls), see :func:`.ir.assign_names`."""
    return ins.name or ir.base_name(ins)


assign_names = ir.assign_names


def aten(ins: ir.Instruction) -> str:
    """What the instruction's comment says it implements: its pattern (or opcode)."""
    return ins.pattern or ins.opcode


def nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def act_op(act: str) -> str:
    """``nl.<fn>`` of a slot activation (the one activation table)."""
    try:
        return f"nl.{activation(act).nki}"
    except KeyError:
        raise CodegenError(f"activation {act!r} has no NKI template") from None


def tiles(n: int, size: int) -> list[tuple[int, int, bool]]:
    """``[(start, size, first)]`` tiles of ``n`` items."""
    return [(s, min(size, n - s), s == 0) for s in range(0, n, size)]


def emit(ins: ir.Instruction, ctx: Context, index: int) -> Emitted:
    return ins.emit(ctx, index)


# ---- shared pieces ------------------------------------------------------------------------------------------
def norm_param_chunk(e: Emitted, w: ir.Value | None, ctx: Context, name: str, i: int) -> str | None:
    """Stream a norm's per-feature parameter: per-head norms get a per-partition fp32 scalar ([D, 1]; a head split
    over S partition tiles: [P, S], one column per tile), hidden norms a [P, FT] tile."""
    if w is None:
        return None
    shape, dt = ctx.shape(w), ctx.kdtype(w)
    chunk = Chunk(shape=shape, dtype=nl_dtype(dt), src=ctx.var(w), name=name, earliest=0,
                  nbytes_per_partition=shape[-1] * nbytes(dt))
    e.pieces.append(ChunkUse(chunk, i))
    return chunk.token


def linear_chunks(n_total: int, per_nt_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    per = max(1, chunk_bytes // max(1, per_nt_bytes))
    return [(n0, min(n_total, n0 + per)) for n0 in range(0, n_total, per)]


def linear_pieces(e: Emitted, *, name: str, x: str, tok: str, out: str, w_hbm: str, w_src: Callable[[int, int], str],
                  Pk: int, KT: int, Pn: int, NT: int, T: int, wdtype: torch.dtype, chunk_bytes: int, earliest: int,
                  index: int, bias: str | None = None, out_tok: str = ":", base: str = "",
                  stream: str = "static") -> None:
    """Chunked weight-stationary matmuls: out[:, nt, tok] = sum_kt W[:, nt, kt, :]^T x[:, kt, tok].

    ``base``: an expression added to every output chunk index (this core's first chunk under LNC=2)."""
    if Pn > PMAX or Pk > PMAX:
        raise CodegenError(f"linear tile {Pk}x{Pn} exceeds {PMAX} partitions")
    if T > PSUM_FREE_FP32:
        raise CodegenError(f"{T} tokens exceed one PSUM bank per output chunk")
    per_nt = KT * Pn * nbytes(wdtype)
    # the weight chunk's size does not depend on the token count: its output chunks share PSUM tiles of at most
    # one bank of fp32 each (one eviction per tile; one tile per chunk unless T tokens x chunks exceed a bank)
    group = max(1, PSUM_FREE_FP32 // max(1, T))
    for n0, n1 in linear_chunks(NT, per_nt, chunk_bytes):
        chunk = Chunk(shape=(Pk, n1 - n0, KT, Pn), dtype=nl_dtype(wdtype), src=w_src(n0, n1), name=f"{name}.w{n0}",
                      earliest=earliest, nbytes_per_partition=(n1 - n0) * per_nt, stream=stream)
        e.pieces.append(ChunkUse(chunk, index))
        e.code("linear_chunk.j2", n=n1 - n0, n0=f"{base}{n0}", ps=f"{out}_ps", Pn=Pn, T=T, KT=KT, w=chunk.token, x=x,
               tok=tok, out=out, name=name, bias=bias, out_tok=out_tok,
               groups=[(g, min(group, n1 - n0 - g)) for g in range(0, n1 - n0, group)])
    e.psum_banks = max(e.psum_banks, 1)


__all__ = ["Context", "Emitted", "IND", "MOVING_MAX", "PSUM_FREE_FP32", "act_op", "aten", "code", "emit", "expr",
           "inst_name", "linear_chunks", "linear_pieces", "nbytes", "nl_dtype", "norm_param_chunk", "tiles"]
