"""On-chip memory accounting per program: SBUF bytes per partition and PSUM banks.

Model (documented in docs/interpreter.md):

* An SBUF allocation ``[P, F...]`` occupies ``prod(F) * itemsize`` bytes in **every** partition's address
  range (the compiler allocates a byte range of each partition).  Auto-placed tensors count their bytes;
  tensors placed with ``address=(partition, byte_offset)`` count up to the highest live end address
  (they are placed by the kernel itself, e.g. by nki-library's SbufManager, and may alias on purpose).
  Live bytes = auto bytes + highest manual end; it must stay within the usable budget.
* Liveness is the compiler's: a tensor is live from its allocation to the last instruction that uses it
  (not to the end of its Python lifetime: ``t = nl.ndarray(...)`` in a loop would otherwise keep two
  generations alive).  Allocation and use events are recorded during the run and replayed when the program
  ends; the replay raises the capacity errors, naming the allocation site of the tensor that overflowed.
* What live SBUF beyond the budget means is the run's ``sbuf_overflow`` mode (:func:`resolve_sbuf_overflow`):
  ``"error"`` (the default, fusegraph's policy for the kernels it generates: a megakernel's state is SBUF-resident,
  so a kernel that needs more is a codegen error) raises; ``"compiler"`` models neuronx-cc's default allocation,
  which fits compiler-placed tensors whose live bytes exceed the partition (the Neuron runtime's device-memory page:
  the "scratchpad" holds "intermediary SBUF" data; nki-library's RoPE tests run [64, 8192, 4] bf16 tiles seven at
  a time, 448 KiB live on a 192 KiB partition). It accepts the run and records the largest over-budget demand
  (``Profile.sbuf_over_budget_bytes``); the cost of the spill is not modeled. Tensors the kernel placed itself
  (``address=``) and a single tensor larger than the budget are errors in both modes.
* PSUM: 8 banks of 2 KiB per partition.  A PSUM tensor may not cross a bank (trn2); auto-placed tensors are
  packed first-fit into banks in allocation order, so running out of room means more than 16 KiB per
  partition live or a fragmentation the real allocator might avoid (conservative).  On trn3 a tensor larger
  than a bank takes whole consecutive banks (matmul outputs up to the entire PSUM).
"""

from __future__ import annotations

import os
import threading

from .errors import NkiCapacityError, NkiValidationError
from .targets import Target


#: environment variable giving the default ``sbuf_overflow`` mode of a run
ENV_SBUF_OVERFLOW = "FUSEGRAPH_NKISIM_SBUF_OVERFLOW"
SBUF_OVERFLOW_MODES = ("error", "compiler")


def resolve_sbuf_overflow(mode: str | None = None) -> str:
    """The run's ``sbuf_overflow`` mode: explicit, else ``FUSEGRAPH_NKISIM_SBUF_OVERFLOW``, else ``"error"``.
    A bad value raises (a silent default would check kernels under a rule the user did not ask for)."""
    raw = mode if mode is not None else (os.environ.get(ENV_SBUF_OVERFLOW, "").strip() or "error")
    key = str(raw).strip().lower()
    if key not in SBUF_OVERFLOW_MODES:
        raise ValueError(f"sbuf_overflow must be one of {', '.join(SBUF_OVERFLOW_MODES)}, got {raw!r}")
    return key


