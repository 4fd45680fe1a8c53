"""Data-dependent values in shape-only runs.

A shape-only run has no data, but some values change *which* memory an instruction touches: runtime
indices (``.ap(scalar_offset=...)``, ``.ap(vector_offset=...)``) and registers loaded from memory.  They come
from the caller's ``assume`` argument of :func:`fusegraph.nkisim.run`:

* ``None`` (default): the element at flat position ``i`` of the index tensor's allocation reads as
  ``i % limit`` — distinct, in-range indices 0, 1, 2, ... (so MoE top-k picks distinct experts and a KV write
  goes to position 0).
* a ``dict`` keyed by the index tensor's ``name=`` (or a register's name): the value is an int (every element),
  an array-like shaped like the index tensor's allocation (read through the same view), or a callable
  taking an :class:`AssumeRequest`.
* a callable ``assume(request) -> int | array-like | None`` (None = default rule).

Values are clipped into ``[0, limit)`` only by the default rule; an explicit assumption that is out of range
raises the same out-of-bounds error a data run would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class AssumeRequest:
    name: str  # name= / label of the index tensor (or register)
    kind: str  # "scalar", "vector" or "register"
    positions: np.ndarray  # flat element positions within the index allocation, one per requested value
    alloc_shape: tuple[int, ...]  # shape of the index allocation
    limit: int  # values must lie in [0, limit) to stay in bounds (0 if unknown)
    target: str  # label of the tensor being indexed ("" for registers)


def resolve(assume: Any, req: AssumeRequest) -> np.ndarray:
    """Values (int64, one per position) for a data-dependent index in a shape-only run."""
    spec = assume
    if isinstance(assume, dict):
        spec = assume.get(req.name)
    if callable(spec):
        spec = spec(req)
    if spec is None:
        lim = req.limit if req.limit > 0 else 1 << 31
        return (req.positions % lim).astype(np.int64)
    if isinstance(spec, (int, np.integer)):
        return np.full(req.positions.shape, int(spec), dtype=np.int64)
    arr = np.asarray(spec, dtype=np.int64).reshape(-1)
    if arr.size == 1:
        return np.full(req.positions.shape, int(arr[0]), dtype=np.int64)
    return arr[req.positions % arr.size]
