"""Tensor storage: a flat byte buffer (or no buffer at all in shape-only mode) plus allocation metadata.

Views (:class:`~fusegraph.nkisim.tensor.NkiTensor`) address a storage through (offset, shape, strides) in
elements of their dtype, so every view aliases its storage.  On-chip storages record their partition
geometry (start partition, bytes per partition) for the hardware checks, and PSUM storages keep a per-byte
write state for the ``accumulate=None`` rule of ``nc_matmul``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import dtypes as dt
from .enums import MemoryRegion

_ids = itertools.count(1)

# PSUM write state per byte
PSUM_FRESH = 0
PSUM_MATMUL = 1
PSUM_OTHER = 2


@dataclass(frozen=True)
class Abstract:
    """A kernel argument without data, for shape-only runs: ``Abstract((48, 4096, 2048), "bfloat16")``."""

    shape: tuple[int, ...]
    dtype: Any = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "dtype", dt.get(self.dtype))

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class Storage:
    """Backing memory of one allocation (kernel argument, ``nl.ndarray``, ...)."""

    __slots__ = (
        "id",
        "buf",
        "nbytes",
        "dtype",
        "shape",
        "buffer",
        "name",
        "label",
        "kind",
        "start_partition",
        "partitions",
        "free_bytes",
        "psum_state",
        "psum_offset",
        "written",
        "manual",
        "mem",
        "program",
        "__weakref__",
    )

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: dt.DType,
        buffer: MemoryRegion,
        *,
        buf: np.ndarray | None,
        name: str = "",
        label: str = "",
        kind: str = "internal",
        start_partition: int = 0,
        manual: bool = False,
        program: int = 0,
    ):
        self.id = next(_ids)
        self.buf = buf
        self.shape = shape
        self.dtype = dtype
        n = 1
        for s in shape:
            n *= s
        self.nbytes = n * dtype.itemsize
        self.buffer = buffer
        self.name = name
        self.label = label or name or f"t{self.id}"
        self.kind = kind
        self.start_partition = start_partition
        self.manual = manual
        self.program = program
        if buffer.on_chip and shape:
            self.partitions = shape[0]
            self.free_bytes = (n // shape[0] if shape[0] else 0) * dtype.itemsize
        else:
            self.partitions = 0
            self.free_bytes = 0
        self.psum_state: np.ndarray | None = None
        self.psum_offset = 0
        # per-byte "written since allocation" mask of uninitialised (sentinel-filled) SBUF/PSUM memory; None: not
        # tracked (kernel arguments, filled allocations, shape-only runs), read as written everywhere
        self.written: np.ndarray | None = None
        self.mem = None  # AllocRecord of on-chip allocations (liveness for capacity accounting)

    @property
    def abstract(self) -> bool:
        return self.buf is None

    def flat(self, d: dt.DType) -> np.ndarray:
        """The whole buffer as a flat array of ``d`` (used for indirect gathers/scatters)."""
        assert self.buf is not None
        return self.buf.view(d.np)

    def ensure_psum_state(self) -> np.ndarray:
        if self.psum_state is None:
            self.psum_state = np.zeros(self.nbytes, dtype=np.uint8)
        return self.psum_state


def sentinel_buffer(nbytes: int, d: dt.DType) -> np.ndarray:
    """A fresh buffer filled with the official sentinels: NaN for floats, 4 for integers."""
    buf = np.empty(nbytes, dtype=np.uint8)
    arr = buf.view(d.np)
    if d.is_float:
        arr.fill(np.nan)
    elif d.is_int:
        arr.fill(4)
    else:
        buf.fill(0)
    return buf


def wrap_array(arr: np.ndarray) -> tuple[np.ndarray, bool]:
    """Byte buffer aliasing ``arr`` when possible (so writes update the caller's array in place).

    Returns (buffer, aliased).  Non-contiguous arrays are copied; the runner copies results back."""
    if arr.flags.c_contiguous and arr.flags.writeable:
        return arr.reshape(-1).view(np.uint8), True
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8).copy(), False