class SbufAccountant:
    def __init__(self, budget: int, physical: int, target_name: str, overflow: str = "error"):
        self.budget = budget
        self.overflow = overflow
        self.over_budget_peak = 0  # largest live demand beyond the budget the "compiler" mode accepted
        self.physical = physical
        self.target_name = target_name
        self.auto = 0
        self.manual: dict[int, int] = {}  # alloc id -> end byte
        self.manual_end = 0
        self.peak = 0
        self.live: dict[int, tuple[int, str, str]] = {}  # alloc id -> (bytes, what, where), for error messages
        self.lock = threading.Lock()

    def _live(self) -> int:
        return self.auto + self.manual_end

    def _largest_live(self) -> str:
        top = sorted(self.live.values(), key=lambda v: -v[0])[:4]
        return "; largest live: " + ", ".join(f"{w} {n} B at {loc}" for n, w, loc in top) if top else ""

    def alloc(self, alloc_id: int, nbytes: int, address: tuple[int, int] | None, what: str, where: str) -> None:
        with self.lock:
            if address is None:
                new_total = self.auto + nbytes + self.manual_end
                if new_total > self.budget:
                    if self.overflow == "compiler":
                        self.over_budget_peak = max(self.over_budget_peak, new_total)
                    else:
                        raise NkiCapacityError(
                            f"allocating {what} needs {nbytes} B/partition; live SBUF would be {new_total} "
                            f"B/partition, over the usable budget of {self.budget} B/partition on {self.target_name} "
                            f"(physical {self.physical} B; set FUSEGRAPH_SBUF_BUDGET or sbuf_budget= to change; "
                            f"sbuf_overflow='compiler' accepts it as neuronx-cc's allocator would, spilling)"
                            f"{self._largest_live()}",
                            rule="sbuf-capacity",
                            location=where,
                        )
                self.auto += nbytes
                self.live[alloc_id] = (nbytes, what, where)
            else:
                end = address[1] + nbytes
                if end > self.budget:
                    raise NkiCapacityError(
                        f"{what} placed at byte offset {address[1]} with {nbytes} B/partition ends at {end}, beyond "
                        f"the usable SBUF budget of {self.budget} B/partition on {self.target_name}",
                        rule="sbuf-capacity",
                        location=where,
                    )
                self.manual[alloc_id] = end
                if end > self.manual_end:
                    self.manual_end = end
                if self._live() > self.budget and self.overflow == "compiler":
                    self.over_budget_peak = max(self.over_budget_peak, self._live())
                elif self._live() > self.budget:
                    raise NkiCapacityError(
                        f"allocating {what}: live SBUF {self._live()} B/partition exceeds the usable budget of "
                        f"{self.budget} B/partition on {self.target_name}",
                        rule="sbuf-capacity",
                        location=where,
                    )
            live = self._live()
            if live > self.peak:
                self.peak = live

    def free(self, alloc_id: int, nbytes: int, manual: bool) -> None:
        with self.lock:
            self.live.pop(alloc_id, None)
            if manual:
                self.manual.pop(alloc_id, None)
                self.manual_end = max(self.manual.values(), default=0)
            else:
                self.auto -= nbytes


