"""Token embedding: gather the token's row of the table by runtime index (``fusegraph.embedding``), and the
vocab-parallel lookup of one tensor-parallel rank (``fusegraph.vocab_parallel_embedding``: DTensor's masked lookup of
a vocabulary-sharded table, its all-reduce lowered by ``ops/collective.py``)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fusegraph.codegen.api import (aten, CodegenError, Context, Emitted, inst_name, ir, Layout, Lowerer, nbytes,
                                    nl_dtype, register_lowering, weight_for_use)
from .embedding import embedding
from .vocab_parallel_embedding import vocab_parallel_embedding


@dataclass
class Embed(ir.Instruction):
    opcode: ClassVar[str] = "embed"
    ids: ir.Value  # INPUT [T] int32
    table: ir.Value  # WEIGHT [V, H]
    out: ir.Value
    scale: ir.Value | None = None  # INPUT [1] fp32 (Gemma multiplies embeddings by sqrt(hidden), rounded to the dtype)

    def arg_specs(self, layouts: dict[str, Layout], add: ir.AddSpec) -> None:
        add(self.table, "rows", None)  # gathered by row as the model stores it (a tied lm head has its own copy)

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


@dataclass
class VocabParallelEmbed(ir.Instruction):
    """Rows ``[start, start + rows)`` of the vocabulary live in this rank's ``table``: a token whose id is outside
    gets a zero row (DTensor's ``_MaskPartial``), so the all-reduce after it sums exactly one real row per token.
    The gather's row index is clamped into the local table, so no id (another rank's, negative, or past the
    vocabulary) ever moves the indirect DMA out of bounds; the clamp is also the range test."""

    opcode: ClassVar[str] = "embed_vocab_parallel"
    ids: ir.Value  # INPUT [T] int32
    table: ir.Value  # WEIGHT [rows, H]: this rank's rows of the vocabulary
    out: ir.Value
    start: int = 0  # the first vocabulary id of this rank

    @property
    def rows(self) -> int:
        return int(self.table.shape[0])

    def arg_specs(self, layouts: dict[str, Layout], add: ir.AddSpec) -> None:
        add(self.table, "rows", None)

    def emit(self, ctx: Context, i: int) -> Emitted:
        lay = ctx.layout(self.out)
        assert lay.features == self.table.shape[1]
        T, P, FT = ctx.tokens, lay.P, lay.FT
        # out + ones + zeros + predicate per partition, and five [P, T] index tiles (int32 / fp32)
        e = Emitted(sbuf=(FT * T + FT) * nbytes(self.out.dtype) + 4 * FT + FT * T + 5 * 4 * T)
        e.code("embed_vocab_parallel.j2", module=self.module or "embed_tokens", aten=aten(self), name=inst_name(self),
               T=T, ids=f"ids_{self.out.name}", ids_hbm=ctx.var(self.ids), out=ctx.var(self.out), P=P, FT=FT,
               dtype=nl_dtype(self.out.dtype), table=ctx.var(self.table), pattern=lay.row_pattern(),
               start=self.start, end=self.start + self.rows, rows=self.rows)
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        env[self.out.name] = vocab_parallel_lookup(env[self.table.name], env[self.ids.name].reshape(-1).long(),
                                                   self.start).reshape(self.out.shape)


def vocab_parallel_lookup(table: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    """DTensor's per-rank lookup: ``table[id - start]`` for ids in ``[start, start + rows)``, a zero row otherwise."""
    local = ids - start
    inside = (local >= 0) & (local < table.shape[0])
    out = table[local.clamp(0, table.shape[0] - 1)]
    return torch.where(inside.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype))


def _tokens(m: Any, graph: Any) -> int | None:
    shape = graph.nodes[m.inputs["indices"]]["shape"]
    if len(shape) == 2 and shape[1] != 1:
        raise CodegenError(f"a step over {shape[1]} positions is not a decode step (prefill runs eagerly)")
    return int(shape[0])


def round_to(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The embedding scale rounded to the table's dtype on the host, as the model multiplies by it (Gemma's
    ``hidden_size ** 0.5`` in bf16); the kernel then reads it as fp32 (``ArgSource.convert``)."""
    return scale.to(dtype)


@register_lowering(embedding, tokens=_tokens, instructions=[Embed])
def lower_embedding(L: Lowerer, m: Any) -> None:
    ids = L.input(m, "indices")
    table = weight_for_use(L, L.input(m, "weight"), "rows", f"{L.label(m)}_table")
    idv = L.step_input(ids, (L.T,), torch.int32, "token_ids")
    scale = None
    if m.inputs.get("scale"):  # rounded to the table's dtype, as the model does, then read as fp32
        scale = L.step_input(m.inputs["scale"], (1,), torch.float32, "embed_scale")
        L.arg_source(scale).convert = functools.partial(round_to, dtype=table.dtype)
    out = L.new_act(L.output(m), L.label(m))
    L.emit(Embed(ids=idv, table=table, out=out, scale=scale), m)


#: ids are compared in fp32 on chip (exact integers up to 2^24): a vocabulary range past it is refused
FP32_EXACT_IDS = 1 << 24


_COPIES = frozenset({"aten.lift_fresh_copy.default", "aten.lift_fresh.default", "aten.clone.default",
                     "aten.alias.default", "aten.detach.default"})


def _fill_value(graph: Any, node: str) -> float | None:
    """The value an ``index_put`` writes: a ``scalar_tensor`` op's constant, or a lifted one-element constant."""
    d = graph.nodes[node]
    while d.get("op") in _COPIES and d.get("args") and hasattr(d["args"][0], "node"):  # lift_fresh_copy(constant)
        d = graph.nodes[d["args"][0].node]
    if d.get("op") == "aten.scalar_tensor.default" and d.get("args"):
        return float(d["args"][0])
    if d.get("op") == "get_attr":
        value = d["target"]()
        return float(value) if isinstance(value, torch.Tensor) and value.numel() == 1 else None
    return None


def _check_vocab_parallel(m: Any, graph: Any, tokens: int | None) -> str | None:
    end = m.params.get("end")
    if not isinstance(end, int) or end > FP32_EXACT_IDS:
        return f"vocabulary range end {end} is past 2^24 (the kernel compares ids in fp32)"
    # the matcher does not compare the values of lifted constants: the masked ids and rows must be set to zero
    for n in m.nodes:
        d = graph.nodes[n]
        if d.get("op") == "aten.index_put.default":
            value = d["args"][2]
            fill = _fill_value(graph, value.node) if hasattr(value, "node") else None
            if fill != 0.0:
                return f"the masked lookup writes {fill} where DTensor writes 0 (node {n})"
    return None


@register_lowering(vocab_parallel_embedding, tokens=_tokens, check=_check_vocab_parallel,
                   instructions=[VocabParallelEmbed])
def lower_vocab_parallel_embedding(L: Lowerer, m: Any) -> None:
    ids = L.input(m, "indices")
    table = weight_for_use(L, L.input(m, "weight"), "rows", f"{L.label(m)}_table")
    idv = L.step_input(ids, (L.T,), torch.int32, "token_ids")
    out = L.new_act(L.output(m), L.label(m))
    L.emit(VocabParallelEmbed(ids=idv, table=table, out=out, start=int(m.params["start"])), m)
    # the value-identity ops canonicalization folded between the ids and the match (DTensor.from_local's view,
    # _mask_tensor's clone) are the kernel's too when nothing else reads them: it loads the ids tensor itself
    views = set(L.views(m, "indices"))
    if all(s in L.kernel_nodes or s in views for v in views for s in L.G.successors(v)):
        L.kernel_nodes |= views
