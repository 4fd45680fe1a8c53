"""The streamed attention's block size and row groups as a *modeled* choice: on-chip footprint and a closed-form
time per candidate, from the cost model's sourced constants, without running the interpreter.

Why a closed form and not the largest block that fits: under the drained-loop model (docs/performance.md,
"Hardware loops: sourced entry") every iteration of the block loop starts with empty queues and ends with a drain
and a barrier, so a block's time is the critical path of *one* iteration of the template's body, not its share of
an engine's stream. That path depends on the block (the K DMA's fixed latency and bytes, the transposes and score
matmuls behind it, the softmax instructions over ``Lb / groups`` columns) in ways no size rule captures: a TP
rank's one kv head wants blocks of 4,096 in 4 row groups, one core of Qwen3-30B-A3B blocks of 1,024 in 2, one
core of Llama-3-8B blocks of 512 in 1 (docs/serving.md, "Block size and row groups: a modeled choice").

What this module does, for one candidate (:class:`StreamShape`: block ``Lb``, row groups ``pg``, and what the
template derives from them):

* :func:`sbuf_bytes` -- SBUF bytes per partition of the streamed template, each tile counted **once**: a hardware
  loop's body tiles are allocated once and reused by every iteration (SDK ``nki-dynamic-loops.rst``, L1 of the
  sourced entry; the interpreter allocates them the same way), so the former "next block's tiles while this
  block's are live" (the block counted twice) does not happen;
* :func:`psum_banks` -- PSUM banks the loop body's accumulation tiles take, all at once: every allocation *site*
  of the body (one per unrolled transpose group, score chunk, P^T group) is one tile live for the whole loop, packed
  first-fit into 2 KiB banks as the interpreter packs them (16 K^T transpose groups fill the 8 banks: why one
  Qwen3-30B-A3B core cannot take blocks of 2,048);
* :func:`estimate` -- the modeled seconds of the attention's blocks: the body's instructions (exactly the
  template's, in its order, with the cost model's per-instruction formulas: ``costmodel.instruction_time`` and
  ``dma_transfer``, docs/performance.md) list-scheduled for one iteration from empty queues (each engine in
  order, dependencies through the tiles they read and write, a cross-engine semaphore per hand-off, the DMA's
  issue + fixed latency + bytes at ``bandwidth x eff(run)``), plus the barrier (``loop_iteration_barrier``),
  times the iterations, plus the first and last block outside the loop and the row groups' fold.

The constants are read from the cost model's data file (``fusegraph/perf/data/trainium.json``, the sourced set:
what ``fusegraph.perf.load_params(target)`` returns) as *data*: the ops sit below the cost model in the import
layering (tests/test_import_layering.py), so its code is not imported; ``tests/serving/test_stream_choice.py``
checks that these formulas give the cost model's numbers and that the chosen candidate is the full model's
fastest on the benchmark configurations.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fusegraph.codegen.api import MOVING_MAX, PMAX, PSUM_FREE_FP32, tiles

#: the cost model's data file, relative to the ``fusegraph.perf`` package (read as data, see the module docstring)
COST_DATA = ("data", "trainium.json")
#: PSUM: 8 banks of 2 KiB per partition on trn2 and trn3 (the interpreter's ``Target.psum_banks``)
PSUM_BANKS = 8
PSUM_BANK_BYTES = 2048
#: the parameters the closed form uses (names of ``trainium.json``'s parameters)
PARAMS = ("dma_bandwidth_core", "dma_bandwidth_engine", "dma_engines_per_core", "dma_partitions_per_engine",
          "dma_efficiency_s0", "dma_fixed_latency", "dma_latency_overlap", "dma_issue_hwdge", "dma_issue_swdge",
          "dma_runtime_offset_issue",
          "dma_transpose_efficiency_hbm", "pe_clock", "pe_min_cycles", "pe_fp32_factor", "act_clock",
          "act_elems_per_cycle", "act_elems_per_cycle_16bit", "dve_clock", "dve_elems_per_cycle",
          "dve_elems_per_cycle_perf", "pool_clock", "pool_elems_per_cycle", "engine_fixed_cycles",
          "dependent_ii_cycles", "semaphore_cross_engine", "loop_iteration_barrier")
_TWO_INPUT = frozenset({"tensor_tensor", "scalar_tensor_tensor"})
_PERF_MODE = frozenset({"tensor_copy", "tensor_scalar"})
_SIXTEEN = frozenset({"bfloat16", "float16"})


@dataclass(frozen=True)
class Hardware:
    """The sourced cost-model parameters of one target (values of ``trainium.json``, SI units)."""

    target: str
    values: dict[str, float]

    def __getattr__(self, name: str) -> float:
        values = self.__dict__.get("values", {})
        if name in values:
            return values[name]
        raise AttributeError(name)

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def load(target: str) -> "Hardware":
        """The sourced values for ``target`` from the cost model's data file (no calibration: the default set)."""
        spec = importlib.util.find_spec("fusegraph.perf")
        roots = list(spec.submodule_search_locations or []) if spec else []
        if not roots:
            raise FileNotFoundError("fusegraph.perf's data file (trainium.json) not found")
        data = json.loads(Path(roots[0]).joinpath(*COST_DATA).read_text())
        params = data["parameters"]
        return Hardware(target, {k: float(params[k]["values"][target]) for k in PARAMS})


