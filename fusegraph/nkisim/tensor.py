"""``NkiTensor``: a strided view of a :class:`~fusegraph.nkisim.storage.Storage`.

Semantics of NKI 0.3 views (all share storage with their base):

* NumPy-style indexing with ints, slices (steps, negative indices), ``...`` and ``nl.ds(start, size)``.
  Out-of-range bounds raise instead of clipping.  An integer index on the partition dim (dim 0) of an on-chip
  tensor keeps a size-1 dim; on-chip results always keep at least two dims (``t[:, 3]`` -> ``[P, 1]``);
  integer indices on HBM tensors drop the dim.
* ``.reshape(shape)``: like NumPy's copy-free reshape; on-chip tensors must keep their partition dim.
* ``.view(dtype)``: bit reinterpretation; the last dim scales with the itemsize ratio.
* ``.ap(pattern=[[stride, count], ...], offset=0, scalar_offset=None, vector_offset=None, indirect_dim=0,
  dtype=None)``: a raw access pattern relative to this tensor's first element, strides in elements of the
  tensor's row-major layout; for on-chip tensors the first pair is the partition dim and a step equal to this
  view's or the allocation's free size means the next partition (see :meth:`NkiTensor._partition_step`).
  Runtime indirection: ``scalar_offset`` (a 1x1 SBUF tensor or a VirtualRegister) adds
  ``value * prod(self.shape[indirect_dim+1:])`` elements; ``vector_offset`` (an SBUF ``[P, 1]`` tensor)
  replaces the first pattern dim: row ``p`` starts at ``offset + idx[p] * prod(self.shape[indirect_dim+1:])``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from . import dtypes as dt
from .enums import MemoryRegion
from .errors import NkiNotImplementedError, NkiValidationError
from .storage import Storage

_FROM_05 = frozenset(
    {
        "permute",
        "broadcast",
        "slice",
        "select",
        "expand_dim",
        "squeeze_dim",
        "reshape_dim",
        "flatten_dims",
        "rearrange",
        "vector_select",
        "indirect",
    }
)


class DynSlice:
    """``nl.ds(start, size)``: a slice of ``size`` elements starting at ``start``."""

    __slots__ = ("start", "size")

    def __init__(self, start: Any, size: Any):
        self.start = start
        self.size = size

    def __repr__(self) -> str:
        return f"nl.ds({self.start}, {self.size})"


@dataclass(frozen=True)
class Indirect:
    kind: str  # "scalar" | "vector"
    index: Any  # NkiTensor or VirtualRegister
    dim: int
    mult: int  # elements per unit of the index value


def _where() -> str | None:
    from .context import maybe_current

    ctx = maybe_current()
    if ctx is None:
        return None
    return ctx.where(depth=4)


def _err(msg: str, rule: str) -> NkiValidationError:
    return NkiValidationError(msg, rule=rule, location=_where())


def _as_int(x: Any, what: str) -> int:
    if isinstance(x, (bool, np.bool_)):
        raise _err(f"{what} must be an integer, got {x!r}", "index")
    if isinstance(x, (int, np.integer)):
        return int(x)
    raise NkiNotImplementedError(
        f"{what} must be a compile-time integer here, got {type(x).__name__}; dynamic indices are supported "
        f"through .ap(scalar_offset=/vector_offset=)",
        rule="not-implemented",
        location=_where(),
    )


def _full_key(key: Any, shape: tuple[int, ...]) -> tuple:
    """An index as one entry per dim: the ellipsis expanded and missing trailing dims filled with ``:``, so the
    indexing loop sees exactly ``len(shape)`` entries."""
    if not isinstance(key, tuple):
        key = (key,)
    n_ell = sum(1 for k in key if k is Ellipsis)
    if n_ell > 1:
        raise _err("an index can only have a single ellipsis ('...')", "index")
    if n_ell:
        i = next(j for j, k in enumerate(key) if k is Ellipsis)
        fill = len(shape) - (len(key) - 1)
        if fill < 0:
            raise _err(f"too many indices for tensor of shape {shape}", "index")
        key = key[:i] + (slice(None),) * fill + key[i + 1 :]
    if len(key) > len(shape):
        raise _err(f"too many indices ({len(key)}) for tensor of shape {shape}", "index")
    return key + (slice(None),) * (len(shape) - len(key))


def _point_index(k: Any, dim: int, n: int, shape: tuple[int, ...]) -> int:
    """A scalar index into a dim of size ``n``, bounds-checked and made non-negative; the index kinds NKI has no
    scalar meaning for (None, a tensor) are rejected here with their own message."""
    if type(k) is int:
        i = k
    elif k is None:
        raise _err("np.newaxis / None indices are not supported on NKI tensors", "index")
    elif isinstance(k, NkiTensor):
        raise NkiNotImplementedError(
            "indexing with a tensor is not available in NKI 0.3; use .ap(vector_offset=...)",
            rule="not-implemented",
            location=_where(),
        )
    else:
        i = _as_int(k, f"index for dim {dim}")
    if i < -n or i >= n:
        raise _err(f"index {i} is out of bounds for dim {dim} of size {n} (tensor shape {shape})", "index")
    return i + n if i < 0 else i


def _slice_range(k: slice, dim: int, n: int, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """``(first, length, step)`` of a slice over a dim of size ``n``.  The common case (int or missing bounds,
    no step) is resolved inline because it is the hot path of every generated kernel; other slices are checked
    (compile-time ints, in bounds, non-zero step) and resolved like Python's ``slice.indices``."""
    start, stop, step = k.start, k.stop, k.step
    if step is None and (start is None or type(start) is int) and (stop is None or type(stop) is int):
        b = 0 if start is None else start
        e = n if stop is None else stop
        if b < 0:
            b += n
        if e < 0:
            e += n
        if not (0 <= b <= n and 0 <= e <= n):
            raise _err(f"slice {k.start}:{k.stop} is out of bounds for dim {dim} of size {n} "
                       f"(tensor shape {shape})", "index")
        return b, (e - b if e > b else 0), 1
    step = 1 if step is None else _as_int(step, "slice step")
    if step == 0:
        raise _err("slice step cannot be zero", "index")
    for v, what in ((start, "start"), (stop, "stop")):
        if v is not None:
            iv = _as_int(v, f"slice {what}")
            if iv > n or iv < -n:
                raise _err(
                    f"slice {what} {iv} is out of bounds for dim {dim} of size {n} (tensor shape {shape})",
                    "index",
                )
    b, e, st = slice(None if start is None else int(start), None if stop is None else int(stop), step).indices(n)
    return b, len(range(b, e, st)), st


