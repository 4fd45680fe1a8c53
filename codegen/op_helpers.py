"""Helpers ops share (public through :mod:`fusegraph.codegen.api`): the common ``tokens``/``check`` helpers."""
from __future__ import annotations

from typing import Any

from .errors import CodegenError


def x_tokens(m: Any, graph: Any) -> int | None:
    """Tokens per step from the match's ``x`` input (``[B, 1, H]`` or ``[T, H]``); raises for a prefill step."""
    if "x" not in m.inputs:
        return None
    shape = graph.nodes[m.inputs["x"]]["shape"]
    if len(shape) == 3 and shape[1] != 1:
        raise CodegenError(f"a step over {shape[1]} positions is not a decode step (prefill runs eagerly)")
    return int(shape[0]) if len(shape) >= 2 else 1


def numel(shape: Any) -> int:
    n = 1
    for s in shape or ():
        n *= int(s)
    return n


def per_token_features(graph: Any, node: str, tokens: int | None) -> int | None:
    """Features per token of a program value, when the step's token count is known."""
    shape = graph.nodes[node].get("shape")
    if tokens is None or not isinstance(shape, tuple) or not shape:
        return None
    n = numel(shape)
    return n // tokens if n % tokens == 0 else None


#: bytes per partition the GpSimd DMA path of ``nisa.sendrecv`` takes, by element size (the interpreter's rule)
SB2SB_GPSIMD_LIMIT = {4: 1024, 2: 512, 1: 256}


def sb2sb_dma_engine(partitions: int, free_elems: int, itemsize: int) -> str:
    """The ``dma_engine=`` argument of an LNC=2 ``sendrecv`` of a ``[partitions, free_elems]`` tile: the GpSimd DMA
    path for small tiles on a multiple of 16 partitions, else the default (the sync queue).

    Why: the exchange waits for the compute that produced its half; on the sync queue it holds back every DMA
    issued after it (the KV write, the cache reads of attention, the next weights) until then. nki-library's
    decode attention (``attention_tkg``: ``use_gpsimd_sb2sb``) sends such small SBUF-to-SBUF tiles on
    ``dma_engine.gpsimd_dma`` under the same size rule."""
    if partitions % 16 == 0 and free_elems * itemsize <= SB2SB_GPSIMD_LIMIT.get(itemsize, 0):
        return ", dma_engine=nisa.dma_engine.gpsimd_dma"
    return ""


# ---- the step's cache positions, shared by the KV writes and the attentions that read the written caches ----
KV_INDEX = "kv_index"  # the SBUF tile of this step's cache positions (loaded once per step, shared with KV writes)
KV_NEXT = "kv_next"  # the positions + 1 (computed once per step): the bound of the position-bounded block loop


def position_assumption(position: int) -> dict[str, int]:
    """The ``assume`` of a shape-only interpreter run (:func:`fusegraph.nkisim.run`) whose sequences all write
    this step's row at ``position`` (``L - 1``: a full cache, as the serving benchmarks read it). Why a helper: the
    position-bounded block loop's bound is the position + 1, a tile the kernel derives from the positions (no data
    in a shape-only run), so both tiles need the assumption."""
    return {KV_INDEX: position, KV_NEXT: position + 1}


def kv_positions(L: Any) -> dict[str, Any]:
    """Cache value name -> the per-sequence position input its KV write used in this kernel (filled by the KV-write
    lowerings, which come first: attention reads the updated cache)."""
    return L.shared.setdefault("kv_positions", {})