@dataclass(frozen=True)
class StreamShape:
    """What the streamed template's body is made of for one candidate (the template's own parameters, see
    ``attention_stream.j2``): ``Lb`` positions per block in ``pg`` row groups, ``HC`` kv heads of ``G`` query
    heads sharing a score tile, heads of ``D`` features in ``split`` partition tiles, byte sizes of the cache
    (``kvb``), query/output (``qb``), mask (``mb``) and score (``sb``) dtypes; ``exact``: scores rounded like HF
    eager (three Vector instructions per chunk instead of one), ``softcap``: Gemma 2's tanh; ``pipe``: the
    software-pipelined body; ``kt_dma``: K^T by DMA transpose; ``pos_split``: LNC=2 block split."""

    Lb: int
    pg: int
    HC: int
    G: int
    D: int
    split: int = 1
    kvb: int = 2
    qb: int = 2
    mb: int = 2
    sb: int = 2
    exact: bool = True
    softcap: bool = False
    pipe: bool = True
    kt_dma: bool = False
    pos_split: bool = False

    @property
    def nb(self) -> int:
        return self.Lb // PMAX

    @property
    def R(self) -> int:
        return self.HC * self.G

    @property
    def RR(self) -> int:
        return self.pg * self.R

    @property
    def bW(self) -> int:
        return self.Lb // self.pg

    @property
    def P(self) -> int:
        return self.D // self.split

    @property
    def kgroup(self) -> int:
        """K^T transposes per PSUM tile (the template's ``kgroup``: one 2 KiB bank of the cache dtype's columns)."""
        return max(1, min(self.nb, (2 * PSUM_FREE_FP32) // (PMAX * self.kvb)))

    @property
    def pgroup(self) -> int:
        """P^T tiles per PSUM tile (the template's ``pgroup``)."""
        return max(1, min(self.nb, (2 * PSUM_FREE_FP32) // (self.RR * self.qb)))

    @property
    def chunks(self) -> list[int]:
        """Score columns of each PSUM chunk of a row group's ``Lb / pg`` positions."""
        return [n for _, n, _ in tiles(self.bW, MOVING_MAX)]


def sbuf_bytes(s: StreamShape) -> int:
    """SBUF bytes per partition of the streamed template at its peak, each tile once (the module docstring says why).

    The peak is inside the block loop: its body's tiles, live together for the whole loop -- K (``[128, HC, nb,
    D]``, not with K^T by DMA), V, K^T (``[P, split, HC, Lb]``), the mask, score and probability tiles (``[RR, Lb /
    pg]``; the pipelined loop's carried score tile is the one score tile), the running state (``acc`` ``[RR, D]``
    fp32 and six ``[RR, 1]`` fp32 columns: -max, sum, block max, alpha, block sum, the pipelined loop's carried
    block max) -- and
    the zero-padded P^T (``[128, HC, nb, RR]``) and q (``[P, split, HC, pg, RR]``). After the loop K, V, K^T, P^T
    and q are dead; what follows (the LNC=2 combine's two ``[RR, D + 2]`` states, the fold's ``[RR, D + 1]`` and
    ``[1, RR]`` tiles, the ``[R, D]`` output) is counted when it is larger (never for a block of 128 or more).
    The interpreter's SBUF peak moves with this figure byte for byte (``tests/serving/test_stream_choice.py``)."""
    nb, RR = s.nb, s.RR
    k = 0 if s.kt_dma else s.HC * nb * s.D * s.kvb
    v = s.HC * nb * s.D * s.kvb
    kT = s.split * s.HC * s.Lb * s.kvb
    state = s.D * 4 + (6 if s.pipe else 5) * 4  # the carried block max only in the pipelined loop
    loop = k + v + kT + s.bW * (s.mb + s.sb + s.qb) + state + s.HC * nb * RR * s.qb + s.split * s.HC * s.pg * RR * s.qb
    after = state + (2 * (s.D + 2) * 4 if s.pos_split else 0) + ((s.D + 1) * 4 + 2 * RR * 4 if s.pg > 1 else 0) \
        + s.D * s.qb
    return max(loop, after)


def psum_sites(s: StreamShape) -> list[int]:
    """Bytes per partition of each PSUM allocation site of the block loop's body, in allocation order: one K^T
    tile per transpose group of each head and partition tile (not with K^T by DMA), one score tile per chunk, one
    P^T tile per group of ``pgroup`` position tiles, the P.V output."""
    kT = [] if s.kt_dma else [n * PMAX * s.kvb for _ in range(s.HC * s.split) for _, n, _ in tiles(s.nb, s.kgroup)]
    scores = [n * 4 for n in s.chunks]
    pT = [n * s.RR * s.qb for _, n, _ in tiles(s.nb, s.pgroup)]
    return kT + scores + pT + [s.D * 4]


def psum_banks(s: StreamShape, unroll: int = 1) -> int:
    """Banks the body's PSUM sites take when packed first-fit in allocation order, all live at once (a site is
    one tile for the whole loop, see :func:`psum_sites`); more than :data:`PSUM_BANKS` means it does not fit.
    ``unroll``: a body holding that many blocks, each with its own sites."""
    banks: list[int] = []
    for n in psum_sites(s) * unroll:
        if n > PSUM_BANK_BYTES:
            banks += [PSUM_BANK_BYTES] * (n // PSUM_BANK_BYTES) + ([n % PSUM_BANK_BYTES] if n % PSUM_BANK_BYTES else [])
            continue
        for b, used in enumerate(banks):
            if PSUM_BANK_BYTES - used >= n:
                banks[b] += n
                break
        else:
            banks.append(n)
    return len(banks)


# ---- the body's instructions and their cost (costmodel.instruction_time / dma_transfer, same formulas) ---------
@dataclass
class Op:
    """One instruction (or a run of identical ones on one engine) of the body: its engine, its cost (for a DMA
    the issue time on the issuing engine, plus the transfer's bandwidth occupancy, duration and fixed latency) and
    the tiles it reads and writes (``partial``: a slice, which joins the tile's earlier writers)."""

    name: str
    engine: str
    busy: float
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    partial: bool = False
    count: int = 1
    dma: bool = False
    occupancy: float = 0.0
    own: float = 0.0
    latency: float = 0.0
    dep_ii: float = 0.0
    psum: frozenset = field(default_factory=frozenset)


def engine_time(hw: Hardware, engine: str, opcode: str, free: float, dtypes: set[str]) -> tuple[float, float]:
    """(seconds, dependent-issue interval) of one Vector/Scalar/GpSimd or Tensor instruction over ``free`` elements
    per partition whose operand dtypes are ``dtypes`` (the cost model's ``instruction_time``)."""
    if engine == "tensor":
        return max(free, hw.pe_min_cycles) * (hw.pe_fp32_factor if "float32" in dtypes else 1) / hw.pe_clock, 0.0
    sixteen = bool(dtypes) and dtypes <= _SIXTEEN
    if engine == "vector":
        clock = hw.dve_clock
        width = hw.dve_elems_per_cycle_perf if (opcode in _PERF_MODE and sixteen) else hw.dve_elems_per_cycle
    elif engine == "scalar":
        clock, width = hw.act_clock, (hw.act_elems_per_cycle_16bit if sixteen else hw.act_elems_per_cycle)
    else:
        clock, width = hw.pool_clock, hw.pool_elems_per_cycle
    inputs = 2 if opcode in _TWO_INPUT else 1
    return (hw.engine_fixed_cycles + inputs * free * 128.0 / width) / clock, hw.dependent_ii_cycles / clock


def dma_time(hw: Hardware, nbytes: float, partitions: int, run: float, transpose: bool = False
             ) -> tuple[float, float]:
    """(bandwidth occupancy, duration) of one DMA of ``nbytes`` over ``partitions`` partitions in contiguous runs
    of ``run`` bytes (the cost model's ``dma_transfer``; a DMA transpose from HBM at its sourced fraction, O6)."""
    eff = run / (run + hw.dma_efficiency_s0)
    engines = min(hw.dma_engines_per_core, math.ceil(partitions / hw.dma_partitions_per_engine))
    occ = nbytes / (hw.dma_bandwidth_core * eff)
    own = max(nbytes / (engines * hw.dma_bandwidth_engine * eff), occ)
    if transpose:
        occ, own = occ / hw.dma_transpose_efficiency_hbm, own / hw.dma_transpose_efficiency_hbm
    return occ, own


def _dt(nbytes: int) -> str:
    return "float32" if nbytes == 4 else "bfloat16"


def body_ops(s: StreamShape, hw: Hardware) -> list[Op]:
    """The instructions of one iteration of the block loop, in the template's order (``attention_stream.j2``: the
    pipelined body is load, scores, V of the pending block, its softmax, P^T, this block's eviction and max, P.V;
    one block at a time: load, scores with their eviction, softmax, P^T, P.V), each with its modeled cost."""
    kv, q, mask, score, f32 = _dt(s.kvb), _dt(s.qb), _dt(s.mb), _dt(s.sb), "float32"
    ops: list[Op] = []

    def comp(name: str, engine: str, opcode: str, free: float, dtypes: set[str], reads: tuple, writes: tuple,
             n: int = 1, partial: bool = False, psum: tuple = ()) -> None:
        t, ii = engine_time(hw, engine, opcode, free, dtypes)
        ops.append(Op(name, engine, t * n, reads, writes, partial, n, dep_ii=ii, psum=frozenset(psum)))

    def dma(name: str, nbytes: float, partitions: int, run: float, writes: tuple, engine: str = "sync",
            transpose: bool = False, partial: bool = False, reads: tuple = (), register: bool = True) -> None:
        """``register``: the address takes the block's runtime offset (``scalar_offset``: every load of a loop
        iteration after the first block; K^T by DMA gathers by a row-index tile instead)."""
        occ, own = dma_time(hw, nbytes, partitions, run, transpose)
        issue = hw.dma_issue_swdge if engine == "gpsimd" else hw.dma_issue_hwdge
        if register:
            issue += hw.dma_runtime_offset_issue
        ops.append(Op(name, engine, issue, reads, writes, partial, dma=True, occupancy=occ, own=own,
                      latency=hw.dma_fixed_latency))

    kvbytes = s.HC * s.Lb * s.D * s.kvb
    run = s.nb * s.D * s.kvb

    def load() -> None:
        if s.kt_dma:
            for h in range(s.HC):
                dma("kT_dma", s.Lb * s.D * s.kvb, PMAX, run, ("kT",), engine="gpsimd", transpose=True, partial=True,
                    reads=("kidx",), register=False)  # the row-index tile: its advance below waits for the transposes
            comp("kidx_next", "vector", "tensor_scalar", 1, {"uint32"}, ("kidx",), ("kidx",))
        else:
            dma("kload", kvbytes, PMAX, run, ("kn",))
        if not s.pipe:  # one block at a time: V with K, before the mask (the template's order)
            dma("vload", kvbytes, PMAX, run, ("vn",))
        dma("mask", s.RR * s.bW * s.mb, s.RR, s.bW * s.mb, ("mk",))
        if not s.kt_dma:
            for g, (_, n, _) in enumerate(tiles(s.nb, s.kgroup) * (s.HC * s.split)):
                comp("kT", "tensor", "nc_transpose", s.P, {kv}, ("kn",), (f"kps{g}",), n=n, psum=(f"kps{g}",))
                comp("kT_copy", "vector", "tensor_copy", n * PMAX, {kv}, (f"kps{g}",), ("kT",), partial=True)

    def qk(c: int, n: int) -> None:
        comp("qk", "tensor", "nc_matmul", n, {q, kv}, ("qz", "kT"), (f"sps{c}",), n=s.HC * s.split * s.pg,
             psum=(f"sps{c}",))

    def evict(c: int, n: int) -> None:
        if s.exact:
            comp("qk_round", "vector", "tensor_copy", n, {score, f32}, (f"sps{c}",), ("s",), partial=True)
            comp("scale", "vector", "tensor_scalar", n, {score}, ("s",), ("s",), partial=True)
            if s.softcap:
                comp("cap_div", "vector", "tensor_scalar", n, {score}, ("s",), ("s",), partial=True)
                comp("cap_tanh", "scalar", "activation", n, {score}, ("s",), ("s",), partial=True)
                comp("cap_mul", "vector", "tensor_scalar", n, {score}, ("s",), ("s",), partial=True)
            comp("mask_add", "vector", "tensor_tensor", n, {score, mask}, ("s", "mk"), ("s",), partial=True)
        elif s.softcap:
            comp("cap_tanh", "scalar", "activation", n, {score, f32}, (f"sps{c}",), ("s",), partial=True)
            comp("cap_mask", "vector", "scalar_tensor_tensor", n, {score, mask}, ("s", "mk"), ("s",), partial=True)
        else:
            comp("scale_mask", "vector", "scalar_tensor_tensor", n, {score, f32, mask}, (f"sps{c}", "mk"), ("s",),
                 partial=True)

    def soft(max_from: str) -> None:
        comp("max_run", "vector", "tensor_tensor", 1, {f32}, (max_from, "nm"), ("bm",))
        comp("alpha", "scalar", "activation", 1, {f32}, ("nm", "bm"), ("alpha",))
        comp("max_keep", "vector", "tensor_copy", 1, {f32}, ("bm",), ("nm",))
        comp("exp", "scalar", "activation", s.bW, {q, score, f32}, ("s", "nm"), ("p", "lb"))
        ops[-1].busy += engine_time(hw, "scalar", "activation", 1, {f32})[0]  # its reduce (activation_read_reduce)
        comp("sum_run", "vector", "scalar_tensor_tensor", 1, {f32}, ("l", "alpha", "lb"), ("l",))

    def pT_pv() -> None:
        per_copy = s.G * (s.HC if s.HC > 1 else 1)
        for g, (_, n, _) in enumerate(tiles(s.nb, s.pgroup)):
            comp("pT", "tensor", "nc_transpose", PMAX, {q}, ("p",), (f"pTps{g}",), n=n, psum=(f"pTps{g}",))
            for _ in range(s.pg):
                comp("pT_copy", "vector", "tensor_copy", n * per_copy, {q}, (f"pTps{g}",), ("pTz",), partial=True)
        comp("pv", "tensor", "nc_matmul", s.D, {q, kv}, ("pTz", "vn"), ("ops",), n=s.HC * s.nb, psum=("ops",))
        comp("acc_run", "vector", "scalar_tensor_tensor", s.D, {f32}, ("acc", "alpha", "ops"), ("acc",))

    load()
    if s.pipe:
        for c, n in enumerate(s.chunks):
            qk(c, n)
        dma("vload", kvbytes, PMAX, run, ("vn",))
        soft("bmc")
        pT_pv_ops = len(ops)
        pT_pv()
        pv_tail = ops[pT_pv_ops:][-2:]  # P.V and its accumulation come after this block's eviction
        del ops[-2:]
        for c, n in enumerate(s.chunks):
            evict(c, n)
        comp("max", "vector", "tensor_reduce", s.bW, {f32, score}, ("s",), ("bmc",))
        ops.extend(pv_tail)
    else:
        for c, n in enumerate(s.chunks):
            qk(c, n)
            evict(c, n)
        comp("max", "vector", "tensor_reduce", s.bW, {f32, score}, ("s",), ("bm",))
        soft("bm")
        pT_pv()
    return ops


def schedule(ops: list[Op], hw: Hardware) -> float:
    """Seconds from empty queues until every op of ``ops`` is done: each engine in order, an op starting when its
    engine is free and what it reads is written (+ a cross-engine semaphore between two compute engines, or the
    dependent-issue interval on one engine), a write waiting for the earlier readers of its tile (SBUF tiles;
    PSUM accumulation is exempt), a DMA's bytes on the core's one DMA bandwidth after its issue and fixed latency.
    The cost model's list schedule (``costmodel._Scheduler``) of one drained iteration."""
    free: dict[str, float] = {}
    pipe = 0.0
    end = 0.0
    writers: dict[str, list[tuple[Op, float, float]]] = {}
    readers: dict[str, list[float]] = {}
    for op in ops:
        earliest = 0.0
        for v in op.reads:
            for p, p_start, p_end in writers.get(v, ()):
                t = p_end
                if not op.dma and not p.dma:
                    if p.engine != op.engine:
                        t += hw.semaphore_cross_engine
                    elif op.dep_ii:
                        t = max(t, p_end - p.busy / p.count + op.dep_ii)
                earliest = max(earliest, t)
        for v in op.writes:
            if v in op.psum:
                continue
            for t in readers.get(v, []) + ([] if op.partial else [e for _, _, e in writers.get(v, ())]):
                earliest = max(earliest, t)
        start = max(free.get(op.engine, 0.0), earliest)
        if op.dma:
            issued = start + op.busy
            t0 = max(issued + op.latency, pipe + (1.0 - hw.dma_latency_overlap) * op.latency)
            pipe = t0 + op.occupancy
            done = max(t0 + op.own, issued)
            free[op.engine] = issued
        else:
            done = start + op.busy
            free[op.engine] = done
        for v in op.reads:
            readers.setdefault(v, []).append(done)
        for v in op.writes:
            if op.partial:
                writers.setdefault(v, []).append((op, start, done))
            else:
                writers[v] = [(op, start, done)]
                readers[v] = []
        end = max(end, done)
    return max(end, pipe)


def fold_time(s: StreamShape, hw: Hardware, n: int = 1) -> float:
    """The row groups' fold after the blocks (``pg > 1``) of ``n`` block loops (sequences x head groups): its
    instructions one after another (a chain: each reads the previous one's result, a semaphore at every change of
    engine), the other loops' folds behind it at the pace of the fold's busiest engine (see :func:`estimate`)."""
    if s.pg == 1:
        return 0.0
    f32 = {"float32"}
    chain = [("tensor", "nc_transpose", 1), ("vector", "tensor_copy", s.RR), ("vector", "tensor_tensor", s.R)]
    chain += [("vector", "tensor_tensor", s.R)] * (s.pg - 2 + s.pg)
    chain += [("scalar", "activation", s.RR), ("tensor", "nc_transpose", 1), ("vector", "tensor_copy", 1),
              ("vector", "tensor_scalar", s.D), ("vector", "tensor_scalar", 1), ("tensor", "nc_matmul", s.D + 1)]
    total, prev = 0.0, ""
    busy: dict[str, float] = {}
    for engine, opcode, free in chain:
        t = engine_time(hw, engine, opcode, free, f32)[0]
        busy[engine] = busy.get(engine, 0.0) + t
        total += t + (hw.semaphore_cross_engine if prev and prev != engine else 0.0)
        prev = engine
    return total + (n - 1) * max(busy.values())


def setup_time(s: StreamShape, hw: Hardware) -> float:
    """Per sequence and head group: zero-padding q (one memset, ``pg x HC x split`` copies) and, pipelined, the
    running state's three memsets; the zero-padded P^T's memset once per kernel is counted here too (an upper
    bound for batches)."""
    q = {_dt(s.qb)}
    t = engine_time(hw, "vector", "memset", s.split * s.HC * s.pg * s.RR, q)[0]
    t += s.pg * s.HC * s.split * engine_time(hw, "vector", "tensor_copy", s.G, q)[0]
    t += engine_time(hw, "vector", "memset", s.HC * s.nb * s.RR, q)[0]
    if s.pipe:
        t += 3 * engine_time(hw, "vector", "memset", 1, {"float32"})[0]
    return t


@dataclass(frozen=True)
class Estimate:
    """The closed form's figures for one candidate: seconds of one drained loop iteration (barrier included),
    iterations per sequence and head group, the whole attention's blocks (``seconds``)."""

    iteration: float
    iterations: int
    seconds: float


def estimate(s: StreamShape, hw: Hardware, L: int, *, sequences: int = 1, head_groups: int = 1,
             unroll: int = 1) -> Estimate:
    """Modeled seconds of the attention's blocks at a full cache of ``L`` positions (every block read, as the
    serving benchmarks assume), for each of ``sequences x head_groups`` block loops: the full blocks after the
    first in drained iterations of the body (under an LNC=2 block split, this core's every other block), the first
    block's and the last block's work outside the loop (about one more body without its barrier), a cache that is
    not a multiple of the block its short block of ``Lr`` positions (one block at a time, outside the loop), the
    fold, and the per-sequence setup.

    ``unroll``: the loop partially unrolled by that factor (``unroll`` blocks per iteration, one drain per
    ``unroll`` blocks, each block with its own tiles). The template does not emit it: the model never prefers it
    to a block ``unroll`` times larger, which takes the same tiles (SBUF and PSUM) in fewer, longer DMAs and
    instructions (``tests/serving/test_stream_choice.py``, docs/serving.md), so it is evaluated, not offered."""
    full, r = divmod(L, s.Lb)
    if s.pos_split:
        full = -(-full // 2)
    ops = body_ops(s, hw)
    if unroll > 1:
        ops = [replace(op, reads=tuple(f"{v}~{u}" if v not in _CARRIED else v for v in op.reads),
                       writes=tuple(f"{v}~{u}" if v not in _CARRIED else v for v in op.writes),
                       psum=frozenset(f"{v}~{u}" for v in op.psum))
               for u in range(unroll) for op in ops]
    body = schedule(ops, hw)
    iteration = body + hw.loop_iteration_barrier
    # a head split with a short first block runs every full block in the loop (the short one is block 0)
    in_loop = full if (r and not s.pos_split) else max(0, full - 1)
    loops = -(-in_loop // unroll)
    # n block loops (sequences x head groups), each draining its own iterations, each with its first and last block
    # (and short block) outside the loop -- a chain per sequence, as the full model schedules them (their DMA
    # latency and the transposes behind it do not overlap across sequences) -- and the folds, which do: one chain,
    # the other sequences' following at the pace of the fold's busiest engine
    n = sequences * head_groups
    per = (0.0 if (r and not s.pos_split) else body / unroll) + setup_time(s, hw)
    if r:
        per += schedule(body_ops(replace(s, Lb=-(-r // PMAX) * PMAX, pg=1, pipe=False), hw), hw)
    return Estimate(iteration, loops, n * (loops * iteration + per) + fold_time(s, hw, n))


#: the running state the blocks of one iteration share (an unrolled body's blocks update it one after another)
_CARRIED = frozenset({"nm", "l", "acc", "qz"})