def _ds_range(k: DynSlice, dim: int, n: int, shape: tuple[int, ...]) -> tuple[int, int]:
    """``(start, size)`` of an ``nl.ds`` over a dim of size ``n`` (compile-time ints, inside the dim)."""
    start = _as_int(k.start, "nl.ds start")
    size = _as_int(k.size, "nl.ds size")
    if start < 0 or size < 0 or start + size > n:
        raise _err(
            f"nl.ds({start}, {size}) is out of bounds for dim {dim} of size {n} (tensor shape {shape})",
            "index",
        )
    return start, size


def _ap_pairs(pattern: Any) -> list[tuple[int, int]]:
    """An ``.ap`` pattern as checked ``(stride, count)`` pairs: a non-empty list of compile-time int pairs with
    positive counts."""
    try:
        pairs = [(_as_int(p[0], "ap stride"), _as_int(p[1], "ap count")) for p in pattern]
    except (TypeError, IndexError):
        raise _err(f"ap pattern must be a list of [stride, count] pairs, got {pattern!r}", "ap") from None
    if not pairs:
        raise _err("ap pattern must not be empty", "ap")
    if any(c <= 0 for _, c in pairs):
        raise _err(f"ap pattern counts must be positive, got {pattern!r}", "ap")
    return pairs


