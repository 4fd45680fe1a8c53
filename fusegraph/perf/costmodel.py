"""Turn an interpreter profile into time: per-instruction engine costs, DMA costs, and a dependency schedule.

Why a schedule and not a sum: in a decode megakernel the engines overlap (weights stream while the Tensor engine
multiplies), but the compute is a dependency chain (norm -> projection -> RoPE -> attention -> ...), DMAs wait on
ring buffers and on values computed in the kernel (expert ids), and every hand-off between engines costs a
semaphore. A list schedule of the kernel's lines in program order — each engine in order, every line starting
when its engine is free and its inputs are ready — captures exactly those effects with nothing but the
sourced per-instruction costs. The same scheduler runs the baselines: with barriers between regions (one
kernel per region or per op) instead of one stream.

Costs per instruction (parameters in ``data/trainium.json``):

* Tensor engine: ``max(N, pe_min_cycles)`` cycles per matmul/transpose (N = moving free size), x4 for fp32.
* Vector/Scalar/GpSimd: ``engine_fixed_cycles + inputs * N * 128 / width`` cycles (N = free size per partition);
  two back-to-back dependent instructions on one engine start at least ``dependent_ii_cycles`` apart.
* DMA: an issue cost on the issuing engine (hardware DGE on Sync/Scalar, software DGE on GpSimd), a fixed
  latency before data moves (overlappable with the transfers already moving, by ``dma_latency_overlap``), and bytes / (per-core bandwidth x eff(s)) of the core's DMA
  bandwidth, with ``eff(s) = s / (s + s0)`` for ``s`` contiguous bytes per descriptor; a transfer also takes at
  least bytes / (engines it spans x per-engine bandwidth).
* Collectives (``nki.collectives``): ``steps x cc_step_latency + wire bytes / link bandwidth`` of a ring over the
  group's n ranks -- all-reduce 2(n-1) steps moving 2(n-1)/n of the buffer, all-gather / reduce-scatter /
  all-to-all n-1 steps moving (n-1)/n of the larger side -- on the collective engine (the chip's CC-cores), an
  in-order resource of its own: a collective overlaps compute and DMAs and delays only what reads its result.

"DMA active" in a hardware profile is time with any DMA in flight: :meth:`Schedule.dma_active` (the union of each
DMA's window from its trigger to its last byte), not the bandwidth occupancy ``busy["dma"]``.
"""
from __future__ import annotations

import logging
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from .hwloops import BARRIER_KIND, drain_after, unroll_hardware_loops
from .kernelview import KernelLine, KernelView
from .params import HardwareParams

log = logging.getLogger(__name__)

COMPUTE_ENGINES = ("tensor", "vector", "scalar", "gpsimd")
ENGINES = COMPUTE_ENGINES + ("sync",)
ENGINE_LABELS = {
    "tensor": "PE (Tensor)",
    "vector": "DVE (Vector)",
    "scalar": "ACT (Scalar)",
    "gpsimd": "POOL (GpSimd)",
    "sync": "SP (Sync: DMA issue, barriers)",
    "dma": "DMA queues",
    "cc": "CC (collectives: CC-cores / DMA rings)",
    "loop": "hardware-loop drain + cross-engine barrier",
}
#: the ``nki.collectives`` operations the model costs as ring collectives
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
TWO_INPUT_OPS = frozenset({"tensor_tensor", "scalar_tensor_tensor", "tensor_tensor_scan", "tensor_copy_predicated",
                           "select_reduce", "range_select"})
PERF_MODE_OPS = frozenset({"tensor_copy", "tensor_scalar"})
#: register instructions: one 32-bit value, no vector of data. Priced at an engine instruction's static overhead
#: (``engine_fixed_cycles``, O9) and nothing per element -- an assumption: no register-instruction cost is
#: documented. ``register_move`` (dst = an immediate or another register) included like the loads and stores.
REGISTER_OPS = frozenset({"register_load", "register_store", "register_move"})
SIXTEEN_BIT = frozenset({"bfloat16", "float16"})
BOUNDS = ("compute", "memory", "dma-overhead", "sync", "collective")
_TEMPLATE = re.compile(r"^L\d+\.")


def template_name(name: str) -> str:
    """``L12.experts.experts.t0k3.gu.w4`` -> ``L*.experts.experts.t#k#.gu.w#`` (same line of every layer/chunk)."""
    name = _TEMPLATE.sub("L*.", name or "")
    name = re.sub(r"\.t\d+k\d+\.", ".t#k#.", name)
    return re.sub(r"\.w\d+$", ".w#", name)


