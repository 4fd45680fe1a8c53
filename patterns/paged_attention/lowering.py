"""Paged KV caches (vLLM's layout, :mod:`.pattern`): the new row written at its slot, decode
attention over the blocks each sequence's block table names.

* :class:`PagedKVWrite` (``kv_paged_write.j2``): one DMA per sequence into the flat ``[NB * BS, KV, D]`` pool at
  the runtime slot (``scalar_offset`` from the slot tile, ``indirect_dim=1``: a slot counts ``KV * D`` elements).
* :class:`PagedAttention` (``attention_stream.j2`` with ``paged``): the streamed (flash-decoding) attention whose
  K/V block loads are gathers: every run of positions that lies in one cache block is one DMA whose source block
  comes from the block table (loaded once per step into SBUF; ``scalar_offset`` on the pool's block dim). The
  streamed blocks (``StreamSwitches.paged_block_max`` positions at most) are a static loop; every block after the first
  runs only when the sequence uses it: ``for _ in nl.dynamic_range(start=jb * Lb - 1, stop=<register>)`` runs
  once or never, the register holding the sequence's *extent*, the last position its mask does not mask out
  (:func:`mask_extent`, computed on the host from the mask the step already passes, like the mask itself).
  Positions after it contribute exact zeros to the softmax, so skipping them changes only the bytes and the
  work. A skipped block's table entries are not read by the kernel (the first block's always are, and the eager
  reference that verifies the kernel gathers every entry, so padding entries must still name a valid block).
  A table of a length that is not a multiple of the streamed block starts with one shorter block
  (:func:`fusegraph.patterns.attention.lowering.block_starts`).

Limits: block sizes that divide 128 or are multiples of it; tables of at least 128 positions; heads of at most
128 features; under LNC=2 the kv heads must split between the two cores.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fusegraph.codegen.api import (ArgSource, aten, code, CodegenError, Context, Emitted, inst_name, ir, Lowerer,
                                    nbytes, PMAX, register_lowering)
from fusegraph.patterns.attention.lowering import Attention, block_starts, stream_plan, switches
from .pattern import paged_attention, paged_kv_write

V = ir.ValueKind

# the largest streamed block of a paged attention is ``StreamSwitches.paged_block_max`` (option attn_paged_block_max,
# 512 positions): blocks after a sequence's extent are skipped whole, so a smaller block reads fewer positions past
# it (at most that minus 1); the gathers are one per cache block (or 128-position tile) whatever the streamed block is
EXTENT = "kv_extent"  # the [1, T] SBUF tile of each sequence's last unmasked position (loaded once per step)


def mask_extent(mask: torch.Tensor) -> torch.Tensor:
    """Per row of an attention mask ``[..., L]`` (additive, or boolean with True = attend), the last position
    it does not mask out; ``L - 1`` for a row masked everywhere (every block is then read, as without a bound).
    Why: a paged attention reads only the blocks up to it. A position counts as masked only when its additive
    value is ``-inf`` or the dtype's most negative finite value (HF's and vLLM's masks; exp of it is an exact 0);
    any other value keeps the position, so a mask of another form at worst reads more blocks."""
    m = mask.reshape(-1, mask.shape[-1])
    L = m.shape[-1]
    if m.dtype != torch.bool and not m.dtype.is_floating_point:  # not a mask form this knows: read every block
        return torch.full((m.shape[0],), L - 1, dtype=torch.int32)
    live = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min
    pos = torch.arange(L, device=m.device).expand_as(m)
    last = torch.where(live, pos, torch.full_like(pos, -1)).amax(-1)
    return torch.where(last >= 0, last, torch.full_like(last, L - 1)).to(torch.int32)


def _tile(ctx: Context, value: ir.Value, n: int, stem: str) -> tuple[list[str], str]:
    """An int32 step input loaded once per step into a ``[1, n]`` SBUF tile shared by every layer (setup code and
    the tile's name)."""
    key = f"{stem}:{value.name}"
    if key in ctx.inputs:
        return [], ctx.inputs[key]
    var = f"{stem}_{len([k for k in ctx.inputs if k.startswith(stem + ':')])}"
    ctx.inputs[key] = var
    return [code("kv_table.j2", var=var, n=n, index=value.name)], var


@dataclass
class PagedKVWrite(ir.Instruction):
    """``cache.view(NB * BS, KV, D)[slots[t]] = value[t]`` (in place in HBM)."""

    opcode: ClassVar[str] = "paged_kv_write"
    cache: ir.Value  # STATE [NB, BS, KV, D]
    value: ir.Value  # ACT, head-structured [T, KV * D]
    slots: ir.Value  # INPUT [T] int32
    output_fields: ClassVar[tuple[str, ...]] = ()

    def constrain(self, c: ir.Constraints) -> None:
        c.heads(self.value, self.cache.shape[-1])

    def setup(self, ctx: Context) -> list[str]:
        return _tile(ctx, self.slots, ctx.tokens, "kv_slots")[0]

    def emit(self, ctx: Context, i: int) -> Emitted:
        NB, BS, H, D = self.cache.shape
        lay = ctx.layout(self.value)
        if lay.split != 1 or lay.P != D or lay.heads != H:
            raise CodegenError(f"paged KV write of {lay.heads} heads of {lay.P * lay.split} features into a pool of "
                               f"{H} x {D} (heads over {PMAX} features are not supported)")
        half = ctx.split(H)
        if ctx.lnc == 2 and not half:
            raise CodegenError(f"a paged KV write of {H} kv heads does not split between the LNC=2 cores")
        e = Emitted()
        e.code("kv_paged_write.j2", module=self.module or "", aten=aten(self), name=inst_name(self), T=ctx.tokens,
               NB=NB, BS=BS, H=H, D=D, cache=ctx.var(self.cache), value=ctx.var(self.value),
               slots=_tile(ctx, self.slots, ctx.tokens, "kv_slots")[1], half=half)
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        cache = env[self.cache.name]
        NB, BS, H, D = cache.shape
        rows = env[self.value.name].reshape(-1, H, D)
        cache.view(NB * BS, H, D)[env[self.slots.name].reshape(-1).long()] = rows


def block_segments(Lb: int, nblocks: int, BS: int) -> list[list[tuple[int, int, int, int, int]]]:
    """Per streamed block of ``Lb`` positions, its gathers ``(tile, first partition, rows, table entry, first row
    in the cache block)``: the runs of each 128-position tile that lie in one cache block of ``BS`` positions."""
    return segments_at([jb * Lb for jb in range(nblocks)], [Lb] * nblocks, BS)


def segments_at(starts: list[int], sizes: list[int], BS: int) -> list[list[tuple[int, int, int, int, int]]]:
    """:func:`block_segments` for blocks at any first position (:func:`~.attention.block_starts`: a table whose
    positions are not a multiple of the streamed block)."""
    out = []
    for start, size in zip(starts, sizes):
        segs = []
        for u in range(size // PMAX):
            p = 0
            while p < PMAX:
                pos = start + u * PMAX + p
                n = min(PMAX - p, BS - pos % BS)
                segs.append((u, p, n, pos // BS, pos % BS))
                p += n
        out.append(segs)
    return out


@dataclass
class PagedAttention(Attention):
    """Decode attention over the blocks of a paged pool: ``k_cache``/``v_cache`` are ``[NB, BS, KV, D]``, ``table``
    the ``[T, MB]`` block table; positions ``j * BS + r`` of sequence ``t`` live at block ``table[t, j]``, row r."""

    opcode: ClassVar[str] = "paged_attention"
    table: ir.Value | None = None  # INPUT [T, MB] int32
    #: INPUT [T] int32: each sequence's last unmasked position (:func:`mask_extent`); blocks after it are skipped.
    #: None: every block of the table is read
    extent: ir.Value | None = None

    def kv_dims(self) -> tuple[int, int, int]:
        NB, BS, Hkv, D = self.k_cache.shape
        return Hkv, self.table.shape[1] * BS, D

    def _plan(self, ctx: Context) -> tuple[int, int] | None:
        Hkv, L, D = self.kv_dims()
        lay = ctx.layout(self.q)
        exact = self.q.dtype != torch.float32 and self.rounding == "eager"
        return stream_plan(L, D, self.groups, lay.split, nbytes(self.k_cache.dtype), nbytes(self.q.dtype),
                           nbytes(self.mask.dtype), nbytes(self.q.dtype) if exact else 4,
                           block=self.block or min(L, switches().block_max, switches().paged_block_max))

    def constants(self, ctx: Context) -> dict[str, ir.Constant]:
        """None: paged gathers keep one row group (no fold matrix, see ``attention.row_groups``)."""
        return {}

    def setup(self, ctx: Context) -> list[str]:
        out = _tile(ctx, self.table, ctx.tokens * self.table.shape[1], "kv_table")[0]
        return out + (self._extent_tile(ctx)[0] if self.extent is not None else [])

    def _extent_tile(self, ctx: Context) -> tuple[list[str], str]:
        """The ``[1, T]`` SBUF tile of this attention's extents, loaded once per step and shared by every layer
        that reads the same mask (``kv_extent``; another mask's extents get ``kv_extent_1``, ...)."""
        key = f"{EXTENT}:{self.extent.name}"
        if key in ctx.inputs:
            return [], ctx.inputs[key]
        n = len([k for k in ctx.inputs if k.startswith(EXTENT + ":")])
        var = EXTENT if n == 0 else f"{EXTENT}_{n}"
        ctx.inputs[key] = var
        return [code("kv_table.j2", var=var, n=ctx.tokens, index=self.extent.name)], var

    def emit(self, ctx: Context, i: int) -> Emitted:
        NB, BS, Hkv, D = self.k_cache.shape
        Hkv, L, D = self.kv_dims()
        lay = ctx.layout(self.q)
        if lay.split != 1 or lay.P != D:
            raise CodegenError(f"paged attention over heads of {D} features ({PMAX} at most)")
        if self.groups > PMAX:
            raise CodegenError(f"attention group {self.groups} exceeds {PMAX} partitions")
        if BS % PMAX and PMAX % BS:
            raise CodegenError(f"paged attention needs a block size dividing {PMAX} or a multiple of it, not {BS}")
        if ctx.lnc == 2 and not ctx.split(Hkv):
            raise CodegenError(f"paged attention over {Hkv} kv heads does not split between the LNC=2 cores")
        Lb, scratch = self._plan(ctx)
        MB = self.table.shape[1]
        extent = self._extent_tile(ctx)[1] if self.extent is not None else ""
        return self._emit_streamed(ctx, (Lb, scratch), paged=True, segments=segments_at(*block_starts(L, Lb), BS),
                                   table=_tile(ctx, self.table, ctx.tokens * MB, "kv_table")[1], MB=MB,
                                   pos_split=False, dynamic=bool(extent), index=extent, more=False)

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        k, v = env[self.k_cache.name], env[self.v_cache.name]
        NB, BS, Hkv, D = k.shape
        table = env[self.table.name].long()
        B, MB = table.shape
        view = dict(env)
        view[self.k_cache.name] = k[table].reshape(B, MB * BS, Hkv, D).transpose(1, 2)
        view[self.v_cache.name] = v[table].reshape(B, MB * BS, Hkv, D).transpose(1, 2)
        Attention.reference(self, view)
        env[self.out.name] = view[self.out.name]


@register_lowering(paged_kv_write, instructions=[PagedKVWrite])
def lower_paged_write(L: Lowerer, m: Any) -> None:
    cache_node = L.input(m, "cache")
    cache = L.hbm(cache_node)
    if cache.kind != V.STATE:
        raise CodegenError("a paged KV write must write a state tensor (the block pool)")
    value = L.act(L.input(m, "value"), L.views(m, "value"))
    slots = L.step_input(L.input(m, "slots"), (L.T,), torch.int32, "kv_slots")
    L.emit(PagedKVWrite(cache=cache, value=value, slots=slots), m)
    L.state[cache.name] = cache_node
    for o in m.outputs.values():  # the updated pool *is* the state tensor
        L.alias(o, cache_node)


@register_lowering(paged_attention, instructions=[PagedAttention])
def lower_paged_attention(L: Lowerer, m: Any) -> None:
    q = L.act(L.input(m, "q"), L.views(m, "q"))
    k, v = L.hbm(L.input(m, "k_cache")), L.hbm(L.input(m, "v_cache"))
    if k.kind != V.STATE or v.kind != V.STATE:
        raise CodegenError("paged attention must read the block pools this step writes")
    NB, BS, Hkv, D = k.shape
    table_node = L.input(m, "block_table")
    MB = int(L.node(table_node)["shape"][1])
    table = L.step_input(table_node, (L.T, MB), torch.int32, "block_table")
    mask_node = L.input(m, "mask")
    mask = L.step_input(mask_node, (L.T, MB * BS), None, label="attn_mask")
    groups = int(m.params.get("num_key_value_groups") or (q.features // D) // Hkv)
    scale = float(m.params.get("scale", D ** -0.5))
    out = L.new_act(L.output(m), L.label(m, "attn"))
    L.emit(PagedAttention(q=q, k_cache=k, v_cache=v, mask=mask, out=out, scale=scale, groups=groups,
                          rounding="eager", table=table, extent=_extent_input(L, mask_node)), m)


def _extent_input(L: Lowerer, mask_node: str) -> ir.Value:
    """The per-step ``[T]`` int32 argument of each sequence's last unmasked position, computed on the host from
    the mask node's value (``ArgSource.convert``); one per mask, shared by every layer that reads it."""
    key = f"{mask_node}#kv_extent"
    if key in L.values:
        return L.values[key]
    v = ir.Value(L.unique("kv_extent_in"), V.INPUT, (L.T,), torch.int32, node=mask_node)
    L.values[key] = v
    L.order.append(v)
    L.args[v.name] = ArgSource(mask_node, (L.T,), torch.int32, V.INPUT, convert=mask_extent)
    return v
