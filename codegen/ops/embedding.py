"""Token embedding: gather the token's row of the table by runtime index (``fusegraph.embedding``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .. import ir
from ..emitters import Context, Emitted, aten, inst_name, nbytes
from ..errors import CodegenError
from ..lowering import Lowerer
from ..registry import register_lowering
from ..render import nl_dtype


@dataclass
class Embed(ir.Instruction):
    opcode: ClassVar[str] = "embed"
    ids: ir.Value  # INPUT [T] int32
    table: ir.Value  # WEIGHT [V, H]
    out: ir.Value
    scale: ir.Value | None = None  # INPUT [1] fp32 (Gemma multiplies embeddings by sqrt(hidden), rounded to the dtype)

    def emit(self, ctx: Context, i: int) -> Emitted:
        lay = ctx.layout(self.out)
        H = self.table.shape[1]
        pattern = lay.row_pattern()
        e = Emitted(sbuf=lay.FT * ctx.tokens * nbytes(self.out.dtype) + 4 * ctx.tokens)
        assert lay.features == H
        e.code("embed.j2", module=self.module or "embed_tokens", aten=aten(self), name=inst_name(self), T=ctx.tokens,
               ids=f"ids_{self.out.name}", ids_hbm=ctx.var(self.ids), out=ctx.var(self.out), P=lay.P, FT=lay.FT,
               dtype=nl_dtype(self.out.dtype), table=ctx.var(self.table), pattern=pattern,
               scale=ctx.var(self.scale) if self.scale is not None else None)
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        out = env[self.table.name][env[self.ids.name].reshape(-1).long()].reshape(self.out.shape)
        if self.scale is not None:
            out = out * env[self.scale.name].reshape(()).to(out.dtype)
        env[self.out.name] = out

    def shard(self) -> ir.Shard:
        return ir.Shard(("replicated",), "the gathered rows are small; a vocab-parallel table would need an all-reduce")


def _tokens(m: Any, graph: Any) -> int | None:
    shape = graph.nodes[m.inputs["indices"]]["shape"]
    if len(shape) == 2 and shape[1] != 1:
        raise CodegenError(f"a step over {shape[1]} positions is not a decode step (prefill runs eagerly)")
    return int(shape[0])


@register_lowering("embedding", tokens=_tokens, instructions=[Embed])
def lower_embedding(L: Lowerer, m: Any) -> None:
    ids = L.input(m, "indices")
    table = L.hbm(L.input(m, "weight"))
    idv = L.step_input(ids, (L.T,), torch.int32, "token_ids")
    scale = None
    if m.inputs.get("scale"):  # rounded to the table's dtype, as the model does, then read as fp32
        scale = L.step_input(m.inputs["scale"], (1,), torch.float32, "embed_scale")
        L.arg_source(scale).convert = f"round_to:{table.dtype}".replace("torch.", "")
    out = L.new_act(L.output(m), L.label(m))
    L.emit(Embed(ids=idv, table=table, out=out, scale=scale), m)
