"""KV-cache write: the new row into the cache in HBM at the runtime position (``fusegraph.kv_cache_update``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .. import ir
from ..emitters import Context, Emitted, aten, code, inst_name
from ..errors import CodegenError
from ..lowering import Lowerer
from ..registry import register_lowering


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
        if "kv_index" in ctx.inputs:
            return []
        ctx.inputs["kv_index"] = "kv_index"
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
               L=L, cache=ctx.var(self.cache), index=ctx.inputs["kv_index"], value=ctx.var(self.value),
               half=ctx.split(H), split=lay.split, P=lay.P)
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        cache = env[self.cache.name]
        B, H, L, D = cache.shape
        val = env[self.value.name].reshape(B, H, D)
        idx = env[self.index.name].reshape(-1).long()
        for b in range(B):
            cache[b, :, idx[b], :] = val[b]

    def shard(self) -> ir.Shard:
        return ir.Shard(("heads",), "each core writes the rows of its kv heads")


@register_lowering("kv_cache_update", instructions=[KVWrite])
def lower_kv_update(L: Lowerer, m: Any) -> None:
    cache_node = L.input(m, "cache")
    cache = L.hbm(cache_node)
    value = L.act(L.input(m, "value"), L.views(m, "value"))
    index = L.step_input(L.input(m, "index"), (L.T,), torch.int32, "kv_position")
    L.emit(KVWrite(cache=cache, value=value, index=index), m)
    L.state[cache.name] = cache_node
    for o in m.outputs.values():  # the updated cache *is* the state tensor
        L.alias(o, cache_node)