@dataclass
class Work:
    """One schedulable unit: a kernel line (all its executions) or a piece of a baseline's per-op kernel."""

    index: int
    kind: str  # "compute" | "dma" | "cc" (a collective)
    engine: str  # compute engine, or the engine that issues the DMA
    opcode: str
    count: int
    busy: float  # seconds: compute-engine time, or DMA issue time on the issuing engine
    region: str
    layer: int | None
    name: str = ""
    line: int | None = None
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    partial: bool = False
    loops: tuple[int, ...] = ()
    dep_ii: float = 0.0  # minimum start distance after a dependent instruction on the same engine
    # DMA only
    nbytes: int = 0
    occupancy: float = 0.0  # seconds of the core's DMA bandwidth used
    own: float = 0.0  # shortest possible duration of the transfer(s) (engines spanned)
    latency: float = 0.0
    ideal: float = 0.0  # nbytes at the full per-core DMA bandwidth
    hbm_read: int = 0
    hbm_write: int = 0
    bytes_per_partition: float = 0.0
    descriptor_bytes: float = 0.0
    efficiency: float = 1.0
    tensor: str = ""  # HBM tensor moved (for attribution)
    # collectives only
    collective: dict[str, Any] | None = None  # op, group_size, link, steps, wire bytes, latency / transfer seconds
    # hardware-loop copies only (fusegraph.perf.hwloops): drained iterations this work stands for (each pays its
    # cross-engine semaphores again), and the copy's number (-1: not in a hardware loop)
    repeats: float = 1.0
    hw_copy: int = -1

    @property
    def per_instr(self) -> float:
        return self.busy / max(1, self.count)

    @property
    def cost(self) -> float:
        """Time this work occupies its busiest resource (issue engine or DMA bandwidth for transfers)."""
        return max(self.busy, self.occupancy)


# ---- per-instruction costs ------------------------------------------------------------------------------------
def _engine_rate(hw: HardwareParams, engine: str, opcode: str, sixteen: bool) -> tuple[float, float]:
    """(clock Hz, elements per cycle across the 128 lanes) of a Vector/Scalar/GpSimd instruction."""
    if engine == "vector":
        width = hw.dve_elems_per_cycle_perf if (opcode in PERF_MODE_OPS and sixteen) else hw.dve_elems_per_cycle
        return hw.dve_clock, width
    if engine == "scalar":
        return hw.act_clock, hw.act_elems_per_cycle_16bit if sixteen else hw.act_elems_per_cycle
    return hw.pool_clock, hw.pool_elems_per_cycle


def instruction_time(hw: HardwareParams, engine: str, opcode: str, partitions: int, free: float,
                     dtypes: Iterable[str] = (), fp32_inputs: bool = False) -> tuple[float, float]:
    """(seconds per instruction, dependent-issue interval) of one engine instruction with ``free`` elements/partition."""
    if engine == "tensor":
        cycles = max(free, hw.pe_min_cycles) * (hw.pe_fp32_factor if fp32_inputs else 1)
        return cycles / hw.pe_clock, 0.0
    dts = set(dtypes)
    sixteen = bool(dts) and dts <= SIXTEEN_BIT
    clock, width = _engine_rate(hw, engine, opcode, sixteen)
    if opcode in REGISTER_OPS:
        return hw.engine_fixed_cycles / clock, hw.dependent_ii_cycles / clock
    inputs = 2 if opcode in TWO_INPUT_OPS else 1
    cycles = hw.engine_fixed_cycles + inputs * free * 128.0 / width
    return cycles / clock, hw.dependent_ii_cycles / clock


def dma_efficiency(hw: HardwareParams, contiguous_bytes: float) -> float:
    s = max(1.0, contiguous_bytes)
    return s / (s + hw.dma_efficiency_s0)


def dma_issue(hw: HardwareParams, dge: str, queue: str, indirect: str | None) -> tuple[str, float]:
    """(issuing engine, seconds per DMA instruction)."""
    if dge == "swdge" or indirect == "vector" or queue == "gpsimd":
        return "gpsimd", hw.dma_issue_swdge
    if dge == "hwdge" and queue == "scalar":
        return "scalar", hw.dma_issue_hwdge
    if dge in ("hwdge",):
        return "sync", hw.dma_issue_hwdge
    mode = hw.dma_default_trigger  # unknown / none: the compiler chooses
    if mode == "swdge_gpsimd":
        return "gpsimd", hw.dma_issue_swdge
    if mode == "hwdge_scalar":
        return "scalar", hw.dma_issue_hwdge
    return "sync", hw.dma_issue_hwdge


def dma_transfer(hw: HardwareParams, nbytes: float, count: int, partitions: int, descriptors: float) -> dict[str, float]:
    """Bandwidth occupancy, own duration and efficiency of ``count`` DMAs moving ``nbytes`` in total."""
    count = max(1, count)
    per_dma = nbytes / count
    p = max(1, partitions)
    bpp = per_dma / p
    run = nbytes / max(1.0, descriptors) if descriptors else bpp
    s = min(run, bpp) if bpp >= 1 else run
    eff = dma_efficiency(hw, s)
    occupancy = nbytes / (hw.dma_bandwidth_core * eff)
    engines = min(hw.dma_engines_per_core, math.ceil(p / hw.dma_partitions_per_engine))
    own = per_dma / (engines * hw.dma_bandwidth_engine * eff)
    return {"occupancy": occupancy, "own": max(own, occupancy), "efficiency": eff, "bytes_per_partition": bpp,
            "descriptor_bytes": s, "ideal": nbytes / hw.dma_bandwidth_core}


