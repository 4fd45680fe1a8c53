"""Official NKI enums (buffers, DGE modes, engines, ...) with the member names and values of the 0.3 stubs.

SDK 2.29 requires enum and buffer arguments to be these objects (``nl.sbuf``, ``nisa.dge_mode.hwdge``), not
raw ints or strings; :func:`require_enum` enforces that for every instruction.
"""

from __future__ import annotations

import logging
import os
from enum import Enum
from typing import Any, TypeVar

from .errors import NkiValidationError

log = logging.getLogger(__name__)


class _NkiEnum(Enum):
    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class MemoryRegion(_NkiEnum):
    """Memory region constants for NKI tensors (``nl.sbuf``, ``nl.psum``, ``nl.private_hbm``, ``nl.shared_hbm``)."""

    sbuf = "sbuf"
    psum = "psum"
    private_hbm = "private_hbm"
    shared_hbm = "shared_hbm"

    on_chip: bool  # set below (plain attributes: these are read on every instruction)
    is_hbm: bool


for _m in MemoryRegion:
    _m.on_chip = _m.value in ("sbuf", "psum")
    _m.is_hbm = not _m.on_chip


class dge_mode(_NkiEnum):  # noqa: N801 - official name
    """Descriptor Generation Engine mode."""

    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class dma_engine(_NkiEnum):  # noqa: N801
    """DMA transfer engine (for sendrecv)."""

    dma = 1
    gpsimd_dma = 2


class engine(_NkiEnum):  # noqa: N801
    """Neuron Device engines."""

    tensor = 1
    vector = 5
    scalar = 2
    gpsimd = 3
    dma = 4
    sync = 6
    unknown = 0


class matmul_perf_mode(_NkiEnum):  # noqa: N801
    """Performance mode for matmul."""

    none = "none"
    double_row = "double_row"


class nc_version(_NkiEnum):  # noqa: N801
    """NeuronCore version.

    Ordered by generation: nki-library's 2.29 branch writes ``nisa.get_nc_version() >= nisa.nc_version.gen4``
    (``attention_tkg.py``) and ``>= 3`` (experimental collectives) in hardware-tested kernels, so the compiler
    compares versions; comparing with an int compares the generation number."""

    gen2 = 2
    gen3 = 3
    gen4 = 4

    def _gen(self, other: object) -> int | None:
        if isinstance(other, nc_version):
            return other.value
        if isinstance(other, int) and not isinstance(other, bool):
            return other
        return None

    def __lt__(self, other: object) -> bool:
        g = self._gen(other)
        return NotImplemented if g is None else self.value < g

    def __le__(self, other: object) -> bool:
        g = self._gen(other)
        return NotImplemented if g is None else self.value <= g

    def __gt__(self, other: object) -> bool:
        g = self._gen(other)
        return NotImplemented if g is None else self.value > g

    def __ge__(self, other: object) -> bool:
        g = self._gen(other)
        return NotImplemented if g is None else self.value >= g


class oob_mode(_NkiEnum):  # noqa: N801
    """Out-of-bounds access mode."""

    error = 0
    skip = 1


class reduce_cmd(_NkiEnum):  # noqa: N801
    """Engine register reduce commands."""

    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


E = TypeVar("E", bound=Enum)


def _where() -> str | None:
    from .context import maybe_current

    ctx = maybe_current()
    return ctx.where() if ctx is not None else None


ENV_LENIENT = "FUSEGRAPH_NKISIM_LENIENT_ENUMS"


#: (instruction, location) sites already warned about a raw ``dge_mode`` int (one warning per site, not per call)
_WARNED_RAW: set[tuple[str, str | None]] = set()


def _raw_dge_mode(value: Any, op: str) -> "dge_mode | None":
    """A raw int ``dge_mode`` value (0-3) as its member, with one warning per call site; else None.

    The 0.3.0 update guide says raw enum ints are "no longer accepted", but nki-library's ``2.29`` branch (the one
    "corresponding to" SDK 2.29, also the library the compiler bundles) passes ``dge_mode=3`` in its hardware-tested
    TKG kernels (``norm_tkg_utils.py``, ``qkv_tkg.py``, ``mlp_tkg``), and so does the hand-written Qwen3 megakernel
    (``dge_mode=3`` / ``dge_mode=0``).  We never reject what those kernels do: the value is accepted and warned
    about (fusegraph's own code always emits members)."""
    if isinstance(value, (bool, Enum)) or not isinstance(value, int):
        return None
    try:
        member = dge_mode(value)
    except ValueError:
        return None
    where = _where()
    key = (op, where)
    if key not in _WARNED_RAW:
        _WARNED_RAW.add(key)
        log.warning("%s: raw dge_mode=%r accepted as %s at %s (2.29 documents enum members only; nki-library 2.29 "
                    "passes ints)", op, value, member, where)
    return member


def require_enum(value: Any, enum_cls: type[E], what: str, op: str) -> E:
    """Return ``value`` if it is a member of ``enum_cls``; raise the 2.29 rule violation otherwise.

    Raw ``dge_mode`` ints are accepted with a warning (see :func:`_raw_dge_mode`).
    ``FUSEGRAPH_NKISIM_LENIENT_ENUMS=1`` accepts raw values of the other enums too (with a warning); never set it
    for generated code."""
    if isinstance(value, enum_cls):
        return value
    if enum_cls is dge_mode:
        member = _raw_dge_mode(value, op)
        if member is not None:
            return member  # type: ignore[return-value]
    if os.environ.get(ENV_LENIENT) == "1" and not isinstance(value, (bool, Enum)):
        try:
            member = enum_cls(value)
        except ValueError:
            member = None
        if member is not None:
            log.warning("%s: raw %s=%r accepted as %s (FUSEGRAPH_NKISIM_LENIENT_ENUMS=1)", op, what, value, member)
            return member
    raise NkiValidationError(
        f"{op}: {what} must be a {enum_cls.__name__} enum member (e.g. "
        f"{enum_cls.__name__}.{next(iter(enum_cls)).name}), got {value!r}; raw ints/strings are rejected since SDK 2.29",
        rule="enum-arg",
        location=_where(),
    )


def require_buffer(value: Any, what: str, op: str) -> MemoryRegion:
    if isinstance(value, MemoryRegion):
        return value
    raise NkiValidationError(
        f"{op}: {what} must be a buffer object (nl.sbuf, nl.psum, nl.hbm, nl.private_hbm, nl.shared_hbm), "
        f"got {value!r}; strings are rejected since SDK 2.29",
        rule="enum-arg",
        location=_where(),
    )