def _scalar_indirect(scalar_offset: Any, idim: int, mult: int, off: int) -> tuple["Indirect | None", int]:
    """``scalar_offset=``: a runtime index from a 1x1 on-chip tensor or a register (an indirect view), or a
    Python int folded into the static offset; ``(indirection or None, offset)``."""
    from .registers import VirtualRegister

    if isinstance(scalar_offset, NkiTensor):
        if scalar_offset.size != 1 or not scalar_offset.on_chip:
            raise _err(
                f"scalar_offset must be a 1x1 SBUF tensor or a VirtualRegister, got shape "
                f"{scalar_offset.shape} in {scalar_offset.buffer.name}",
                "ap",
            )
    elif not isinstance(scalar_offset, VirtualRegister):
        if isinstance(scalar_offset, (int, np.integer)):
            return None, off + int(scalar_offset) * mult
        raise _err(f"scalar_offset must be a 1x1 SBUF tensor or a VirtualRegister, got {scalar_offset!r}", "ap")
    return Indirect("scalar", scalar_offset, idim, mult), off


class NkiTensor:
    """A tensor in HBM, SBUF or PSUM (a view of a storage)."""

    __slots__ = ("_st", "shape", "_strides", "_offset", "dtype", "_ind", "_ap")

    def __init__(
        self,
        st: Storage,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        offset: int,
        dtype: dt.DType,
        ind: Indirect | None = None,
    ):
        self._st = st
        self.shape = shape
        self._strides = strides
        self._offset = offset
        self.dtype = dtype
        self._ind = ind
        self._ap = False  # raw .ap() view: bounds are checked when an instruction uses it

    # ---------------------------------------------------------------- construction
    @classmethod
    def full(cls, st: Storage) -> "NkiTensor":
        return cls(st, st.shape, _row_major(st.shape), 0, st.dtype)

    # ---------------------------------------------------------------- attributes
    @property
    def buffer(self) -> MemoryRegion:
        return self._st.buffer

    @property
    def name(self) -> str:
        return self._st.name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def strides(self) -> tuple[int, ...]:
        """Strides in elements."""
        return self._strides

    @property
    def offset(self) -> int:
        """Element offset of the first element within the underlying storage."""
        return self._offset

    def __repr__(self) -> str:
        ind = f", indirect={self._ind.kind}" if self._ind else ""
        return (
            f"NkiTensor(shape={self.shape}, dtype={self.dtype.name}, buffer={self.buffer.name}, "
            f"name={self._st.label!r}{ind})"
        )

    def __len__(self) -> int:
        return self.shape[0]

    def __iter__(self):
        raise TypeError("NkiTensor is not iterable; index it with slices or nl.ds")

    def __bool__(self) -> bool:
        """A tensor in a condition is a compile-time value: a reference to device memory, which is present.

        The NKI language guide: "At compile-time we do not yet know the precise location nor the precise contents of
        this tensor ... we can only query meta-data"; ``if`` statements are "resolved at specialization time".  So
        ``if t:`` / ``t and ...`` test that a tensor was passed (nki-library's ``mlp_tkg_constants.py`` writes
        ``if params.expert_params and params.expert_params.expert_index:``, compiled and run on hardware); the
        tensor's *contents* never reach Python (NkiTensor has no comparison operators)."""
        return True

    def __getattr__(self, name: str) -> Any:
        if name in _FROM_05:
            raise AttributeError(
                f"NkiTensor.{name}() only exists from NKI 0.5 (SDK 2.31); in NKI 0.3 use slicing, .reshape, .view "
                f"or .ap(pattern=...)"
            )
        raise AttributeError(f"'NkiTensor' object has no attribute {name!r}")

    def __setitem__(self, key: Any, value: Any) -> None:
        raise NkiNotImplementedError(
            "assigning into an NkiTensor (t[...] = value) is not supported; write with an ISA instruction "
            "(nisa.tensor_copy, nisa.dma_copy, ...)",
            rule="not-implemented",
            location=_where(),
        )

    @property
    def on_chip(self) -> bool:
        return self._st.buffer.on_chip

    # ---------------------------------------------------------------- indexing
    def __getitem__(self, key: Any) -> "NkiTensor":
        if self._ind is not None:
            raise NkiNotImplementedError(
                "indexing an indirect (.ap with scalar_offset/vector_offset) view is not supported",
                rule="not-implemented",
                location=_where(),
            )
        key = _full_key(key, self.shape)
        on_chip = self._st.buffer.on_chip
        shape: list[int] = []
        strides: list[int] = []
        offset = self._offset
        for dim, (k, n, s) in enumerate(zip(key, self.shape, self._strides)):
            tk = type(k)
            if tk is slice:
                b, length, step = _slice_range(k, dim, n, self.shape)
                if length:
                    offset += b * s
                shape.append(length)
                strides.append(s * step)
            elif tk is DynSlice:
                b, length = _ds_range(k, dim, n, self.shape)
                offset += b * s
                shape.append(length)
                strides.append(s)
            else:
                offset += _point_index(k, dim, n, self.shape) * s
                if on_chip and dim == 0:  # an on-chip tensor keeps its partition dim
                    shape.append(1)
                    strides.append(s)
        if on_chip and len(shape) < 2:
            shape.append(1)
            strides.append(1)
        return NkiTensor(self._st, tuple(shape), tuple(strides), offset, self.dtype)

    # ---------------------------------------------------------------- reshape / view / ap
    def reshape(self, shape: Sequence[int]) -> "NkiTensor":
        """Copy-free reshape (the result aliases this tensor)."""
        if self._ind is not None:
            raise NkiNotImplementedError("reshape of an indirect view is not supported", rule="not-implemented",
                                         location=_where())
        if isinstance(shape, (int, np.integer)):
            shape = (int(shape),)
        new_shape = tuple(_as_int(s, "reshape dim") for s in shape)
        if -1 in new_shape:
            known = 1
            for s in new_shape:
                if s != -1:
                    known *= s
            if new_shape.count(-1) > 1 or known == 0 or self.size % known:
                raise _err(f"cannot reshape tensor of shape {self.shape} into {tuple(shape)}", "reshape")
            new_shape = tuple(self.size // known if s == -1 else s for s in new_shape)
        if int(np.prod(new_shape, dtype=np.int64)) != self.size:
            raise _err(f"cannot reshape tensor of shape {self.shape} ({self.size} elements) into {new_shape}", "reshape")
        if self.on_chip and (not new_shape or new_shape[0] != self.shape[0]):
            raise _err(
                f"reshape of an on-chip tensor must keep the partition dim: {self.shape} -> {new_shape}", "reshape"
            )
        new_strides = _nocopy_strides(self.shape, self._strides, new_shape)
        if new_strides is None:
            raise _err(
                f"cannot reshape this strided view of shape {self.shape} (strides {self._strides}) into {new_shape} "
                f"without a copy",
                "reshape",
            )
        return NkiTensor(self._st, new_shape, new_strides, self._offset, self.dtype)

    def view(self, dtype: Any) -> "NkiTensor":
        """Reinterpret the bits as ``dtype``; the last dim scales by the itemsize ratio."""
        new = dt.get(dtype)
        old = self.dtype
        if self._ind is not None:
            raise NkiNotImplementedError("view() of an indirect view is not supported", rule="not-implemented",
                                         location=_where())
        if new.itemsize == old.itemsize:
            return NkiTensor(self._st, self.shape, self._strides, self._offset, new)
        if not self.shape or self._strides[-1] != 1 and self.shape[-1] != 1:
            raise _err(f"view({new.name}) needs a contiguous last dim (strides {self._strides})", "view")
        byte_off = self._offset * old.itemsize
        byte_strides = [s * old.itemsize for s in self._strides[:-1]]
        last_bytes = self.shape[-1] * old.itemsize
        if last_bytes % new.itemsize or byte_off % new.itemsize or any(b % new.itemsize for b in byte_strides):
            raise _err(
                f"cannot view a tensor of shape {self.shape} {old.name} as {new.name}: sizes/offsets not divisible",
                "view",
            )
        shape = self.shape[:-1] + (last_bytes // new.itemsize,)
        strides = tuple(b // new.itemsize for b in byte_strides) + (1,)
        return NkiTensor(self._st, shape, strides, byte_off // new.itemsize, new)

    def get_pattern(self) -> list[list[int]]:
        """The access pattern ``[[stride, count], ...]`` of this view (elements)."""
        return [[s, n] for s, n in zip(self._strides, self.shape)]

    def ap(
        self,
        pattern: Sequence[Sequence[int]],
        offset: int | None = None,
        scalar_offset: Any = None,
        vector_offset: Any = None,
        indirect_dim: int = 0,
        dtype: Any = None,
    ) -> "NkiTensor":
        """Raw access pattern view (see the module docstring for the exact address formula).

        On a whole tensor (an ``nl.ndarray``, a kernel argument, or a reshape / dtype view of one) both NKI
        versions agree. On a view they differ (:mod:`.apiversion`): 0.3 rejects it (rule ``nested-ap``), 0.6
        addresses the storage and ignores the view (``offset=None`` keeps the view's offset)."""
        if self._ind is not None:
            raise NkiNotImplementedError(".ap() of an indirect view is not supported", rule="not-implemented",
                                         location=_where())
        if not self._whole():
            from .apiversion import ap_on_view

            mode = ap_on_view()
            if mode == "error":
                raise self._nested_ap_error()
            if mode == "storage":
                return self._storage_base()._raw_ap(
                    pattern, self._offset if offset is None else offset, scalar_offset, vector_offset, indirect_dim,
                    dtype,
                )
        return self._raw_ap(pattern, offset, scalar_offset, vector_offset, indirect_dim, dtype)

    def _whole(self) -> bool:
        """True if this view is its whole storage in row-major order (what ``nl.ndarray`` returned, a reshape / dtype
        view of it, or an ``.ap()`` that covers it as it is): ``.ap`` on it means the same in every NKI version.

        Why an ``.ap()`` result counts: nki-library's hardware-tested ``moe_tkg`` (2.29 branch) calls ``.ap`` on
        ``TensorView(t).get_view()`` (``t.ap`` over all of ``t``), though the 0.3 access-pattern page's example of
        the nested-indexing error has that form; where the two readings agree, the hardware kernel decides."""
        return (self._offset == 0 and self.size * self.dtype.itemsize == self._st.nbytes
                and self._strides == _row_major(self.shape))

    def _storage_base(self) -> "NkiTensor":
        """The whole storage as one tensor of this view's dtype (what a 0.6 ``.ap`` on a view addresses)."""
        base = NkiTensor.full(self._st)
        return base if base.dtype.itemsize == self.dtype.itemsize else base.view(self.dtype)

    def _nested_ap_error(self) -> NkiValidationError:
        """The NKI 0.3 error for ``.ap`` on a view: never silently re-based, and the message says the fix."""
        what = "an .ap() view" if self._ap else "a view"
        return _err(
            f".ap() called on {what} (shape {self.shape}, element offset {self._offset}) of tensor '{self._st.label}': NKI 0.3 allows .ap only on the nl.ndarray itself "
            f"(nki-aps, 'Restriction on Nested Indexing'); call .ap on the base tensor and add the view's offset to "
            f"offset=",
            "nested-ap",
        )

    def _raw_ap(
        self,
        pattern: Sequence[Sequence[int]],
        offset: int | None,
        scalar_offset: Any,
        vector_offset: Any,
        indirect_dim: int,
        dtype: Any,
    ) -> "NkiTensor":
        """``.ap`` on a whole tensor: the pattern and offset address it from its first element."""
        pairs = _ap_pairs(pattern)
        off = 0 if offset is None else _as_int(offset, "ap offset")
        d = self.dtype if dtype is None else dt.get(dtype)
        if d.itemsize != self.dtype.itemsize:
            raise NkiNotImplementedError(
                ".ap(dtype=...) with a different itemsize is not supported; use .view(dtype) first",
                rule="not-implemented",
                location=_where(),
            )
        shape = tuple(c for _, c in pairs)
        strides = tuple(s for s, _ in pairs)
        if self.on_chip:
            strides = (self._partition_step(strides[0], d),) + strides[1:]
        ind = None
        if scalar_offset is not None and vector_offset is not None:
            raise _err("scalar_offset and vector_offset are mutually exclusive", "ap")
        if scalar_offset is not None or vector_offset is not None:
            idim = _as_int(indirect_dim, "indirect_dim")
            if not 0 <= idim < len(self.shape):
                raise _err(f"indirect_dim {idim} is out of range for tensor of shape {self.shape}", "ap")
            mult = 1
            for s in self.shape[idim + 1 :]:
                mult *= s
            if vector_offset is not None:
                ind = self._vector_indirect(vector_offset, idim, mult)
            else:
                ind, off = _scalar_indirect(scalar_offset, idim, mult, off)
        t = NkiTensor(self._st, shape, strides, self._offset * self.dtype.itemsize // d.itemsize + off, d, ind)
        t._ap = True
        return t

    def _vector_indirect(self, vector_offset: Any, idim: int, mult: int) -> "Indirect":
        """``vector_offset=``: one runtime row index per partition from an integer SBUF tile (HBM tensors only)."""
        if not isinstance(vector_offset, NkiTensor) or vector_offset.buffer is not MemoryRegion.sbuf:
            raise _err("vector_offset must be an SBUF tensor of shape [P, 1]", "ap")
        if self.on_chip:
            raise _err("vector_offset indirection is only supported on HBM tensors", "ap")
        # the index shape is checked by the DMA that uses the view: dma_copy/dma_compute take [P, 1] (one
        # row per partition), an indirect dma_transpose takes a 2-D [16..128, C] index tile
        # trailing unit dims are one element per partition too: nki-library's router_topk (indirect
        # scatter, hardware-tested) passes a [P, 1, 1] .ap view of its index tile
        if len(vector_offset.shape) < 2 or any(d != 1 for d in vector_offset.shape[2:]):
            raise _err(f"vector_offset must be a 2-D SBUF tensor (trailing unit dims allowed), got shape "
                       f"{vector_offset.shape}", "ap")
        if not vector_offset.dtype.is_int:
            raise _err(f"vector_offset must have an integer dtype, got {vector_offset.dtype.name}", "ap")
        return Indirect("vector", vector_offset, idim, mult)

    def _partition_step(self, step: int, d: dt.DType) -> int:
        """The storage stride of the partition entry of an on-chip ``.ap()`` pattern.

        Hardware access patterns address whole partitions: the partition dim is a start partition and a count, and
        "the step of the leading dimension must be the element count of the entire free dimension of the tensor"
        (access-pattern guide), i.e. one step = the next partition.  The tensor ``.ap()`` is called on may be a
        slice (the hand-written Qwen3 megakernel calls ``col.ap([[1, PMAX], [0, n]])`` on a ``[PMAX, 1]`` column of
        a wider tile): its own free size is then the unit.  So a step equal to this view's free size or to the
        allocation's free size is the next partition (the allocation's partition stride); any other step is kept
        as a literal element stride, which the instruction using the view rejects (rule ``partition-stride``:
        partitions cannot be skipped or repeated)."""
        view_free = 1
        for n in self.shape[1:]:
            view_free *= n
        alloc_free = self._st.free_bytes // d.itemsize if d.itemsize else 0
        if step in (view_free, alloc_free):
            return alloc_free
        return step


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def _nocopy_strides(shape: tuple[int, ...], strides: tuple[int, ...], new_shape: tuple[int, ...]):
    """Strides for a copy-free reshape, or None (NumPy's rules, computed without touching memory)."""
    base = np.lib.stride_tricks.as_strided(np.zeros(1, dtype=np.uint8), shape=shape, strides=strides)
    try:
        v = np.reshape(base, new_shape, copy=False)
    except ValueError:
        return None
    return tuple(int(s) for s in v.strides)


def extent(t: NkiTensor) -> tuple[int, int]:
    """(min, max) element address touched by a direct view, in elements of its dtype."""
    lo = hi = t._offset
    for n, s in zip(t.shape, t._strides):
        if n == 0:
            return (t._offset, t._offset - 1)
        d = (n - 1) * s
        if d < 0:
            lo += d
        else:
            hi += d
    return lo, hi


def check_bounds(t: NkiTensor, where: str | None = None) -> None:
    """Raise if a direct view reaches outside its storage."""
    if t.size == 0:
        return
    lo, hi = extent(t)
    limit = t._st.nbytes // t.dtype.itemsize
    if lo < 0 or hi >= limit:
        raise NkiValidationError(
            f"access pattern {t.get_pattern()} with offset {t._offset} reaches elements [{lo}, {hi}] outside tensor "
            f"'{t._st.label}' of {limit} {t.dtype.name} elements (shape {t._st.shape})",
            rule="out-of-bounds",
            location=where or _where(),
        )
