"""Test cases of the embedding op against its pattern functions: :class:`~.lowering.Embed` (a plain lookup, and
Gemma's scaled one: the scale rounded to the table's dtype on the host by :func:`~.lowering.round_to`, as the
lowering's argument conversion does) and :class:`~.lowering.VocabParallelEmbed`, one tensor-parallel rank's masked
lookup (runnable on one rank: the all-reduce that sums the ranks' rows is the collectives op). Ids at both ends of
the table, of another rank, negative and past the vocabulary."""
from __future__ import annotations

import math

import torch

from fusegraph.codegen.api import EXACT, Builder, CaseProgram, OpCase, register_cases

from .embedding import embedding
from .lowering import Embed, VocabParallelEmbed, round_to
from .vocab_parallel_embedding import vocab_parallel_embedding

F32, BF16 = torch.float32, torch.bfloat16


def _table(V: int, H: int, dtype: torch.dtype) -> torch.Tensor:
    # shifted: no zero entries, so a row that should be a zero row (another rank's) cannot be one by chance
    return (3 + torch.randn(V, H, generator=torch.Generator().manual_seed(V + H))).to(dtype)


def _embed(ids: list[int], V: int, H: int, dtype: torch.dtype, scaled: bool = False) -> CaseProgram:
    table, idt = _table(V, H, dtype), torch.tensor(ids)
    b = Builder(len(ids))
    b.tensors["ids"] = idt.to(torch.int32)  # the step's token ids (the kernel's int32 argument)
    scale = torch.tensor(math.sqrt(H))  # Gemma's sqrt(hidden), an fp32 scalar in the model
    sv = b.hbm("scale", round_to(scale.reshape(1), table.dtype).float(), "input") if scaled else None
    y = b.new("y", H, dtype)
    b.ins.append(Embed(ids=b.ids, table=b.hbm("table", table), out=y, scale=sv, layer=None))
    b.store(y)
    inputs = {"weight": table, "indices": idt[:, None], **({"scale": scale} if scaled else {})}
    return CaseProgram(b, inputs, lambda t: {"y": embedding(t["weight"], t["indices"], t.get("scale"))[:, 0]})


def _vocab_parallel(ids: list[int], V: int, H: int, rank: int, ranks: int, dtype: torch.dtype) -> CaseProgram:
    rows = V // ranks
    start, end = rank * rows, (rank + 1) * rows
    full, idt = _table(V, H, dtype), torch.tensor(ids)
    local = full[start:end].clone()
    b = Builder(len(ids))
    b.tensors["ids"] = idt.to(torch.int32)
    y = b.new("y", H, dtype)
    b.ins.append(VocabParallelEmbed(ids=b.ids, table=b.hbm("table", local), out=y, start=start, layer=None))
    b.store(y)
    return CaseProgram(b, {"weight": local, "indices": idt[:, None]},
                       lambda t: {"y": vocab_parallel_embedding(t["weight"], t["indices"], start=start,
                                                                end=end)[:, 0]})


register_cases(__package__, [
    OpCase("T3_V1000_H256_f32", lambda: _embed([5, 999, 0], 1000, 256, F32), EXACT),
    OpCase("scaled_T2_V500_H200_bf16", lambda: _embed([17, 499], 500, 200, BF16, scaled=True), EXACT),
    OpCase("vocab_parallel_rank1of2_T5_H192_bf16",
           lambda: _vocab_parallel([3, 700, 499, 500, 999], 1000, 192, rank=1, ranks=2, dtype=BF16), EXACT),
    OpCase("vocab_parallel_rank0of2_T4_H256_f32",
           lambda: _vocab_parallel([0, 499, -1, 1000], 1000, 256, rank=0, ranks=2, dtype=F32), EXACT),
])
