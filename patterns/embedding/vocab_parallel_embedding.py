"""The vocab-parallel embedding lookup of one rank: DTensor's masked lookup of a ``Shard(0)`` (vocabulary-sharded)
embedding table, what HF's default ``embedding_rowwise`` plan puts before the embedding's all-reduce.

Each rank holds rows ``[start, end)`` of the table. DTensor (``_MaskPartial``) masks the ids outside that range,
looks the rest up at ``id - start`` (masked ids at row 0), and zeroes the masked rows, so the all-reduce that
follows (matched by ``fusegraph.all_reduce``) sums exactly one real row per token. ``start`` and ``end`` are
constants of the rank (captured as params); ``check`` requires ``end - start`` to be the local table's row count,
which is what DTensor's even and uneven shards both give. The matcher does not compare the values of lifted
constants, so the lowering's check (``lowering.py``) requires both fill values to be zero.
"""
from __future__ import annotations

from typing import Any

import torch

from fusegraph.matching import Input, register_pattern

WEIGHT = Input("weight", "V H", kind="weight")
INDICES = Input("indices", "B S", dtype="int64")


def _check(m: Any) -> bool | str:
    rows = m.inputs["weight"].shape
    start, end = m.params.get("start"), m.params.get("end")
    if rows is None or not isinstance(start, int) or not isinstance(end, int):
        return "the rank's vocabulary range or table shape is unknown"
    if end - start != rows[0]:
        return f"vocabulary range [{start}, {end}) does not have the local table's {rows[0]} rows"
    return True


@register_pattern(
    "fusegraph.vocab_parallel_embedding",
    template="vocab_parallel_embedding",
    block="embedding",
    priority=12,
    inputs=[WEIGHT, INDICES],
    params={"start": 64, "end": 96},
    dims={"V": (32, 48), "H": (16, 24), "B": (1, 2), "S": (1, 3)},
    check=_check,
)
def vocab_parallel_embedding(weight, indices, *, start, end):
    """Rows ``indices - start`` of the local table, zero for ids outside ``[start, end)``.

    DTensor's ``masked[mask] = 0`` and ``out[mask, :] = 0.0`` are traced as ``index_put`` of a ``scalar_tensor``
    (what ``make_fx`` records for the captured step), written here as those ops."""
    mask = (indices < start) | (indices >= end)
    local = indices.clone() - start
    local = torch.ops.aten.index_put(local, [mask], torch.scalar_tensor(0, dtype=local.dtype, device=local.device))
    out = torch.nn.functional.embedding(local, weight)
    return torch.ops.aten.index_put(out, [mask], torch.scalar_tensor(0.0, dtype=out.dtype, device=out.device))


@vocab_parallel_embedding.implementation("lifted_zeros", inputs=[WEIGHT, INDICES])
def _lifted_zeros(weight, indices, *, start, end):
    """The same lookup as DTensor writes it (``masked[mask] = 0``, ``out[mask, :] = 0.0``): traced on a real
    device, the two zeros are lifted tensor constants (``get_attr``), as in a step captured on CPU (on ``meta``,
    the benchmark's device, they are ``scalar_tensor`` ops: the reference form)."""
    mask = (indices < start) | (indices >= end)
    local = indices.clone() - start
    local[mask] = 0
    out = torch.nn.functional.embedding(local, weight)
    out[mask, :] = 0.0
    return out
