"""KV-cache write: the new row into the cache in HBM at the runtime position (``fusegraph.kv_cache_update``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fusegraph.codegen.api import (aten, code, CodegenError, Context, Emitted, expr, inst_name, ir, KV_INDEX,
                                    kv_positions, Lowerer, nl_dtype, register_lowering)
from .kv_cache_update import kv_cache_update
from .sliding_window_cache import sliding_window_roll


@dataclass
class KVWrite(ir.Instruction):
    """cache[t, head, index[t], :] = value[t, head, :] (in place in HBM)."""

    opcode: ClassVar[str] = "kv_write"
    cache: ir.Value  # STATE [B, Hkv, L, D]
    value: ir.Value  # ACT, head-structured
    index: ir.Value  # INPUT [T] int32 (cache position per sequence)
    output_fields: ClassVar[tuple[str, ...]] = ()

    def constrain(self, c: ir.Constraints) -> None:
        c.heads(self.value, self.cache.shape[-1])

    def setup(self, ctx: Context) -> list[str]:
        """The cache position of every token, loaded once per step (every layer writes at the same positions)."""
        if KV_INDEX in ctx.inputs:
            return []
        ctx.inputs[KV_INDEX] = KV_INDEX
        return [code("kv_index.j2", T=ctx.tokens, index=self.index.name)]

    def emit(self, ctx: Context, i: int) -> Emitted:
        B, H, L, D = self.cache.shape
        if B != ctx.tokens:
            raise CodegenError(f"KV cache batch {B} != {ctx.tokens} decode tokens (multi-token steps are not supported)")
        lay = ctx.layout(self.value)
        if lay.P * lay.split != D or lay.heads != H:
            raise CodegenError(f"KV write of {lay.heads} heads of {lay.P * lay.split} features into a cache of {H} x {D}")
        e = Emitted()
        # a head split over partition tiles (D > 128) is written from its tiles: P features per tile, tile stride P
        e.code("kv_write.j2", module=self.module or "", aten=aten(self), name=inst_name(self), T=ctx.tokens, D=D, H=H,
               L=L, cache=ctx.var(self.cache), index=ctx.inputs[KV_INDEX], value=ctx.var(self.value),
               half=ctx.split(H), split=lay.split, P=lay.P)
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        cache = env[self.cache.name]
        B, H, L, D = cache.shape
        val = env[self.value.name].reshape(B, H, D)
        idx = env[self.index.name].reshape(-1).long()
        for b in range(B):
            cache[b, :, idx[b], :] = val[b]


@register_lowering(kv_cache_update, instructions=[KVWrite])
def lower_kv_update(L: Lowerer, m: Any) -> None:
    cache_node = L.input(m, "cache")
    cache = L.hbm(cache_node)
    if len(cache.shape) != 4:  # another state written by index_copy_ (an SSM or convolution slot): generic lowering
        raise CodegenError(f"a KV write into a {len(cache.shape)}-d state (a KV cache is [B, H, L, D])")
    value = L.act(L.input(m, "value"), L.views(m, "value"))
    index = L.step_input(L.input(m, "index"), (L.T,), torch.int32, "kv_position")
    L.emit(KVWrite(cache=cache, value=value, index=index), m)
    kv_positions(L)[cache.name] = index
    L.state[cache.name] = cache_node
    for o in m.outputs.values():  # the updated cache *is* the state tensor
        L.alias(o, cache_node)


# ---- a full sliding window (HF StaticSlidingWindowLayer once full) -------------------------------------------
ROLL_BLOCK = 16  # position tiles of 128 rows moved per DMA pair


def roll_pieces(W: int) -> list[tuple[int, int, int]]:
    """The ``W - 1`` rows a roll moves, as ``(first row, partitions, tiles)`` pieces in increasing row order (a
    piece holds rows ``first + p + partitions * j``): blocks of ``128 * ROLL_BLOCK`` rows, then what is left."""
    rows, r0, out = W - 1, 0, []
    chunk = 128 * max(1, min(ROLL_BLOCK, rows // 128))
    while rows - r0 >= chunk and chunk >= 128:
        out.append((r0, 128, chunk // 128))
        r0 += chunk
    if rows - r0 >= 128:
        n = (rows - r0) // 128
        out.append((r0, 128, n))
        r0 += 128 * n
    if rows - r0:
        out.append((r0, rows - r0, 1))
    return out


@dataclass
class KVRoll(ir.Instruction):
    """A full sliding window's step, in place in HBM: ``cache[:, :, :-1] = cache[:, :, 1:]`` (rows through SBUF,
    in increasing row order, so every row is read before it is overwritten), then ``cache[t, head, W - 1, :] =
    value[t, head, :]`` -- exactly HF's ``roll(-1)`` + write at ``[-1]`` + ``copy_``, so the cache stays in the
    order transformers (and its masks, and any later eager step) expect."""

    opcode: ClassVar[str] = "kv_roll"
    cache: ir.Value  # STATE [B, Hkv, W, D]
    value: ir.Value  # ACT, head-structured
    output_fields: ClassVar[tuple[str, ...]] = ()

    def constrain(self, c: ir.Constraints) -> None:
        c.heads(self.value, self.cache.shape[-1])

    def emit(self, ctx: Context, i: int) -> Emitted:
        B, H, W, D = self.cache.shape
        if B != ctx.tokens:
            raise CodegenError(f"KV cache batch {B} != {ctx.tokens} decode tokens (multi-token steps are not supported)")
        lay = ctx.layout(self.value)
        if lay.P * lay.split != D or lay.heads != H:
            raise CodegenError(f"KV roll of {lay.heads} heads of {lay.P * lay.split} features into a cache of {H} x {D}")
        half = ctx.split(H)
        if ctx.lnc == 2 and not half:
            # both cores would move the same rows at once (one core's store racing the other's load)
            raise CodegenError(f"a sliding-window roll of {H} kv heads does not split between the LNC=2 cores")
        pieces = roll_pieces(W)
        kvb = torch.empty((), dtype=self.cache.dtype).element_size()
        e = Emitted(sbuf=2 * max(n for _, _, n in pieces) * D * kvb)
        e.code("kv_roll.j2", module=self.module or "", aten=aten(self), name=inst_name(self), T=ctx.tokens, D=D, H=H,
               W=W, cache=ctx.var(self.cache), value=ctx.var(self.value), buf=f"{ctx.var(self.cache)}_roll",
               dtype=nl_dtype(self.cache.dtype), pieces=pieces, half=half, split=lay.split, P=lay.P,
               h_range=expr("exprs.j2", "core_range", per_core=half, total=H))
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        cache = env[self.cache.name]
        B, H, W, D = cache.shape
        val = env[self.value.name].reshape(B, H, D)
        cache.copy_(cache.roll(-1, dims=2))
        cache[:, :, W - 1, :] = val


def _roll_check(m: Any, graph: Any, tokens: int | None) -> str | None:
    """The written slot must be the window's last one (HF writes at ``torch.tensor([-1])``)."""
    node = m.inputs.get("index")
    d = graph.nodes[node] if node in graph.nodes else {}
    while d.get("op") in ("aten.lift_fresh_copy.default", "aten.lift_fresh.default", "aten.clone.default"):
        ref = d["args"][0]
        d = graph.nodes[ref.node]
    value = getattr(d.get("target"), "args", (None,))[0] if d.get("op") == "get_attr" else None
    W = (graph.nodes[m.inputs["cache"]].get("shape") or (0, 0, 0))[2]
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or int(value.reshape(-1)[0]) not in (-1, W - 1):
        return "the rolled window's new row must go to its last slot (a constant index -1)"
    return None


@register_lowering(sliding_window_roll, check=_roll_check, instructions=[KVRoll])
def lower_kv_roll(L: Lowerer, m: Any) -> None:
    cache_node = L.input(m, "cache")
    cache = L.hbm(cache_node)
    value = L.act(L.input(m, "value"), L.views(m, "value"))
    L.emit(KVRoll(cache=cache, value=value), m)
    L.state[cache.name] = cache_node
    for o in m.outputs.values():  # the copied-back cache *is* the state tensor
        L.alias(o, cache_node)
