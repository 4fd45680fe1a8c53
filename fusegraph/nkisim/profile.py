"""Per-run profile: instruction/element counters per engine, DMA traffic, HBM bytes, SBUF/PSUM peaks.

The recorder is on the hot path of every instruction, so it aggregates by ``(file, line, opcode)`` and keeps
only a bounded list of individual instruction records.  :meth:`Profile.to_dict` is JSON-serialisable.
Nothing here models time: counts and bytes are what later cost models attribute time to.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")

DEFAULT_MAX_RECORDS = 2000


@dataclass
class EngineStats:
    instructions: int = 0
    elements: int = 0


@dataclass
class SiteStats:
    """All instructions issued from one kernel source line with one opcode."""

    file: str
    line: int
    opcode: str
    engine: str
    count: int = 0
    elements: int = 0
    max_partitions: int = 0
    max_free: int = 0
    dtypes: list[str] = field(default_factory=list)  # output (dst) dtypes; PSUM float32 for matmuls
    names: list[str] = field(default_factory=list)
    #: input tensor argument -> its dtypes, e.g. ``{"moving": ["bfloat16"], "stationary": ["bfloat16"]}`` for
    #: ``nc_matmul``, ``{"src": ["bfloat16"]}`` for a DMA; scalar (immediate) operands are not listed
    input_dtypes: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class DmaStats:
    """All DMAs issued from one source line with the same endpoints/queue/DGE mode/indirection."""

    file: str
    line: int
    opcode: str
    src_buffer: str
    dst_buffer: str
    src_tensor: str
    dst_tensor: str
    queue: str
    dge_mode: str
    indirect: str = ""  # "scalar" / "vector": a runtime scalar_offset / vector_offset was used (DGE); "" if not
    count: int = 0
    #: bytes the DMA moves: the mean of the bytes it reads and writes (= the size for a same-dtype copy; a bf16 ->
    #: fp32 load of N elements reads 2N, writes 4N and counts 3N)
    bytes: int = 0
    descriptors: int = 0
    partitions: int = 0
    bytes_per_partition: int = 0
    max_bytes: int = 0
    read_bytes: int = 0  # bytes read from the source(s)
    write_bytes: int = 0  # bytes written to the destination


@dataclass
class InstructionRecord:
    index: int
    program: int
    rank: int
    opcode: str
    engine: str
    partitions: int
    free: int
    elements: int
    dtype: str
    name: str
    file: str
    line: int


@dataclass
class TensorTraffic:
    kind: str  # "input", "output", "internal"
    read_bytes: int = 0
    write_bytes: int = 0


@dataclass
class Profile:
    """Counters of one kernel run (all programs and ranks together unless stated)."""

    kernel: str = ""
    target: str = ""
    lnc: int = 1
    ranks: int = 1
    shape_only: bool = False
    sbuf_budget_bytes: int = 0
    wall_time_s: float = 0.0
    engines: dict[str, EngineStats] = field(default_factory=lambda: {e: EngineStats() for e in ENGINES})
    instructions: int = 0
    dma_count: int = 0
    dma_bytes: int = 0
    dma_read_bytes: int = 0
    dma_write_bytes: int = 0
    dma_descriptors: int = 0
    hbm_read_bytes: int = 0
    hbm_write_bytes: int = 0
    hbm_by_tensor: dict[str, TensorTraffic] = field(default_factory=dict)
    peak_sbuf_bytes_per_partition: int = 0
    sbuf_over_budget_bytes: int = 0  # sbuf_overflow="compiler": the largest live demand beyond the budget (0: fits)
    peak_psum_bytes_per_partition: int = 0
    peak_psum_banks: int = 0
    peak_by_program: list[dict[str, int]] = field(default_factory=list)
    sites: list[SiteStats] = field(default_factory=list)
    dmas: list[DmaStats] = field(default_factory=list)
    records: list[InstructionRecord] = field(default_factory=list)
    records_dropped: int = 0
    #: ``nki.collectives`` per rank, program and call site: op, reduce, buffer (hbm/sbuf), dtype, group, group_size,
    #: tensors, collective_dim, count, bytes (this rank's sources) and out_bytes (its destinations)
    collectives: list[dict[str, Any]] = field(default_factory=list)
    #: ``run(trace=True)``: ``{(rank, program): [TraceEvent, ...]}`` (see :mod:`fusegraph.nkisim.trace`); a class
    #: default, set per instance, so it stays out of the dataclass fields and of ``to_dict()``
    trace: ClassVar[dict[tuple[int, int], list] | None] = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def engine(self, name: str) -> EngineStats:
        return self.engines[name]

    def named(self, suffix: str, opcode: str | None = None) -> list[SiteStats]:
        """The sites of the instructions whose ``name=`` ends with ``suffix`` (and whose opcode is ``opcode``, when
        given). A site is one source line and opcode; it matches when one of its recorded names does (a site keeps
        at most 16 names, which is every name of a generated kernel's line: one ``name=`` per call)."""
        return [s for s in self.sites
                if (opcode is None or s.opcode == opcode) and any(n.endswith(suffix) for n in s.names)]

    def executions(self, suffix: str | None = None, opcode: str | None = None) -> int:
        """How many instructions ran (all programs and ranks) with a ``name=`` ending in ``suffix`` (any name when
        None) and, when given, opcode ``opcode``; what a kernel did, independent of how its source spells it."""
        sites = self.sites if suffix is None else self.named(suffix)
        return sum(s.count for s in sites if opcode is None or s.opcode == opcode)

    def named_dmas(self, suffix: str) -> list[DmaStats]:
        """The DMA aggregates (:class:`DmaStats`: bytes, descriptors, endpoints, indirection) issued from the source
        lines of the instructions whose ``name=`` ends with ``suffix``."""
        where = {(s.file, s.line) for s in self.named(suffix)}
        return [d for d in self.dmas if (d.file, d.line) in where]

    def counters(self) -> dict[str, Any]:
        """The data-independent counters (used to compare shape-only and data runs)."""
        return {
            "engines": {k: (v.instructions, v.elements) for k, v in self.engines.items()},
            "instructions": self.instructions,
            "dma_count": self.dma_count,
            "dma_bytes": self.dma_bytes,
            "dma_read_bytes": self.dma_read_bytes,
            "dma_write_bytes": self.dma_write_bytes,
            "dma_descriptors": self.dma_descriptors,
            "hbm_read_bytes": self.hbm_read_bytes,
            "hbm_write_bytes": self.hbm_write_bytes,
            "hbm_by_tensor": {k: asdict(v) for k, v in sorted(self.hbm_by_tensor.items())},
            "peak_sbuf_bytes_per_partition": self.peak_sbuf_bytes_per_partition,
            "sbuf_over_budget_bytes": self.sbuf_over_budget_bytes,
            "peak_psum_bytes_per_partition": self.peak_psum_bytes_per_partition,
            "sites": sorted((s.file, s.line, s.opcode, s.count, s.elements) for s in self.sites),
            "collectives": [(c["rank"], c["program"], c["line"], c["op"], c["group_size"], c["count"], c["bytes"])
                            for c in self.collectives],
        }

    def summary(self) -> str:
        lines = [
            f"kernel {self.kernel} on {self.target} (lnc={self.lnc}, ranks={self.ranks}, shape_only={self.shape_only}): "
            f"{self.instructions} instructions in {self.wall_time_s:.3f}s"
        ]
        for name, st in self.engines.items():
            lines.append(f"  {name:7s} {st.instructions:9d} instr {st.elements:14d} elements")
        lines.append(
            f"  DMA: {self.dma_count} transfers, {self.dma_bytes} bytes, ~{self.dma_descriptors} descriptors; "
            f"HBM read {self.hbm_read_bytes} B, write {self.hbm_write_bytes} B"
        )
        lines.append(
            f"  peak SBUF {self.peak_sbuf_bytes_per_partition} B/partition (budget {self.sbuf_budget_bytes}), "
            f"peak PSUM {self.peak_psum_bytes_per_partition} B/partition ({self.peak_psum_banks} banks)"
        )
        if self.sbuf_over_budget_bytes:
            lines.append(f"  SBUF over budget: {self.sbuf_over_budget_bytes} B/partition live at most, accepted "
                         f"(sbuf_overflow='compiler': neuronx-cc's allocator spills; the spill is not modeled)")
        for c in self.collectives:
            lines.append(f"  collective rank {c['rank']} program {c['program']}: {c['count']} x {c['op']} "
                         f"({c['buffer']}, group of {c['group_size']}), {c['bytes']} B in, {c['out_bytes']} B out "
                         f"(line {c['line']})")
        return "\n".join(lines)


class Recorder:
    """Collects counters for one program of one rank; merged into a :class:`Profile` at the end of a run."""

    __slots__ = (
        "program",
        "rank",
        "engines",
        "sites",
        "dmas",
        "records",
        "max_records",
        "dropped",
        "count",
        "hbm",
        "dma_count",
        "dma_bytes",
        "dma_read",
        "dma_write",
        "dma_desc",
        "tracer",
    )

    def __init__(self, program: int = 0, rank: int = 0, max_records: int = DEFAULT_MAX_RECORDS, tracer: Any = None):
        self.program = program
        self.rank = rank
        self.engines: dict[str, list[int]] = {e: [0, 0] for e in ENGINES}
        self.sites: dict[tuple, list] = {}
        self.dmas: dict[tuple, list] = {}
        self.records: list[InstructionRecord] = []
        self.max_records = max_records
        self.dropped = 0
        self.count = 0
        self.hbm: dict[str, list] = {}  # label -> [kind, read, write]
        self.dma_count = 0
        self.dma_bytes = 0
        self.dma_read = 0
        self.dma_write = 0
        self.dma_desc = 0
        self.tracer = tracer  # a fusegraph.nkisim.trace.Tracer when the run traces every instruction

    def instr(
        self,
        site: tuple[str, int],
        opcode: str,
        engine: str,
        partitions: int,
        free: int,
        dtype: str,
        name: str | None,
        inputs: tuple = (),
    ) -> None:
        """Count one instruction; ``inputs`` is ``((argument, dtype), ...)`` of its input tensors."""
        elements = partitions * free
        e = self.engines[engine]
        e[0] += 1
        e[1] += elements
        key = (site[0], site[1], opcode, engine)
        s = self.sites.get(key)
        if s is None:
            s = self.sites[key] = [0, 0, 0, 0, set(), set(), set()]
        s[0] += 1
        s[1] += elements
        if partitions > s[2]:
            s[2] = partitions
        if free > s[3]:
            s[3] = free
        s[4].add(dtype)
        if name:
            s[5].add(name)
        if inputs:
            s[6].add(inputs)
        idx = self.count
        self.count += 1
        if len(self.records) < self.max_records:
            self.records.append(
                InstructionRecord(
                    idx, self.program, self.rank, opcode, engine, partitions, free, elements, dtype, name or "",
                    site[0], site[1],
                )
            )
        else:
            self.dropped += 1
        if self.tracer is not None:
            self.tracer.event(idx, site, opcode, engine, partitions, free, dtype, name, inputs)

    def dma(
        self,
        site: tuple[str, int],
        opcode: str,
        src: tuple[str, str],
        dst: tuple[str, str],
        queue: str,
        dge: str,
        nbytes: int,
        partitions: int,
        descriptors: int,
        indirect: str = "",
        read_bytes: int | None = None,
        write_bytes: int | None = None,
    ) -> None:
        """Count one DMA; ``nbytes`` is what it moves (see :attr:`DmaStats.bytes`), ``read_bytes``/``write_bytes``
        (default ``nbytes``) what it reads from its source(s) and writes to its destination."""
        rd = nbytes if read_bytes is None else read_bytes
        wr = nbytes if write_bytes is None else write_bytes
        self.dma_count += 1
        self.dma_bytes += nbytes
        self.dma_read += rd
        self.dma_write += wr
        self.dma_desc += descriptors
        key = (site[0], site[1], opcode, src[0], dst[0], src[1], dst[1], queue, dge, indirect)
        d = self.dmas.get(key)
        if d is None:
            d = self.dmas[key] = [0, 0, 0, 0, 0, 0, 0, 0]
        d[0] += 1
        d[1] += nbytes
        d[2] += descriptors
        d[3] = max(d[3], partitions)
        d[4] = max(d[4], nbytes // max(partitions, 1))
        d[5] = max(d[5], nbytes)
        d[6] += rd
        d[7] += wr
        if self.tracer is not None:
            self.tracer.pending_dma = {
                "bytes": nbytes, "read_bytes": rd, "write_bytes": wr, "partitions": partitions,
                "descriptors": descriptors, "queue": queue, "dge_mode": dge, "indirect": indirect,
                "src_buffer": src[0], "dst_buffer": dst[0], "src_tensor": src[1], "dst_tensor": dst[1],
            }

    def hbm_traffic(self, label: str, kind: str, read: int = 0, write: int = 0) -> None:
        t = self.hbm.get(label)
        if t is None:
            t = self.hbm[label] = [kind, 0, 0]
        t[1] += read
        t[2] += write


_lock = threading.Lock()
_last: Profile | None = None


_listeners: list = []


def add_listener(fn) -> None:
    """Call ``fn(profile)`` after every kernel run (used by the CLI to collect all profiles)."""
    with _lock:
        _listeners.append(fn)


def remove_listener(fn) -> None:
    with _lock:
        if fn in _listeners:
            _listeners.remove(fn)


def set_last(profile: Profile) -> None:
    global _last
    with _lock:
        _last = profile
        listeners = list(_listeners)
    for fn in listeners:
        fn(profile)


def last_profile() -> Profile:
    """Profile of the most recent kernel run in this process."""
    with _lock:
        if _last is None:
            raise LookupError("no NKI kernel has been run yet")
        return _last


def merge(recorders: list[Recorder], profile: Profile) -> Profile:
    """Fold per-program recorders into ``profile`` (in place) and return it."""
    sites: dict[tuple, SiteStats] = {}
    dmas: dict[tuple, DmaStats] = {}
    records: list[InstructionRecord] = []
    for r in recorders:
        for eng, (n, el) in r.engines.items():
            st = profile.engines[eng]
            st.instructions += n
            st.elements += el
        profile.instructions += r.count
        profile.dma_count += r.dma_count
        profile.dma_bytes += r.dma_bytes
        profile.dma_read_bytes += r.dma_read
        profile.dma_write_bytes += r.dma_write
        profile.dma_descriptors += r.dma_desc
        _merge_sites(r, sites)
        _merge_dmas(r, dmas)
        for label, (kind, rd, wr) in r.hbm.items():
            t = profile.hbm_by_tensor.get(label)
            if t is None:
                t = profile.hbm_by_tensor[label] = TensorTraffic(kind)
            t.read_bytes += rd
            t.write_bytes += wr
            profile.hbm_read_bytes += rd
            profile.hbm_write_bytes += wr
        records.extend(r.records)
        profile.records_dropped += r.dropped
    profile.sites = sorted(sites.values(), key=lambda s: (s.file, s.line, s.opcode))
    profile.dmas = sorted(dmas.values(), key=lambda d: (d.file, d.line, d.opcode))
    records.sort(key=lambda rec: (rec.rank, rec.program, rec.index))
    profile.records = records
    traces = {(r.rank, r.program): r.tracer.events for r in recorders if r.tracer is not None}
    if traces:
        profile.trace = traces
    return profile


def _merge_sites(r: Recorder, sites: dict[tuple, SiteStats]) -> None:
    """Add one recorder's per-site instruction counters to ``sites`` (the same source line of every program
    is one site: counts add up, sizes take the maximum, dtypes and names are unioned)."""
    for (file, line, opcode, engine), (cnt, el, mp, mf, dts, nms, ins) in r.sites.items():
        key = (file, line, opcode, engine)
        s = sites.get(key)
        if s is None:
            s = sites[key] = SiteStats(file, line, opcode, engine)
        s.count += cnt
        s.elements += el
        s.max_partitions = max(s.max_partitions, mp)
        s.max_free = max(s.max_free, mf)
        s.dtypes = sorted(set(s.dtypes) | dts)
        s.names = sorted(set(s.names) | nms)[:16]
        if ins:
            by_arg: dict[str, set] = {a: set(v) for a, v in s.input_dtypes.items()}
            for pairs in ins:
                for arg, dtype in pairs:
                    by_arg.setdefault(arg, set()).add(dtype)
            s.input_dtypes = {a: sorted(v) for a, v in sorted(by_arg.items())}


def _merge_dmas(r: Recorder, dmas: dict[tuple, DmaStats]) -> None:
    """Add one recorder's per-site DMA counters to ``dmas`` (counts and bytes add up, sizes take the maximum)."""
    for key, (cnt, nb, desc, parts, bpp, mx, rd, wr) in r.dmas.items():
        d = dmas.get(key)
        if d is None:
            file, line, opcode, sb, db, sl, dl, q, dge, ind = key
            d = dmas[key] = DmaStats(file, line, opcode, sb, db, sl, dl, q, dge, ind)
        d.count += cnt
        d.bytes += nb
        d.descriptors += desc
        d.partitions = max(d.partitions, parts)
        d.bytes_per_partition = max(d.bytes_per_partition, bpp)
        d.max_bytes = max(d.max_bytes, mx)
        d.read_bytes += rd
        d.write_bytes += wr