def _transposed(tr: dict[str, float], efficiency: float) -> dict[str, float]:
    """A plain transfer's figures for a DMA transpose: occupancy and duration divided by its throughput fraction."""
    return {**tr, "occupancy": tr["occupancy"] / efficiency, "own": tr["own"] / efficiency,
            "efficiency": tr["efficiency"] * efficiency}


# ---- collectives -------------------------------------------------------------------------------------------------
def ring_steps_and_factor(op: str, n: int) -> tuple[int, float]:
    """(ring steps, wire bytes per byte of the op's buffer) of a ring collective over ``n`` ranks.

    The buffer is the all-reduce's input (= output), the all-gather's *output*, the reduce-scatter's *input* and
    the all-to-all's input: all-reduce is a reduce-scatter followed by an all-gather, 2(n-1) steps moving
    2(n-1)/n of it; the others take n-1 steps and move (n-1)/n of it (``neuron-runtime/explore/
    intranode-collective-comm.rst``, "Ring AllReduce ... requires the ring to be traversed twice")."""
    if n <= 1:
        return 0, 0.0
    if op == "all_reduce":
        return 2 * (n - 1), 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1, (n - 1) / n
    raise ValueError(f"not a collective the model costs: {op!r}")


def ranks_per_chip(hw: HardwareParams, lnc: int) -> int:
    """Ranks (logical cores) per chip: 8 physical cores at LNC=1, 4 at LNC=2 (H1, H12)."""
    return max(1, int(hw.physical_cores_per_chip) // max(1, int(lnc)))


def spans_chips(hw: HardwareParams, group: Sequence[int], lnc: int) -> bool:
    """Whether ranks ``group`` sit on more than one chip, with ranks numbered chip by chip (rank r on chip
    r // ranks_per_chip: the numbering of a one-node job, our assumption)."""
    per = ranks_per_chip(hw, lnc)
    return len({int(r) // per for r in group}) > 1


def collective_time(hw: HardwareParams, op: str, group_size: int, nbytes: float, out_bytes: float | None = None,
                    chip_to_chip: bool = False) -> dict[str, Any]:
    """Modeled time of one collective: ``steps x cc_step_latency + wire bytes / bandwidth``.

    ``nbytes``: the rank's source bytes, ``out_bytes``: its destination bytes (default: the same). The link is the
    core's DMA bandwidth on the chip (``cc_bandwidth_intra_chip``, C15) or, for a group across chips, the chip's
    NeuronLink shared by its physical cores (``cc_bandwidth_chip_to_chip / physical_cores_per_chip``, H9, H1),
    whichever is lower."""
    out_bytes = nbytes if out_bytes is None else out_bytes
    steps, factor = ring_steps_and_factor(op, int(group_size))
    buffer = max(nbytes, out_bytes) if op in ("all_gather", "reduce_scatter") else nbytes
    wire = factor * buffer
    bw = hw.cc_bandwidth_intra_chip
    link = "intra-chip"
    if chip_to_chip:
        bw = min(bw, hw.cc_bandwidth_chip_to_chip / hw.physical_cores_per_chip)
        link = "chip-to-chip"
    latency = steps * hw.cc_step_latency
    transfer = wire / bw if wire else 0.0
    return {"op": op, "group_size": int(group_size), "steps": steps, "factor": factor, "wire_bytes": wire,
            "bandwidth": bw, "link": link, "latency_s": latency, "transfer_s": transfer,
            "seconds": latency + transfer}


def _collective_work(hw: HardwareParams, ln: KernelLine, index: int) -> Work | None:
    """A kernel line of ``nki.collectives`` calls (its DMAs carry the interpreter's ``collective`` record)."""
    infos = [(d, d.get("collective")) for d in ln.dmas]
    if not infos or any(c is None for _, c in infos):
        return None
    total = 0.0
    nbytes = 0
    count = 0
    first: dict[str, Any] | None = None
    for d, c in infos:
        n = max(1, int(d.get("count", 1)))
        chip = spans_chips(hw, c.get("group") or range(c["group_size"]), c.get("lnc", 1))
        t = collective_time(hw, c["op"], c["group_size"], c["bytes"], c.get("out_bytes"), chip)
        total += n * t["seconds"]
        nbytes += n * c["bytes"]
        count += n
        first = first or {**t, "buffer": c.get("buffer"), "bytes": c["bytes"], "out_bytes": c.get("out_bytes")}
    return Work(index, "cc", "cc", ln.opcode, count, total, ln.region, ln.layer, ln.name, ln.line, ln.reads,
                ln.writes, ln.partial_write, ln.loops, nbytes=nbytes, collective=first)


_WARNED_CC: set[str] = set()


def collectives_report(profile: Any, hw: HardwareParams) -> dict[str, Any]:
    """Per rank, program and call site: the collectives the interpreter profiled (``Profile.collectives``) with
    their bytes and modeled time (not scheduled: the time each takes on its own), plus totals per rank.

    ``{"rows": [{rank, program, file, line, op, buffer, group_size, count, bytes, out_bytes, link, steps,
    wire_bytes, seconds_each, seconds}, ...], "per_rank": {rank: {"count", "bytes", "seconds"}}}``"""
    prof = profile if isinstance(profile, dict) else profile.to_dict()
    lnc = prof.get("lnc", 1)
    rows = []
    per_rank: dict[int, dict[str, float]] = {}
    for c in prof.get("collectives", []):
        n = max(1, c["count"])
        t = collective_time(hw, c["op"], c["group_size"], c["bytes"] / n, c["out_bytes"] / n,
                            spans_chips(hw, c["group"], lnc))
        row = {**c, "link": t["link"], "steps": t["steps"], "wire_bytes": t["wire_bytes"] * n,
               "seconds_each": t["seconds"], "seconds": t["seconds"] * n}
        rows.append(row)
        tot = per_rank.setdefault(c["rank"], {"count": 0, "bytes": 0, "seconds": 0.0})
        tot["count"] += c["count"]
        tot["bytes"] += c["bytes"]
        tot["seconds"] += row["seconds"]
    return {"target": hw.target, "rows": rows, "per_rank": per_rank}


def _is_hbm(buffer: str) -> bool:
    return "hbm" in (buffer or "")


def line_work(hw: HardwareParams, ln: KernelLine, index: int) -> Work:
    """Cost one kernel line."""
    if ln.dmas and any(d.get("queue") == "cc" for d in ln.dmas):
        w = _collective_work(hw, ln, index)
        if w is not None:
            return w
        if ln.opcode not in _WARNED_CC:
            _WARNED_CC.add(ln.opcode)
            log.warning("collective %s at line %s has no group record (a profile from before the interpreter recorded "
                        "collectives?): costed as a DMA", ln.opcode, ln.line)
    if ln.dmas:
        count = sum(d["count"] for d in ln.dmas)
        nbytes = sum(d["bytes"] for d in ln.dmas)
        desc = sum(d["descriptors"] for d in ln.dmas)
        parts = max(d["partitions"] for d in ln.dmas)
        d0 = max(ln.dmas, key=lambda d: d["bytes"])
        engine, per = dma_issue(hw, d0["dge_mode"], d0["queue"], ln.indirect)
        if ln.indirect == "scalar":  # a runtime offset: its register load and descriptor build on the issuing engine
            per += hw.dma_runtime_offset_issue
        tr = dma_transfer(hw, nbytes, count, parts, desc)
        if ln.opcode == "dma_transpose":  # O6: a transposing DMA moves its bytes at a fraction of the throughput
            tr = _transposed(tr, hw.dma_transpose_efficiency_hbm if _is_hbm(d0["src_buffer"])
                             else hw.dma_transpose_efficiency_sbuf)
        hbm_r = sum(d.get("read_bytes", d["bytes"]) for d in ln.dmas if _is_hbm(d["src_buffer"]))
        hbm_w = sum(d.get("write_bytes", d["bytes"]) for d in ln.dmas if _is_hbm(d["dst_buffer"]))
        tensor = d0["src_tensor"] if _is_hbm(d0["src_buffer"]) else d0["dst_tensor"]
        return Work(index, "dma", engine, ln.opcode, count, count * per, ln.region, ln.layer, ln.name, ln.line,
                    ln.reads, ln.writes, ln.partial_write, ln.loops, nbytes=nbytes, occupancy=tr["occupancy"],
                    own=tr["own"], latency=hw.dma_fixed_latency, ideal=tr["ideal"], hbm_read=hbm_r, hbm_write=hbm_w,
                    bytes_per_partition=tr["bytes_per_partition"], descriptor_bytes=tr["descriptor_bytes"],
                    efficiency=tr["efficiency"], tensor=tensor)
    busy = 0.0
    dep_ii = 0.0
    count = 0
    engine = ln.sites[0]["engine"] if ln.sites else "vector"
    for s in ln.sites:
        n = max(1, s["count"])
        parts = max(1, s["max_partitions"])
        free = s["elements"] / n / parts
        # the interpreter's operand dtypes: for a matmul the stationary/moving inputs (its dst is fp32 PSUM)
        inputs = [dt for dts in (s.get("input_dtypes") or {}).values() for dt in dts]
        fp32_in = "float32" in inputs
        per, ii = instruction_time(hw, s["engine"], s["opcode"], parts, free, list(s.get("dtypes") or []) + inputs,
                                   fp32_in)
        busy += per * n
        dep_ii = max(dep_ii, ii)
        if s["engine"] == engine:
            count = max(count, n)
    return Work(index, "compute", engine, ln.opcode, max(count, 1), busy, ln.region, ln.layer, ln.name, ln.line,
                ln.reads, ln.writes, ln.partial_write, ln.loops, dep_ii=dep_ii)


def kernel_works(hw: HardwareParams, view: KernelView) -> list[Work]:
    return [line_work(hw, ln, i) for i, ln in enumerate(view.lines)]


# ---- the schedule ---------------------------------------------------------------------------------------------
@dataclass
class RegionIO:
    """Activations a region reads from / writes to HBM when it is its own kernel (hybrid baseline)."""

    loads: list[tuple[int, int]] = field(default_factory=list)  # (bytes, partitions)
    stores: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Schedule:
    """Start/ready time of every work item and the aggregates reports need."""

    works: list[Work]
    start: list[float]
    ready: list[float]
    exposure: list[float]  # how far each work pushed the end of the step (sums to the makespan)
    makespan: float
    busy: dict[str, float]  # per engine (compute engines, sync, and "dma" = bandwidth occupancy)
    barriers: int = 0
    barrier_time: float = 0.0
    semaphore_waits: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    #: per DMA work: (trigger issued, last byte landed) -- the window in which it is in flight
    dma_windows: dict[int, tuple[float, float]] = field(default_factory=dict)

    def dma_active(self, indices: Iterable[int] | None = None) -> float:
        """Time with at least one DMA in flight (union of the windows of ``indices``, default all): the profiler's
        "DMA active", which is not the bandwidth occupancy (``busy["dma"]``) -- overlapping transfers count once
        and the fixed latency of a transfer in flight counts."""
        keys = self.dma_windows.keys() if indices is None else [i for i in indices if i in self.dma_windows]
        return union_length(self.dma_windows[i] for i in keys)


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (``(start, end)`` pairs; overlaps count once)."""
    total = 0.0
    end = -math.inf
    start = 0.0
    for a, b in sorted(intervals):
        if a > end:
            if end > -math.inf:
                total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    if end > -math.inf:
        total += end - start
    return total


def _shares_loop(a: Work, b: Work) -> int:
    """Trip-count proxy when ``a`` and ``b`` sit in one loop body (0 when not)."""
    if a.loops and b.loops and a.loops[0] == b.loops[0]:
        return max(1, min(a.count, b.count))
    return 0


def schedule(works: Sequence[Work], hw: HardwareParams, *, buffers: dict[str, str] | None = None,
             allocs: dict[int, list] | None = None, barriers: bool = False,
             region_io: dict[str, RegionIO] | None = None) -> Schedule:
    """List-schedule ``works`` in order.

    With ``barriers``, every change of ``region`` is a kernel boundary: everything drains, the boundary costs
    ``boundary_wall`` of wall time and ``boundary_sync`` of Sync-engine time (both measured per boundary, O1:
    they include the activations' store and reload triggers and latencies), the next kernel loads its input
    activations (``region_io``: their bytes on the DMA bandwidth) before computing and stores its outputs before
    the next boundary.
    """
    return _Scheduler(works, hw, buffers or {}, allocs or {}, barriers, region_io or {}).run()


class _Scheduler:
    """The state of one list-scheduling pass: when each engine, the DMA bandwidth ("pipe") and the step's
    critical path ("frontier") are next free, and who last wrote / read each variable.

    One object instead of closures over a dozen locals, so each step of placing a work item (kernel boundary,
    dependencies, placement by kind, bookkeeping) is a method of its own."""

    def __init__(self, works: Sequence[Work], hw: HardwareParams, buffers: dict[str, str], allocs: dict[int, list],
                 barriers: bool, region_io: dict[str, RegionIO]) -> None:
        self.works = works
        self.hw = hw
        self.buffers = buffers
        self.allocs = allocs
        self.barriers = barriers
        self.region_io = region_io
        self.free = {e: 0.0 for e in ENGINES + ("cc",)}
        self.pipe = 0.0
        self.start = [0.0] * len(works)
        self.ready = [0.0] * len(works)
        self.first = [0.0] * len(works)
        self.exposure = [0.0] * len(works)
        self.busy: dict[str, float] = defaultdict(float)
        self.writers: dict[str, list[int]] = defaultdict(list)
        self.readers: dict[str, list[int]] = defaultdict(list)
        self.frontier = 0.0
        self.sem_total = 0.0
        self.n_barriers = 0
        self.barrier_time = 0.0
        self.current_region: str | None = None
        self.region_end = 0.0
        self.windows: dict[int, tuple[float, float]] = {}

    def run(self) -> Schedule:
        """Place every work item in order, then close the last kernel (with ``barriers``)."""
        for i, w in enumerate(self.works):
            if self.barriers and w.region != self.current_region:
                self._enter_region(i, w)
            self._new_tensors(i)
            earliest, end_floor = self._dependencies(i, w)
            if w.kind == BARRIER_KIND:
                self._place_barrier(i, w)
            elif w.kind in ("compute", "cc"):
                self._place_engine(i, w, earliest, end_floor)
            else:
                self._place_dma(i, w, earliest, end_floor)
            self._record_access(i, w)
            self.exposure[i] = max(0.0, self.ready[i] - self.frontier)
            self.frontier = max(self.frontier, self.ready[i])
            self.region_end = max(self.region_end, self.ready[i])
        if self.barriers and self.current_region is not None:
            t = self._close_region(self.current_region)
            if t > self.frontier and self.works:
                self.exposure[-1] += t - self.frontier
                self.frontier = t
        return Schedule(list(self.works), self.start, self.ready, self.exposure, self.frontier, dict(self.busy),
                        self.n_barriers, self.barrier_time, self.sem_total, dma_windows=self.windows)

    # ---- kernel boundaries (hybrid baseline) ----
    def _dma_slot(self, t_start: float, nbytes: int, parts: int) -> float:
        """An activation moved across a kernel boundary: its bytes use the DMA bandwidth; its trigger and fixed
        latency are part of the boundary's measured cost (``boundary_sync`` on Sync, ``boundary_wall``: O1), so
        they are not charged again here."""
        tr = dma_transfer(self.hw, nbytes, 1, parts, max(1, parts))
        t0 = max(t_start, self.pipe)
        self.pipe = t0 + tr["occupancy"]
        self.busy["dma"] += tr["occupancy"]
        return t0 + tr["own"]

    def _close_region(self, name: str | None) -> float:
        """Store the region's outputs; return when its kernel is done."""
        t = max([self.region_end, self.pipe, *self.free.values()])
        io = self.region_io.get(name or "")
        if io:
            for nbytes, parts in io.stores:
                t = max(t, self._dma_slot(t, nbytes, parts))
        return t

    def _enter_region(self, i: int, w: Work) -> None:
        """Work ``i`` starts a new kernel: the previous one stores its outputs and drains, the boundary is paid,
        and this kernel loads its input activations before its engines start."""
        hw = self.hw
        t = self._close_region(self.current_region) if self.current_region is not None else 0.0
        if self.current_region is not None:
            t += hw.boundary_wall
            self.busy["sync"] += hw.boundary_sync
            self.barrier_time += hw.boundary_sync
            self.n_barriers += 1
        io = self.region_io.get(w.region)
        t_in = t
        if io:
            for nbytes, parts in io.loads:
                t_in = max(t_in, self._dma_slot(t, nbytes, parts))
        free = self.free
        for e in free:
            free[e] = max(free[e], t_in if e in COMPUTE_ENGINES else t)
        free["sync"] = max(free["sync"], t)
        self.pipe = max(self.pipe, t)
        frontier_gap = max(0.0, t_in - self.frontier)
        if frontier_gap and i:
            self.exposure[i - 1] += frontier_gap  # the boundary belongs to the kernel that just ended
            self.frontier = t_in
        self.current_region = w.region
        self.region_end = t_in

    # ---- dependencies ----
    def _new_tensors(self, i: int) -> None:
        """Variables (re)allocated before work ``i`` are new tensors: no writers yet (and, for PSUM, no reads
        to wait for)."""
        for v in self.allocs.get(i, ()):
            self.writers[v] = []
            if self.buffers.get(v) == "psum":
                self.readers[v] = []

    def _dependencies(self, i: int, w: Work) -> tuple[float, float]:
        """``(earliest start, earliest end)`` of work ``i`` from its read-after-write dependencies (plus the
        cross-engine semaphore or the same-engine issue interval) and its write-after-read/write hazards; a
        producer in the same loop body only gates the first iteration (its end bounds the consumer's end)."""
        works, ready, hw = self.works, self.ready, self.hw
        earliest = 0.0
        end_floor = 0.0
        for v in w.reads:
            for p in self.writers.get(v, ()):
                pw = works[p]
                n = _shares_loop(pw, w)
                if n:
                    t = self.first[p]
                    end_floor = max(end_floor, ready[p] + w.busy / n)
                else:
                    t = ready[p]
                if pw.kind == "compute" and w.kind == "compute":
                    if pw.engine != w.engine:
                        sem = hw.semaphore_cross_engine * w.repeats
                        t += sem
                        self.sem_total += sem
                    elif not n and w.dep_ii:
                        t = max(t, ready[p] - pw.per_instr + w.dep_ii)
                earliest = max(earliest, t)
        for v in w.writes:
            if self.buffers.get(v) == "psum":
                continue
            for p in list(self.readers.get(v, [])) + ([] if w.partial else list(self.writers.get(v, []))):
                if p == i or _shares_loop(works[p], w):
                    continue
                earliest = max(earliest, ready[p])
        return earliest, end_floor

    # ---- placement by kind ----
    def _place_barrier(self, i: int, w: Work) -> None:
        """The end of a hardware-loop iteration: everything issued so far drains, then every engine waits out
        the cross-engine barrier (fusegraph.perf.hwloops)."""
        s = max(self.frontier, self.pipe, *self.free.values())
        e = s + w.busy
        for k in self.free:
            self.free[k] = e
        self.pipe = e
        self.busy[w.engine] += w.busy
        self.start[i], self.ready[i], self.first[i] = s, e, e

    def _place_engine(self, i: int, w: Work, earliest: float, end_floor: float) -> None:
        """A compute instruction on its engine, or a collective on the collective engine (CC-cores, DMA rings):
        in order, beside compute and the kernel's DMA queues; only what reads its result waits for it."""
        s = max(self.free[w.engine], earliest)
        e = max(s + w.busy, end_floor)
        self.free[w.engine] = e
        self.busy[w.engine] += w.busy
        self.start[i], self.ready[i] = s, e
        self.first[i] = s + w.busy / max(1, w.count)

    def _place_dma(self, i: int, w: Work, earliest: float, end_floor: float) -> None:
        """A DMA: its triggers occupy the issuing engine, its bytes the shared DMA bandwidth after the fixed
        latency (partly overlapped with the previous transfer); it is done when its last byte lands."""
        s = max(self.free[w.engine], earliest)
        issue_done = s + w.busy
        self.free[w.engine] = issue_done
        self.busy[w.engine] += w.busy
        t0 = max(s + w.per_instr + w.latency, self.pipe + (1.0 - self.hw.dma_latency_overlap) * w.latency)
        self.pipe = t0 + w.occupancy
        self.busy["dma"] += w.occupancy
        e = max(t0 + w.own, issue_done, end_floor)
        self.start[i], self.ready[i] = s, e
        self.windows[i] = (s + w.per_instr, e)
        self.first[i] = t0 + w.own / max(1, w.count)

    def _record_access(self, i: int, w: Work) -> None:
        """Work ``i`` is now a reader of what it reads and the writer of what it writes (a whole write replaces
        the earlier writers and readers; a partial write joins them)."""
        for v in w.reads:
            self.readers[v].append(i)
        for v in w.writes:
            if w.partial:
                self.writers[v].append(i)
            else:
                self.writers[v] = [i]
                self.readers[v] = []


# ---- aggregation and classification ---------------------------------------------------------------------------
@dataclass
class Breakdown:
    """Aggregated modeled time of a set of work items (a region, a layer, a whole step)."""

    wall: float = 0.0  # critical-path time attributed to it (sums of exposures)
    busy: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    dma_ideal: float = 0.0
    dma_occupancy: float = 0.0
    dma_count: int = 0
    dma_bytes: int = 0
    hbm_read: int = 0
    hbm_write: int = 0
    instructions: int = 0
    latency: float = 0.0
    barrier: float = 0.0
    cc_count: int = 0
    cc_bytes: int = 0  # the ranks' source bytes of its collectives
    loop_barriers: int = 0  # hardware-loop iterations ended (each a drain + cross-engine barrier)

    def add(self, w: Work, exposure: float) -> None:
        self.wall += exposure
        self.busy[w.engine] += w.busy
        if w.kind == "cc":
            self.cc_count += w.count
            self.cc_bytes += w.nbytes
        elif w.kind == BARRIER_KIND:
            self.loop_barriers += w.count
        elif w.kind == "dma":
            self.dma_ideal += w.ideal
            self.dma_occupancy += w.occupancy
            self.busy["dma"] += w.occupancy
            self.dma_count += w.count
            self.dma_bytes += w.nbytes
            self.hbm_read += w.hbm_read
            self.hbm_write += w.hbm_write
            self.latency += w.latency
        else:
            self.instructions += w.count

    def components(self) -> dict[str, float]:
        """The four candidate explanations of the wall time (see :func:`classify`)."""
        compute = max((self.busy.get(e, 0.0) for e in COMPUTE_ENGINES), default=0.0)
        issue = max(self.busy.get("sync", 0.0) - self.barrier, 0.0)
        overhead = max(issue, self.dma_occupancy - self.dma_ideal)
        collective = self.busy.get("cc", 0.0)
        explained = max(compute, self.dma_occupancy, issue, collective)
        sync = max(0.0, self.wall - explained) + self.barrier
        return {"compute": compute, "memory": self.dma_ideal, "dma-overhead": overhead, "sync": sync,
                "collective": collective}

    def bound(self) -> str:
        return classify(self.components())

    def to_dict(self) -> dict[str, Any]:
        comp = self.components()
        return {"wall_s": self.wall, "busy_s": {k: v for k, v in self.busy.items() if v},
                "dma_ideal_s": self.dma_ideal, "dma_occupancy_s": self.dma_occupancy, "dma_count": self.dma_count,
                "dma_bytes": self.dma_bytes, "hbm_read_bytes": self.hbm_read, "hbm_write_bytes": self.hbm_write,
                "instructions": self.instructions, "components_s": comp, "bound": classify(comp),
                "collectives": {"count": self.cc_count, "bytes": self.cc_bytes, "seconds": self.busy.get("cc", 0.0)},
                "loop_barriers": {"count": self.loop_barriers, "seconds": self.busy.get("loop", 0.0)}}


def classify(components: dict[str, float]) -> str:
    """compute- / memory- / DMA-overhead- / sync-bound: the largest of

    * ``compute``: the busiest compute engine's time;
    * ``memory``: the bytes moved at the full per-core DMA bandwidth;
    * ``dma-overhead``: DMA issue time on the busiest issuing engine, or the bandwidth lost to small descriptors;
    * ``sync``: wall time no engine explains (waiting on latencies, semaphores, dependencies) plus barriers;
    * ``collective``: time on the collective engine (``nki.collectives``).
    """
    if not any(components.values()):
        return "none"
    return max(BOUNDS, key=lambda k: components.get(k, 0.0))


@dataclass
class Estimate:
    """The cost model's answer for one schedule: totals, per region, per layer and per line."""

    target: str
    schedule: Schedule
    total: Breakdown
    regions: dict[str, Breakdown]
    layers: dict[Any, Breakdown]
    label: str = ""

    @property
    def seconds(self) -> float:
        return self.schedule.makespan

    def per_layer_seconds(self) -> float:
        walls = [b.wall for k, b in self.layers.items() if isinstance(k, int)]
        return sum(walls) / len(walls) if walls else 0.0

    def decoder_seconds(self) -> float:
        return sum(b.wall for k, b in self.layers.items() if isinstance(k, int))

    def top_lines(self, n: int = 20) -> list[dict[str, Any]]:
        """The costliest kernel lines (a hardware loop's iterations summed back into their line)."""
        s = self.schedule
        by_line: dict[int, dict[str, Any]] = {}
        for i, w in enumerate(s.works):
            r = by_line.get(w.index)
            if r is not None:
                for k, v in (("count", w.count), ("cost_s", w.cost), ("busy_s", w.busy), ("dma_s", w.occupancy),
                             ("exposed_s", s.exposure[i]), ("bytes", w.nbytes)):
                    r[k] += v
                continue
            by_line[w.index] = {"line": w.line, "name": w.name, "region": w.region, "layer": w.layer,
                                "engine": w.engine, "kind": w.kind, "opcode": w.opcode, "count": w.count,
                                "cost_s": w.cost, "busy_s": w.busy, "dma_s": w.occupancy, "exposed_s": s.exposure[i],
                                "bytes": w.nbytes, "bytes_per_partition": w.bytes_per_partition,
                                "efficiency": w.efficiency}
        rows = list(by_line.values())
        rows.sort(key=lambda r: -(r["cost_s"] + r["exposed_s"]))
        return rows[:n]

    def top_templates(self, n: int = 20) -> list[dict[str, Any]]:
        """Lines grouped across layers and chunks (``L*.q_proj.linear.w#``): where the step's time goes by kind."""
        s = self.schedule
        groups: dict[tuple[str, str], dict[str, Any]] = {}
        seen: set[int] = set()
        for i, w in enumerate(s.works):
            key = (template_name(w.name) or w.region, w.opcode)
            g = groups.setdefault(key, {"name": key[0], "opcode": w.opcode, "engine": w.engine, "kind": w.kind,
                                        "lines": 0, "count": 0, "cost_s": 0.0, "exposed_s": 0.0, "bytes": 0,
                                        "region": _TEMPLATE.sub("L*.", w.region), "example_line": w.line})
            g["lines"] += w.index not in seen  # a hardware loop's iterations are one line
            seen.add(w.index)
            g["count"] += w.count
            g["cost_s"] += w.cost
            g["exposed_s"] += s.exposure[i]
            g["bytes"] += w.nbytes
        rows = sorted(groups.values(), key=lambda r: -(r["cost_s"] + r["exposed_s"]))
        return rows[:n]

    def to_dict(self, lines: int = 25) -> dict[str, Any]:
        return {
            "label": self.label,
            "target": self.target,
            "seconds": self.seconds,
            "per_layer_seconds": self.per_layer_seconds(),
            "barriers": self.schedule.barriers,
            "semaphore_waits_s": self.schedule.semaphore_waits,
            "total": self.total.to_dict(),
            "layers": {str(k): v.to_dict() for k, v in self.layers.items()},
            "regions": {k: v.to_dict() for k, v in self.regions.items()},
            "top_lines": self.top_lines(lines),
            "top_templates": self.top_templates(lines),
        }


def estimate(works: Sequence[Work], hw: HardwareParams, *, label: str = "", **kw: Any) -> Estimate:
    """Schedule ``works`` and aggregate per region and layer."""
    s = schedule(works, hw, **kw)
    total = Breakdown()
    regions: dict[str, Breakdown] = defaultdict(Breakdown)
    layers: dict[Any, Breakdown] = defaultdict(Breakdown)
    for i, w in enumerate(s.works):
        total.add(w, s.exposure[i])
        regions[w.region].add(w, s.exposure[i])
        layers[w.layer if w.layer is not None else "outside"].add(w, s.exposure[i])
    total.barrier = s.barrier_time
    total.busy["sync"] += s.barrier_time
    if s.barriers:
        per = s.barrier_time / max(1, s.barriers)
        seen: set[str] = set()
        for w in s.works:
            if w.region not in seen:
                seen.add(w.region)
                regions[w.region].barrier += per
                regions[w.region].busy["sync"] += per
                layers[w.layer if w.layer is not None else "outside"].barrier += per
                layers[w.layer if w.layer is not None else "outside"].busy["sync"] += per
    total.dma_occupancy = s.busy.get("dma", total.dma_occupancy)
    return Estimate(hw.target, s, total, dict(regions), dict(layers), label)


def estimate_kernel(view: KernelView, hw: HardwareParams, label: str = "megakernel") -> Estimate:
    """The megakernel: one instruction stream, engines overlapping across regions and layers; hardware loops
    scheduled iteration by iteration, each iteration drained (:func:`~fusegraph.perf.hwloops.unroll_hardware_loops`)."""
    works, buffers, allocs = unroll_hardware_loops(kernel_works(hw, view), view.buffers, view.allocs,
                                                   view.hw_loops, barrier=hw.loop_iteration_barrier)
    if view.iteration_ends:  # a trace view: every instruction is its own line; drain where an iteration ends
        works, allocs = drain_after(works, allocs, view.iteration_ends, hw.loop_iteration_barrier)
    return estimate(works, hw, label=label, buffers=buffers, allocs=allocs)