class PsumAllocator:
    def __init__(self, target: Target):
        self.target = target
        self.bank_bytes = target.psum_bank_bytes
        self.nbanks = target.psum_banks
        self.banks: list[dict[int, tuple[int, int]]] = [dict() for _ in range(self.nbanks)]  # id -> (start, end)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_banks = 0
        self.lock = threading.Lock()

    def _place_in_bank(self, b: int, nbytes: int) -> int | None:
        used = sorted(self.banks[b].values())
        pos = 0
        for s, e in used:
            if s - pos >= nbytes:
                return pos
            pos = max(pos, e)
        if self.bank_bytes - pos >= nbytes:
            return pos
        return None

    def alloc(self, alloc_id: int, nbytes: int, address: tuple[int, int] | None, what: str, where: str) -> int:
        """Place a PSUM tensor; returns its byte offset within a partition's 16 KiB."""
        t = self.target
        with self.lock:
            if address is not None:
                off = address[1]
                if off % self.bank_bytes:
                    raise NkiValidationError(
                        f"{what}: PSUM address byte offset {off} must start on a {self.bank_bytes}-byte bank boundary",
                        rule="psum-bank",
                        location=where,
                    )
                if off + nbytes > self.nbanks * self.bank_bytes:
                    raise NkiCapacityError(
                        f"{what}: PSUM placement [{off}, {off + nbytes}) exceeds {self.nbanks * self.bank_bytes} B/partition",
                        rule="psum-capacity",
                        location=where,
                    )
                if nbytes > self.bank_bytes and not t.psum_tensor_may_span_banks:
                    raise NkiValidationError(
                        f"{what}: PSUM tensor of {nbytes} B/partition crosses a {self.bank_bytes}-byte PSUM bank on {t.name}",
                        rule="psum-bank",
                        location=where,
                    )
                first = off // self.bank_bytes
                remaining = nbytes
                b = first
                while remaining > 0:
                    self.banks[b][alloc_id] = (0, min(self.bank_bytes, remaining))
                    remaining -= self.bank_bytes
                    b += 1
                self._track(nbytes)
                return off
            if nbytes > self.bank_bytes:
                if not t.psum_tensor_may_span_banks:
                    raise NkiValidationError(
                        f"{what} needs {nbytes} B/partition but a PSUM tensor may not cross a {self.bank_bytes}-byte "
                        f"bank on {t.name} (max {self.bank_bytes // 4} fp32 elements per partition)",
                        rule="psum-bank",
                        location=where,
                    )
                need = -(-nbytes // self.bank_bytes)
                for first in range(self.nbanks - need + 1):
                    if all(not self.banks[b] for b in range(first, first + need)):
                        remaining = nbytes
                        for b in range(first, first + need):
                            self.banks[b][alloc_id] = (0, min(self.bank_bytes, remaining))
                            remaining -= self.bank_bytes
                        self._track(nbytes)
                        return first * self.bank_bytes
                raise self._full(what, nbytes, where)
            for b in range(self.nbanks):
                pos = self._place_in_bank(b, nbytes)
                if pos is not None:
                    self.banks[b][alloc_id] = (pos, pos + nbytes)
                    self._track(nbytes)
                    return b * self.bank_bytes + pos
            raise self._full(what, nbytes, where)

    def _full(self, what: str, nbytes: int, where: str) -> NkiCapacityError:
        used = [sum(e - s for s, e in bank.values()) for bank in self.banks]
        return NkiCapacityError(
            f"cannot place {what} ({nbytes} B/partition) in PSUM: {self.nbanks} banks x {self.bank_bytes} B per partition, "
            f"bank usage now {used} (live PSUM tensors are freed when their last reference goes away)",
            rule="psum-capacity",
            location=where,
        )

    def _track(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        banks = sum(1 for bank in self.banks if bank)
        if banks > self.peak_banks:
            self.peak_banks = banks

    def free(self, alloc_id: int, nbytes: int) -> None:
        with self.lock:
            for bank in self.banks:
                bank.pop(alloc_id, None)
            self.live_bytes -= nbytes


class AllocRecord:
    """Liveness record of one on-chip allocation (kept after the tensor itself is gone)."""

    __slots__ = ("id", "kind", "nbytes", "address", "what", "where", "alloc_idx", "last_use")

    def __init__(self, id: int, kind: str, nbytes: int, address, what: str, where: str, idx: int):
        self.id = id
        self.kind = kind  # "sbuf" | "psum"
        self.nbytes = nbytes
        self.address = address
        self.what = what
        self.where = where
        self.alloc_idx = idx
        self.last_use = idx


class MemoryTracker:
    """Records on-chip allocations of one program and replays them with compiler-style liveness."""

    def __init__(self, target: Target, budget: int, overflow: str = "error"):
        self.target = target
        self.budget = budget
        self.overflow = overflow
        self.records: list[AllocRecord] = []
        self.sbuf_peak = 0
        self.sbuf_over_budget = 0
        self.psum_peak_bytes = 0
        self.psum_peak_banks = 0

    def new(self, kind: str, alloc_id: int, nbytes: int, address, what: str, where: str, idx: int) -> AllocRecord:
        t = self.target
        if kind == "sbuf" and (address[1] if address else 0) + nbytes > self.budget:
            raise NkiCapacityError(
                f"{what} needs {nbytes} B/partition (at byte offset {address[1] if address else 0}), more than the "
                f"usable SBUF budget of {self.budget} B/partition on {t.name} (physical {t.sbuf_bytes_per_partition} B)",
                rule="sbuf-capacity",
                location=where,
            )
        if kind == "psum":
            if address is not None and address[1] % t.psum_bank_bytes:
                raise NkiValidationError(
                    f"{what}: PSUM address byte offset {address[1]} must start on a {t.psum_bank_bytes}-byte bank "
                    f"boundary",
                    rule="psum-bank",
                    location=where,
                )
            if nbytes > t.psum_bank_bytes and not t.psum_tensor_may_span_banks:
                raise NkiValidationError(
                    f"{what} needs {nbytes} B/partition but a PSUM tensor may not cross a {t.psum_bank_bytes}-byte "
                    f"bank on {t.name} (max {t.psum_bank_bytes // 4} fp32 elements per partition)",
                    rule="psum-bank",
                    location=where,
                )
            if (address[1] if address else 0) + nbytes > t.psum_bytes_per_partition:
                raise NkiCapacityError(
                    f"{what} needs {nbytes} B/partition; PSUM has {t.psum_bytes_per_partition} B/partition",
                    rule="psum-capacity",
                    location=where,
                )
        rec = AllocRecord(alloc_id, kind, nbytes, address, what, where, idx)
        self.records.append(rec)
        return rec

    def replay(self) -> None:
        """Replay allocations/frees in instruction order; raise the first capacity violation."""
        events: list[tuple[int, int, int, AllocRecord]] = []
        for n, r in enumerate(self.records):
            events.append((r.alloc_idx, 1, n, r))
            events.append((r.last_use + 1, 0, n, r))
        events.sort(key=lambda e: (e[0], e[1], e[2]))
        sbuf = SbufAccountant(self.budget, self.target.sbuf_bytes_per_partition, self.target.name, self.overflow)
        psum = PsumAllocator(self.target)
        for _, kind, _, r in events:
            if r.kind == "sbuf":
                if kind == 1:
                    sbuf.alloc(r.id, r.nbytes, r.address, r.what, r.where)
                else:
                    sbuf.free(r.id, r.nbytes, r.address is not None)
            else:
                if kind == 1:
                    psum.alloc(r.id, r.nbytes, r.address, r.what, r.where)
                else:
                    psum.free(r.id, r.nbytes)
        self.sbuf_peak = sbuf.peak
        self.sbuf_over_budget = sbuf.over_budget_peak
        self.psum_peak_bytes = psum.peak_bytes
        self.psum_peak_banks = psum.peak_banks
