"""Grouped-query decode attention over a static KV cache with an additive mask (+ Gemma 2 soft-capping, GPT-OSS's
attention sinks: one more logit per query head in the softmax's max and sum, its probability dropped).

Two templates, chosen by the cache length (:func:`stream_plan`):

* ``attention.j2`` (caches of up to ``StreamSwitches.stream_above`` positions): per kv head the whole K^T and score row in
  SBUF, K row tiles transposed on the Tensor engine, scores for the head group, scale (+ ``tanh``
  soft-capping) + mask, softmax (``tensor_reduce`` max, ``activation(exp)`` with reduce, ``reciprocal``), P^T V
  accumulated over position tiles. Rounds exactly like eager (probabilities normalized, then rounded).
* ``attention_stream.j2`` (longer caches): flash-decoding. The cache is read in blocks of ``Lb`` positions
  through SBUF with an online softmax (running max and sum and the unnormalized output in fp32), so SBUF use
  does not grow with the cache. A core's kv heads (in groups of :func:`head_group`, at most 128 rows) share one
  ``[heads x G, Lb]`` score tile: q is zero-padded per head and the heads' score matmuls accumulate into one PSUM
  tile (each row gets only its own head's q.k^T; the others add exact zeros), likewise P^T for P.V, so every
  Vector/Scalar softmax instruction runs once per block for all of them (its cost is its free size, not its
  partitions). One K and one V DMA per block load all the group's heads, each partition holding ``Lb / 128``
  consecutive positions (one descriptor run of ``Lb / 128 x D`` elements instead of one row); K^T columns are
  copied back into position order and P^T tiles taken with that stride; for 2-byte caches with heads of at most
  128 (head split, not paged) K^T comes instead by one indirect ``dma_transpose`` per kv head and block
  (:func:`kt_by_dma`; bit-identical: the score matmuls read it in position order through a strided view). When
  the step's KV write gives each
  sequence's position, blocks past it are never read (a hardware loop, ``nl.dynamic_range``, bounded by a
  register loaded from the position). Under LNC=2 the kv heads are split between the two cores as before; with
  an odd number of kv heads the *blocks* are split instead (each core reads every other block) and the two
  running states are combined with one ``sendrecv``. Any cache length streams: when ``Lb`` does not divide it, the
  first ``L % Lb`` positions are one more, shorter block (:func:`block_starts`; read as a multiple of 128 with
  the overlap masked), first under a head split, after the combine under a block split. The block loop is
  software-pipelined (``StreamSwitches.pipeline``): iteration k computes block k's scores while block k - 1's softmax and
  P.V run, so the in-order Tensor, Vector and Scalar engines work on two blocks at once. The first block of sequence 0
is read at the start of the layer, before its KV write (``StreamSwitches.prefetch``; read again after the write only when this
step's row falls in it: bit-identical). A core with few query rows splits each block's positions into row groups
(``StreamSwitches.row_groups``: ``[groups x rows, Lb / groups]`` score tiles, one running state per group, folded by one matmul
at the end), so a softmax instruction runs over ``Lb / groups`` columns. The block size and the row groups are the cost model's
choice (:func:`choose_stream`, :mod:`.blocks`: the fastest candidate in a closed form of one drained loop iteration among
those whose tiles fit SBUF and PSUM). Rounding: scores exactly as below; the probabilities are
  rounded before normalization (``exp(s - running max)`` in the query dtype, the sum and the rescaling in fp32,
  one division at the end), see docs/serving.md for the tolerance.

The score rounding follows the captured implementation: HF eager rounds to the query dtype after each op, SDPA
keeps fp32 (the match's ``variant``).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

import torch

from fusegraph.codegen.api import (aten, code, CodegenError, Context, Emitted, expr, inst_name, ir, KV_INDEX, KV_NEXT,
                                    kv_positions, Lowerer, MOVING_MAX, nbytes, nl_dtype, PMAX, PSUM_FREE_FP32,
                                    register_codegen_options, register_lowering, tiles)
from fusegraph.nkisim.targets import get_target

from . import blocks
from .decode_attention import decode_attention, decode_attention_sinks, decode_attention_softcap

V = ir.ValueKind

@dataclass(frozen=True)
class StreamSwitches:
    """The tuning switches of the decode attention templates. Why a value and not module globals: they change the
    generated kernel, so they come from :class:`fusegraph.settings.Settings` (``attn_*`` options, part of the
    kernel cache key) and one build sees one set of them (:func:`use_switches`), never another thread's edit."""

    #: caches longer than this are streamed (flash-decoding); up to it the single-pass template keeps the whole row.
    #: 1024: at 2,048 positions the streamed template is modeled faster on one core (Qwen3-30B-A3B 290 -> 250
    #: us/layer, Llama-3-8B 959 -> 885) and on TP ranks (Qwen3 rank 71.7 -> 63.9, Llama rank at batch 8 274 -> 198);
    #: at 640 a TP rank with one kv head under LNC=2 (blocks of 128 split between the cores) is modeled slower
    #: streamed (58.6 -> 63.4), so short caches keep the single pass (docs/serving.md, "Benchmark")
    stream_above: int = 1024
    #: the largest streamed block the modeled choice considers, in positions (one K and one V DMA of Lb x head_dim per
    #: block and kv head). 8192: the choice (:func:`choose_stream`) is bounded by SBUF and PSUM long before it (a TP
    #: rank's one kv head takes 4,096, the PSUM of its K^T transposes stopping 8,192); a larger block also reads more
    #: positions past a sequence's end (a position-bounded loop reads whole blocks)
    block_max: int = 8192
    #: force every streamed block to this many positions (the largest multiple of 128 up to it that the cache
    #: allows); 0: the modeled choice among the candidates that fit (:func:`choose_stream`)
    block: int = 0
    #: the largest streamed block of a paged attention (``paged_attention.py``)
    paged_block_max: int = 512
    #: the largest SBUF scratch per partition a streamed block may take; 0: what the SBUF budget leaves
    #: (:func:`scratch_limit`: the usable SBUF less the weight ring's bound and :data:`SBUF_RESERVE`)
    scratch_max: int = 0
    #: usable SBUF bytes per partition (``settings.sbuf_budget``); 0: the target's default (the interpreter's and the
    #: planner's: physical less 16 KiB)
    sbuf_budget: int = 0
    #: the weight ring's bound, bytes per partition: two streams (static and dynamic) x ``weight_buffers`` x
    #: ``weight_chunk_kib`` (4 x 16 KiB by default; ``codegen/stream.py`` sizes the ring the same way)
    ring_bytes: int = 2 * 4 * 16 * 1024
    #: the block loop software-pipelined (iteration k computes block k's scores while block k - 1's softmax and P.V
    #: run: the Tensor, Vector and Scalar engines work on two blocks at once instead of passing one block down a
    #: chain); caches that are a multiple of the block (no short first block under a head split), not paged
    pipeline: bool = True
    #: the first block of sequence 0 read at the start of the attention's layer, before the layer's KV write (and
    #: the projections that write waits for), and read again after it only when this step's row falls in it (a
    #: guarded DMA): the layer's first cache read no longer waits for the layer's first matmuls and the write's
    #: round trip. Streamed, position-bounded (the KV write's index is known), head split, not paged
    prefetch: bool = True
    #: K^T of a streamed block by an indirect DMA transpose (HBM -> SBUF, as nki-library's decode attention_tkg
    #: loads K) instead of Tensor-engine transposes and PSUM evictions; see :func:`kt_by_dma` for when it applies.
    #: Off by default: with the transpose at O6's 90% of the DMA throughput the long-context step is DMA-bound and
    #: the cost model puts it 0.3-0.7% slower for Qwen3-30B-A3B (1.6% faster for Llama-3-8B at 131,072), and
    #: nki-library's own notes report a regression from replacing nc_transpose by dma_transpose in a DMA-bound kernel
    kt_by_dma: bool = False
    #: *row groups* sharing a score tile: each row group holds its own contiguous part of every block (positions j x
    #: Lb / groups ...) with its own running softmax state, and the groups are folded once at the end, so a core with
    #: few query rows (a TP rank's one kv head: 8 rows) fills more partitions and each Vector/Scalar instruction of a
    #: block runs over Lb / groups columns instead of Lb (its cost is its free size), at the price of a fold and
    #: wider zero-padded q and P^T. 0: the modeled choice (:func:`choose_stream`); N: the most valid up to N (4 at
    #: most: the P^T copies into a group's partitions must start at 0/32/64/96, nkisim's start-partition rule); 1 off
    row_groups: int = 0

    @classmethod
    def from_settings(cls, settings: Any) -> "StreamSwitches":
        """The switches a :class:`fusegraph.settings.Settings` asks for (its ``attn_*`` fields, and the SBUF budget
        and weight ring the block's scratch must leave room for)."""
        return cls(stream_above=settings.attn_stream_above, block_max=settings.attn_block_max,
                   block=settings.attn_block, paged_block_max=settings.attn_paged_block_max,
                   scratch_max=settings.attn_stream_scratch_kib * 1024, sbuf_budget=settings.sbuf_budget,
                   ring_bytes=2 * settings.weight_buffers * settings.weight_chunk_kib * 1024,
                   pipeline=settings.attn_pipeline, prefetch=settings.attn_prefetch,
                   kt_by_dma=settings.attn_kt_by_dma, row_groups=settings.attn_row_groups)


DEFAULT_SWITCHES = StreamSwitches()
_SWITCHES: contextvars.ContextVar[StreamSwitches] = contextvars.ContextVar("attention_switches",
                                                                          default=DEFAULT_SWITCHES)


def switches() -> StreamSwitches:
    """The switches of the build running in this thread (:data:`DEFAULT_SWITCHES` outside :func:`use_switches`)."""
    return _SWITCHES.get()


@contextlib.contextmanager
def use_switches(sw: StreamSwitches) -> Iterator[StreamSwitches]:
    """Generate kernels with ``sw`` inside the ``with`` (per thread and context: concurrent builds do not mix)."""
    token = _SWITCHES.set(sw)
    try:
        yield sw
    finally:
        _SWITCHES.reset(token)


#: SBUF per partition kept for the activations live at the attention and the kernel's constants when the block's
#: scratch limit is derived from the budget (:func:`scratch_limit`); batch 64 keeps 10-12 KiB of activations live at
#: its peak (docs/serving.md, "SBUF budget")
SBUF_RESERVE = 16 * 1024


def scratch_limit(target: str) -> int:
    """The largest SBUF scratch per partition a streamed block may take: ``StreamSwitches.scratch_max`` when set,
    else what the budget leaves (usable SBUF of ``target`` or ``settings.sbuf_budget``, less the weight ring's bound
    and :data:`SBUF_RESERVE`): 96 KiB on trn3, 64 KiB on trn2 with the default 4 x 16 KiB ring. Why derived: the
    block's tiles are the largest scratch of a long-context kernel and the ring the largest persistent use; the
    planner's check (``Budget``) stays the final word."""
    sw = switches()
    if sw.scratch_max:
        return sw.scratch_max
    budget = sw.sbuf_budget or get_target(target).default_sbuf_budget
    return max(0, budget - sw.ring_bytes - SBUF_RESERVE)


@dataclass(frozen=True)
class StreamChoice:
    """The streamed template's block (``Lb`` positions) and row groups (``pg``) for one attention, why, and the
    figures behind it: SBUF scratch per partition and PSUM banks of the loop body (:mod:`.blocks`), the closed
    form's seconds for the attention's blocks at a full cache and per drained iteration; ``candidates``: every
    ``(Lb, pg, seconds, scratch, psum banks, fits)`` considered (for reports and tests)."""

    Lb: int
    pg: int
    scratch: int
    psum_banks: int
    seconds: float
    iteration: float
    how: str
    candidates: tuple[tuple[int, int, float, int, int, bool], ...] = ()

    def note(self) -> str:
        """One line for the kernel's comment: what was chosen and why."""
        fits = sum(1 for c in self.candidates if c[5])
        return (f"blocks of {self.Lb} in {self.pg} row group{'s' if self.pg > 1 else ''}: {self.how}"
                + (f", the fastest of {fits} candidates that fit" if self.how == "modeled" else "")
                + f" (closed form {self.iteration * 1e6:.2f} us per drained iteration; SBUF {self.scratch / 1024:.1f} "
                  f"KiB, PSUM {self.psum_banks} banks)")


#: the kernel comment of a streamed attention's choice (:meth:`StreamChoice.note`)
_CHOICE_NOTE = re.compile(r"# blocks of (\d+) in (\d+) row groups?: ([^(,\n]+)")


def stream_choices(source: str) -> list[dict[str, Any]]:
    """The block and row groups of every streamed attention of a generated kernel, from its comments (what
    :meth:`StreamChoice.note` wrote): ``[{"block": 1024, "row_groups": 2, "how": "modeled"}, ...]`` in source
    order, one per attention. For reports and benchmarks, which have the kernel but not its build."""
    return [{"block": int(m.group(1)), "row_groups": int(m.group(2)), "how": m.group(3).strip()}
            for m in _CHOICE_NOTE.finditer(source)]


def valid_row_groups(R: int, nb: int, *, r: int, paged: bool, kt_dma: bool) -> list[int]:
    """Row-group counts the template can run for a block of ``nb`` position tiles and ``R`` rows: at most 128 rows
    in all, dividing the block's tiles, each group's P^T partitions starting at 0/32/64/96 (so at most 4); only 1
    for a short first block (``r``), paged gathers and K^T by DMA (its strided score read is per position row).
    ``StreamSwitches.row_groups`` = N > 0 keeps the most of them up to N (the option's override)."""
    if r or paged or kt_dma:
        return [1]
    ok = [g for g in (1, 2, 4) if g == 1 or (g * R <= PMAX and nb % g == 0 and (PMAX // g) % 32 == 0)]
    cap = switches().row_groups
    return [max(g for g in ok if g <= cap)] if cap else ok


def row_groups(R: int, nb: int, *, r: int, paged: bool, kt_dma: bool) -> int:
    """The most row groups the template can run for this block (:func:`valid_row_groups`, up to
    ``StreamSwitches.row_groups`` or 4): what a forced block takes when the option names no count."""
    return max(valid_row_groups(R, nb, r=r, paged=paged, kt_dma=kt_dma))


def stream_plan(L: int, D: int, G: int, split: int, kvb: int, qb: int, mb: int, sb: int, *, pos_split: bool = False,
                block: int = 0, heads: int = 1, target: str = "trn2") -> tuple[int, int] | None:
    """(block positions, SBUF scratch per partition) of the streamed template for a cache of ``L`` positions, or
    None when the single-pass template takes it (``block``: force streaming with blocks of at most this size, as
    the paged attention and the tests do): :func:`choose_stream` with scores rounded like HF eager."""
    c = choose_stream(L, D, G, split, kvb, qb, mb, sb, pos_split=pos_split, block=block, heads=heads, target=target)
    return None if c is None else (c.Lb, c.scratch)


def choose_stream(L: int, D: int, G: int, split: int, kvb: int, qb: int, mb: int, sb: int, *, pos_split: bool = False,
                  block: int = 0, heads: int = 1, exact: bool = True, softcap: bool = False, target: str = "trn2",
                  kv_rows: int = 0, paged: bool = False, tokens: int = 1, head_groups: int = 1
                  ) -> StreamChoice | None:
    """The streamed template's block and row groups for a cache of ``L`` positions, or None when the single-pass
    template takes it (``L <= StreamSwitches.stream_above`` and no ``block``).

    Candidates: blocks of 128-position multiples up to ``StreamSwitches.block_max`` (and ``L``, or ``L / 2`` under
    a block split) that divide ``L`` when ``L`` is a multiple of 128 (any other length reads its first ``L % Lb``
    positions as one more, shorter block), each with every row-group count the template can run
    (:func:`valid_row_groups`). A candidate *fits* when its scratch (:func:`.blocks.sbuf_bytes`, each tile once)
    is within :func:`scratch_limit` and its loop body's PSUM tiles (:func:`.blocks.psum_banks`) within the 8
    banks. **Modeled** (the default): the fitting candidate the closed form (:func:`.blocks.estimate`: one drained
    iteration of the template's body list-scheduled with the cost model's sourced per-instruction, DMA, semaphore
    and loop-barrier costs, times the iterations at a full cache) puts fastest; ties to the smaller scratch.
    **Forced** (``block`` here, or ``StreamSwitches.block``): the largest block up to it that fits (the smallest
    if none does), with ``StreamSwitches.row_groups`` groups if set, else the modeled best for that block. None
    fits at all: the smallest scratch (the planner's budget check then says why)."""
    sw = switches()
    if not block and not sw.block and L <= sw.stream_above:
        return None
    return _choose(sw, L, D, G, split, kvb, qb, mb, sb, pos_split, block or sw.block, heads, exact, softcap, target,
                   kv_rows, paged, tokens, head_groups)


@functools.lru_cache(maxsize=4096)
def _choose(sw: StreamSwitches, L: int, D: int, G: int, split: int, kvb: int, qb: int, mb: int, sb: int,
            pos_split: bool, forced: int, heads: int, exact: bool, softcap: bool, target: str, kv_rows: int,
            paged: bool, tokens: int, head_groups: int) -> StreamChoice:
    """:func:`choose_stream` for one set of switches (cached: every layer's attention asks the same question several
    times per build)."""
    top = min(forced or sw.block_max, L // 2 if pos_split else L)
    sizes = [Lb for Lb in range(PMAX, top + 1, PMAX) if not (L % PMAX == 0 and L % Lb)]
    if not sizes:
        raise CodegenError(f"no block of {PMAX}-multiples fits {L} cache positions"
                           + (" twice (LNC=2 splits the blocks between the cores)" if pos_split else ""))
    hw = blocks.Hardware.load(target)
    limit = scratch_limit(target)
    R = heads * G
    rows: list[tuple[int, int, float, int, int, bool]] = []
    best: dict[int, tuple] = {}  # Lb -> (fits, seconds, scratch, pg, banks, iteration): the block's best row groups
    for Lb in sizes:
        r = L % Lb
        full = L // Lb
        Lr = -(-r // PMAX) * PMAX if r else 0
        kt = kt_by_dma(Lb, Lr if r and not pos_split else 0, D, split, kvb, kv_rows or L, paged=paged,
                       pos_split=pos_split)
        more = full > (2 if pos_split else (0 if r else 1))
        pipe = sw.pipeline and more and not paged and not (r and not pos_split)
        for pg in valid_row_groups(R, Lb // PMAX, r=r, paged=paged, kt_dma=kt):
            shape = blocks.StreamShape(Lb=Lb, pg=pg, HC=heads, G=G, D=D, split=split, kvb=kvb, qb=qb, mb=mb, sb=sb,
                                       exact=exact, softcap=softcap, pipe=pipe, kt_dma=kt, pos_split=pos_split)
            scratch = blocks.sbuf_bytes(shape)
            banks = blocks.psum_banks(shape) if more else 0
            est = blocks.estimate(shape, hw, L, sequences=tokens, head_groups=head_groups)
            fits = scratch <= limit and banks <= blocks.PSUM_BANKS
            rows.append((Lb, pg, est.seconds, scratch, banks, fits))
            key = (not fits, est.seconds, scratch)
            if Lb not in best or key < best[Lb][:3]:
                best[Lb] = (not fits, est.seconds, scratch, pg, banks, est.iteration)
    if forced:
        fitting = [Lb for Lb in sizes if not best[Lb][0]]
        Lb = max(fitting) if fitting else min(sizes, key=lambda b: best[b][2])
        how = "forced (block option)" if not sw.row_groups else "forced (block and row-group options)"
    else:
        Lb = min(sizes, key=lambda b: best[b][:3])
        how = "modeled" if not best[Lb][0] else "nothing fits: the smallest scratch"
        if best[Lb][0]:
            Lb = min(sizes, key=lambda b: best[b][2])
        elif sw.row_groups:
            how = "modeled (row groups forced by the option)"
    unfit, seconds, scratch, pg, banks, iteration = best[Lb]
    return StreamChoice(Lb, pg, scratch, banks, seconds, iteration, how, tuple(rows))


def block_starts(L: int, Lb: int) -> tuple[list[int], list[int]]:
    """(first position, positions read) of each streamed block of a cache of ``L`` positions in blocks of ``Lb``.
    When ``Lb`` does not divide ``L``, the first ``r = L % Lb`` positions are one more block, read as the multiple
    of 128 above ``r`` (its positions past ``r`` belong to the next block and are masked in this one), so every
    read stays inside the cache and every block is a whole number of 128-position tiles."""
    r = L % Lb
    head = ([0], [-(-r // PMAX) * PMAX]) if r else ([], [])
    return head[0] + [r + k * Lb for k in range(L // Lb)], head[1] + [Lb] * (L // Lb)


def _stream_scratch(Lb: int, D: int, G: int, split: int, kvb: int, qb: int, mb: int, sb: int, pos_split: bool,
                    heads: int = 1, pg: int = 1, kt_dma: bool = False) -> int:
    """SBUF bytes per partition of the streamed template with blocks of ``Lb`` (:func:`.blocks.sbuf_bytes`): every
    tile once. Until 2026-12-07 the block's tiles were counted twice ("the next block's tiles are allocated while
    this block's are live"), which a hardware loop does not do: its body's tiles are allocated once and reused by
    every iteration (docs/performance.md, "Hardware loops: sourced entry", L1), and the interpreter's SBUF peak
    counts them once (``tests/serving/test_stream_choice.py``)."""
    return blocks.sbuf_bytes(blocks.StreamShape(Lb=Lb, pg=pg, HC=heads, G=G, D=D, split=split, kvb=kvb, qb=qb,
                                                mb=mb, sb=sb, kt_dma=kt_dma, pos_split=pos_split))


def _prefetch_bytes(bL: int, D: int, heads: int, kvb: int, mb: int, pipe: bool, kt_dma: bool) -> int:
    """SBUF bytes per partition of the prefetched first block (``StreamSwitches.prefetch``), live from the layer's start to the
    attention: K (or K^T by DMA), the mask, and V unless the pipelined loop loads block 0's V later."""
    nb = bL // PMAX
    k = heads * nb * (PMAX if kt_dma else D) * kvb
    return k + (0 if pipe else heads * nb * D * kvb) + bL * mb


def kt_by_dma(Lb: int, Lr: int, D: int, split: int, kvb: int, rows: int, *, paged: bool, pos_split: bool) -> bool:
    """Whether a streamed block takes K^T by ``dma_transpose`` (``StreamSwitches.kt_by_dma``). Why these conditions: the DMA
    transpose of an indirect (runtime-row) source needs a 2-byte dtype and a last dim of at most 128 (one partition
    tile per head, ``split == 1``), the loop's row index advances by whole rows of ``Lb / 128`` positions (a
    head split; a block split's per-core start is not done), and the score matmuls read K^T back in position
    order through a strided view, so every 512-column score chunk must be whole rows (``Lb / 128`` divides its
    start and size), and the cache's ``rows`` (batch x kv heads x positions) view as whole rows of ``Lb / 128``
    positions (the indirect index counts those rows). Paged gathers keep the Tensor-engine transposes."""
    if not switches().kt_by_dma or paged or pos_split or split != 1 or kvb != 2 or D > PMAX:
        return False
    for L_, nb in ((Lb, Lb // PMAX), (Lr, Lr // PMAX)):
        if L_ and (rows % nb or any(c % nb or n % nb for c, n, _ in tiles(L_, MOVING_MAX))):
            return False
    return True


def fold_matrix(R: int, groups: int) -> torch.Tensor:
    """[groups x R, R] fp32: 1 where row j x R + r meets column r; the matmul with it adds the row groups' states."""
    return torch.eye(R, dtype=torch.float32).repeat(groups, 1)


def head_group(heads: int, G: int) -> int:
    """kv heads whose scores share one [heads x G, Lb] tile: the largest divisor of a core's ``heads`` with at most
    128 rows. Why: the Vector/Scalar cost of a score op is its free size, whatever its partition count, so one
    instruction over all heads' rows replaces one per kv head."""
    return max((d for d in range(1, heads + 1) if heads % d == 0 and d * G <= PMAX), default=1)


@dataclass
class Attention(ir.Instruction):
    """Grouped-query decode attention over the whole static cache with an additive mask."""

    opcode: ClassVar[str] = "attention"
    q: ir.Value  # ACT [T, Hq * D]
    k_cache: ir.Value  # STATE [B, Hkv, L, D] (already holds this step's rows)
    v_cache: ir.Value
    mask: ir.Value  # INPUT [T, L] fp32 additive
    out: ir.Value  # ACT [T, Hq * D]
    scale: float
    groups: int  # query heads per kv head
    rounding: str = "eager"  # "eager": scores rounded to q's dtype after each op, like HF eager; "fused": fp32 (SDPA)
    softcap: float = 0.0  # Gemma 2: scores -> tanh(scores / softcap) * softcap before the mask (0: off)
    #: INPUT [T] int32: the position each sequence writes this step (its KV write's index); a streamed attention
    #: reads only the blocks up to it. None: every block (a full sliding window, no KV write in the kernel)
    index: ir.Value | None = None
    block: int = 0  # force the streamed template with blocks of this many positions (0: by the cache length)
    #: WEIGHT [Hq]: GPT-OSS's attention sinks, one logit per query head in each row's softmax (None: none). The
    #: single pass takes the sink into the row's max (exact like eager); the streamed template adds
    #: exp(sink - max of the scores) to the sum at the end, finite while a sink is under the row's largest score + 88
    sinks: ir.Value | None = None

    def constrain(self, c: ir.Constraints) -> None:
        c.heads(self.q, self.k_cache.shape[-1])
        c.heads(self.out, self.k_cache.shape[-1])

    def _choice(self, ctx: Context) -> StreamChoice | None:
        """This attention's streamed block and row groups (:func:`choose_stream`), or None for the single pass."""
        Hkv, L, D = self.kv_dims()
        lay = ctx.layout(self.q)
        exact = self.q.dtype != torch.float32 and self.rounding == "eager"
        per_core = ctx.split(Hkv) or Hkv
        HC = head_group(per_core, self.groups)
        return choose_stream(L, D, self.groups, lay.split, nbytes(self.k_cache.dtype), nbytes(self.q.dtype),
                             nbytes(self.mask.dtype), nbytes(self.q.dtype) if exact else 4,
                             pos_split=ctx.lnc == 2 and not ctx.split(Hkv), block=self.block, heads=HC,
                             exact=exact, softcap=bool(self.softcap), target=ctx.target,
                             kv_rows=self.k_cache.shape[0] * Hkv * L, tokens=ctx.tokens, head_groups=per_core // HC)

    def _plan(self, ctx: Context) -> tuple[int, int] | None:
        c = self._choice(ctx)
        return None if c is None else (c.Lb, c.scratch)

    def _scratch(self, ctx: Context, Lb: int, heads: int, pos_split: bool, pg: int = 1, kt_dma: bool = False) -> int:
        """SBUF bytes per partition of this attention's streamed block (:func:`_stream_scratch` with its dtypes)."""
        D = self.kv_dims()[2]
        qb = nbytes(self.q.dtype)
        exact = self.q.dtype != torch.float32 and self.rounding == "eager"
        return _stream_scratch(Lb, D, self.groups, ctx.layout(self.q).split, nbytes(self.k_cache.dtype), qb,
                               nbytes(self.mask.dtype), qb if exact else 4, pos_split, heads, pg, kt_dma)

    def _groups(self, ctx: Context, Lb: int = 0, paged: bool = False) -> tuple[int, int]:
        """(rows R of a head group, row groups) of the streamed template (the choice's, :func:`choose_stream`);
        (R, 1) when it does not stream or is paged. The one place both the constants (the fold matrix) and the
        emitter ask."""
        Hkv = self.kv_dims()[0]
        R = head_group(ctx.split(Hkv) or Hkv, self.groups) * self.groups
        choice = None if paged else self._choice(ctx)
        if choice is None:
            return R, 1
        if Lb and Lb != choice.Lb:
            raise CodegenError(f"attention: blocks of {Lb} asked, the plan chose {choice.Lb}")
        return R, choice.pg

    def constants(self, ctx: Context) -> dict[str, ir.Constant]:
        """The fold matrix of the row groups (:func:`fold_matrix`), when a streamed block has more than one."""
        R, pg = self._groups(ctx)
        return {f"c_fold_{pg}x{R}": ir.Constant(fold_matrix(R, pg), f"fold_{pg}x{R}")} if pg > 1 else {}

    def setup(self, ctx: Context) -> list[str]:
        """A streamed attention bounded by the sequences' positions reads them from the step's ``kv_index`` tile
        (loaded once per step; the KV writes share it)."""
        if self.index is None or KV_NEXT in ctx.inputs or self._plan(ctx) is None:
            return []
        out = [] if KV_INDEX in ctx.inputs else [code("kv_index.j2", T=ctx.tokens, index=self.index.name)]
        ctx.inputs[KV_INDEX] = KV_INDEX
        ctx.inputs[KV_NEXT] = KV_NEXT
        return out + [code("kv_next.j2", T=ctx.tokens, src=KV_INDEX, dst=KV_NEXT)]

    def emit(self, ctx: Context, i: int) -> Emitted:
        B, Hkv, L, D = self.k_cache.shape
        Hq = self.q.features // D
        G = self.groups
        T = ctx.tokens
        if Hq != Hkv * G:
            raise CodegenError(f"{Hq} query heads are not {Hkv} kv heads x {G}")
        lay = ctx.layout(self.q)
        S = lay.split  # partition tiles per head (D > 128): q.k^T accumulates over them, P.V yields one per tile
        if ctx.layout(self.out) != lay or lay.P * S != D:
            raise CodegenError(f"attention over heads of {D} features needs q and out split alike ({lay}, "
                               f"{ctx.layout(self.out)})")
        if G > PMAX or lay.P > PMAX or S * G > PSUM_FREE_FP32:
            raise CodegenError(f"attention group {G} or head size {D} exceeds {PMAX} partitions")
        plan = self._plan(ctx)
        if plan is not None:
            return self._emit_streamed(ctx, plan)
        v = ctx.var(self.out)
        kvb = nbytes(self.k_cache.dtype)
        qb = nbytes(self.q.dtype)
        e = Emitted(sbuf=S * L * kvb + L * (4 + 4 + qb) + (L * nbytes(self.mask.dtype)) + 2 * D * kvb * max(1, L // PMAX)
                    + Hq * T * qb,
                    psum_banks=3)
        # bf16 eager attention rounds after the matmul, the scale and the mask add; SDPA keeps scores in fp32
        exact = self.q.dtype != torch.float32 and self.rounding == "eager"
        cap = self.softcap
        per_core = ctx.split(Hkv)
        e.code("attention.j2", module=self.module or "", aten=aten(self), name=inst_name(self), D=D, Hq=Hq, Hkv=Hkv,
               G=G, L=L, T=T, out=v, dtype=nl_dtype(self.out.dtype), kv_dtype=nl_dtype(self.k_cache.dtype),
               mask=f"{v}_mask", mask_hbm=ctx.var(self.mask), mask_dtype=nl_dtype(self.mask.dtype),
               kT=f"{v}_kT", kn=f"{v}_kn", kps=f"{v}_kps", s=f"{v}_s", sps=f"{v}_sps", negmax=f"{v}_negmax",
               e=f"{v}_e", ssum=f"{v}_ssum", rsum=f"{v}_rsum", p=f"{v}_p", ops=f"{v}_ops", pTps=f"{v}_pTps",
               pT=f"{v}_pT", vn=f"{v}_vn", q=ctx.var(self.q), k_cache=ctx.var(self.k_cache),
               v_cache=ctx.var(self.v_cache), tiles=tiles(L, PMAX), chunks=[(c, s) for c, s, _ in tiles(L, MOVING_MAX)],
               scale=repr(float(self.scale)), exact_rounding=exact,
               score_dtype=nl_dtype(self.q.dtype if exact else torch.float32),
               softcap=repr(float(cap)) if cap else "", inv_softcap=repr(1.0 / cap) if cap else "",
               scale_over_cap=repr(float(self.scale) / cap) if cap else "",
               g_range=expr("exprs.j2", "core_range", per_core=per_core, total=Hkv),
               half=per_core * G if per_core else 0, whole=L > PMAX and L % PMAX == 0, split=S, P=lay.P,
               **self._sink_args(ctx, v))
        return e

    def _sink_args(self, ctx: Context, v: str) -> dict[str, str]:
        """The templates' sink variables (empty ``sinks``: no sinks)."""
        if self.sinks is None:
            return {"sinks": ""}
        return {"sinks": ctx.var(self.sinks), "sinks_dtype": nl_dtype(self.sinks.dtype), "sk": f"{v}_sk",
                "skn": f"{v}_skn", "ske": f"{v}_ske"}

    def _emit_streamed(self, ctx: Context, plan: tuple[int, int], **paged: Any) -> Emitted:
        """The streamed template; ``paged`` (from :class:`~.paged_attention.PagedAttention`): the K/V loads become
        block-table gathers over a static loop of blocks (each guarded by the sequence's extent when ``dynamic``)."""
        Hkv, L, D = self.kv_dims()
        Hq, G, T = self.q.features // D, self.groups, ctx.tokens
        lay = ctx.layout(self.q)
        S, P = lay.split, lay.P
        Lb, _ = plan
        nb = Lb // PMAX
        if D * 4 > PSUM_FREE_FP32 * 4 or D + 2 > PSUM_FREE_FP32:
            raise CodegenError(f"a streamed attention keeps [G, {D}] outputs in one PSUM bank")
        v = ctx.var(self.out)
        kvb, qb = nbytes(self.k_cache.dtype), nbytes(self.q.dtype)
        exact = self.q.dtype != torch.float32 and self.rounding == "eager"
        per_core = ctx.split(Hkv)
        pos_split = paged.pop("pos_split", ctx.lnc == 2 and not per_core)
        dynamic = paged.pop("dynamic", self.index is not None and KV_INDEX in ctx.inputs)
        index = paged.pop("index", ctx.inputs.get(KV_INDEX, ""))  # the [1, T] tile the loop bound is loaded from
        # a cache that is not a multiple of Lb: its first r positions are one more block, read as Lr (a multiple of
        # 128) whose positions r ... Lr - 1 are masked (the next block reads them); first under a head split (the
        # blocks start at r), after the combine under a block split (both cores, on the same combined state)
        starts, sizes = block_starts(L, Lb)
        r, Lr, full, nblocks = L % Lb, sizes[0] if L % Lb else 0, L // Lb, len(starts)
        more = paged.pop("more", full > (2 if pos_split else (0 if r else 1)))
        first_pos = (f"{r} + pid * {Lb}" if r else f"pid * {Lb}") if pos_split else ""
        cap = self.softcap
        # the core's kv heads in groups of HC sharing one [R, Lb] score tile (zero-padded q and P^T, see the template)
        HC = head_group(per_core or Hkv, G)
        R = HC * G
        kv_rows = self.k_cache.shape[0] * Hkv * L
        kt_dma = kt_by_dma(Lb, Lr if r and not pos_split else 0, D, S, kvb, kv_rows, paged=bool(paged.get("paged")),
                           pos_split=pos_split)
        pg = self._groups(ctx, Lb, paged=bool(paged.get("paged")))[1]
        if pg > 1 and f"fold_{pg}x{R}" not in ctx.consts:  # constants() decided otherwise: never fold without it
            raise CodegenError(f"attention: {pg} row groups of {R} rows without their fold matrix")
        scratch = self._scratch(ctx, Lb, HC, pos_split, pg, kt_dma)
        pipe = switches().pipeline and more and not paged.get("paged") and not (r and not pos_split)
        chunks = tiles(Lb // pg, MOVING_MAX)
        # pipelined: the block's score chunks are all live in PSUM at once (evicted after the previous block's
        # softmax); in a block loop every PSUM allocation site of the body is one tile live for the whole loop
        banks = 5 + (len(chunks) - 1 if pipe else 0)
        if more and not paged.get("paged"):
            banks = max(banks, blocks.psum_banks(blocks.StreamShape(
                Lb=Lb, pg=pg, HC=HC, G=G, D=D, split=S, kvb=kvb, qb=qb, mb=nbytes(self.mask.dtype),
                sb=qb if exact else 4, exact=exact, softcap=bool(cap), pipe=pipe, kt_dma=kt_dma, pos_split=pos_split)))
        choice = None if paged.get("paged") else self._choice(ctx)
        e = Emitted(sbuf=scratch + Hq * S * T * qb, psum_banks=banks)
        kgroup = max(1, min(nb, (2 * PSUM_FREE_FP32) // (PMAX * kvb)))  # K^T tiles per 2 KiB PSUM tile
        pgroup = max(1, min(nb, (2 * PSUM_FREE_FP32) // (pg * R * qb)))  # P^T tiles per PSUM tile
        nbr = Lr // PMAX
        names = {k: f"{v}_{k}" for k in ("kn", "vn", "mk", "kT", "kps", "s", "sps", "nm", "l", "acc", "bm", "alpha",
                                           "p", "lb", "pTz", "pTps", "ops", "st", "sto", "rl", "o", "oTps", "npos",
                                           "qz", "kh", "kio", "kidx", "bmc", "vprev", "nnext", "gT", "gr",
                                           "gm", "gw", "gs", "gf")}
        prefetch = switches().prefetch and dynamic and not pos_split and not paged.get("paged")
        odd_first = bool(r) and not pos_split
        tctx = dict(module=self.module or "", aten=aten(self), name=inst_name(self), D=D, P=P,
               split=S, Hq=Hq, Hkv=Hkv, G=G, L=L, Lb=Lb, nb=nb, T=T, out=v, dtype=nl_dtype(self.out.dtype),
               kv_dtype=nl_dtype(self.k_cache.dtype), mask_hbm=ctx.var(self.mask),
               mask_dtype=nl_dtype(self.mask.dtype), q=ctx.var(self.q), k_cache=ctx.var(self.k_cache),
               v_cache=ctx.var(self.v_cache), chunks=[(c, n) for c, n, _ in chunks],
               kgroups=[(c, n) for c, n, _ in tiles(nb, kgroup)], pgroups=[(c, n) for c, n, _ in tiles(nb, pgroup)],
               kgroup=kgroup, scale=repr(float(self.scale)), exact_rounding=exact,
               score_dtype=nl_dtype(self.q.dtype if exact else torch.float32),
               softcap=repr(float(cap)) if cap else "", inv_softcap=repr(1.0 / cap) if cap else "",
               scale_over_cap=repr(float(self.scale) / cap) if cap else "",
               g_range=expr("exprs.j2", "core_range", per_core=per_core, total=Hkv),
               half=per_core * G if per_core else 0, pos_split=pos_split, dynamic=dynamic, HC=HC, R=R,
               ngroups=(per_core or Hkv) // HC, head0=f"pid * {per_core} + " if per_core else "",
               q_dtype=nl_dtype(self.q.dtype),
               index=index, index_next=ctx.inputs.get(KV_NEXT, ""), more=more, i=f"{v}_pos",
               loop_start=f"{r + 2 * Lb} + pid * {Lb}" if pos_split else str(r or Lb),
               loop_step=2 * Lb if pos_split else Lb, nblocks=nblocks, starts=starts, first_pos=first_pos,
               r=r, Lr=Lr, nbr=nbr, odd_first=odd_first, odd_last=bool(r) and pos_split,
               chunks_r=[(c, n) for c, n, _ in tiles(Lr, MOVING_MAX)],
               kgroups_r=[(c, n) for c, n, _ in tiles(nbr, max(1, min(nbr, kgroup)))],
               pgroups_r=[(c, n) for c, n, _ in tiles(nbr, max(1, min(nbr, pgroup)))],
               mask_min=repr(float(torch.finfo(self.mask.dtype).min)), kt_dma=kt_dma, kv_rows=kv_rows, pipe=pipe,
               prefetch=prefetch, bL0=Lr if odd_first else Lb, pg=pg, RR=pg * R, gq_rows=PMAX // pg,
               fold=ctx.consts.get(f"fold_{pg}x{R}", ""), choice_note=choice.note() if choice else "",
               **{"paged": False, "segments": [], "table": "", "MB": 0, **paged}, **names,
               **self._sink_args(ctx, v))
        e.code("attention_stream.j2", early=False, **tctx)
        if prefetch:
            e.early.append(code("attention_stream.j2", early=True, **tctx))
            e.early_sbuf = _prefetch_bytes(Lr if odd_first else Lb, D, HC, kvb, nbytes(self.mask.dtype), pipe, kt_dma)
        return e

    def kv_dims(self) -> tuple[int, int, int]:
        """(kv heads, cache positions, head size) of the cache this attention reads."""
        _, Hkv, L, D = self.k_cache.shape
        return Hkv, L, D

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        k, v = env[self.k_cache.name], env[self.v_cache.name]
        B, Hkv, L, D = k.shape
        q = env[self.q.name].reshape(B, -1, 1, D)
        mask = env[self.mask.name].reshape(B, 1, 1, L)
        k = k.repeat_interleave(self.groups, dim=1)
        v = v.repeat_interleave(self.groups, dim=1)
        if self.rounding == "eager":
            scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        else:
            scores = torch.matmul(q.float(), k.float().transpose(2, 3)) * self.scale
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores + (mask if self.rounding == "eager" else mask.float())
        if self.sinks is not None:  # GPT-OSS: the sink joins the row's max and sum; its probability is dropped
            sink = env[self.sinks.name].reshape(1, -1, 1, 1).expand(B, -1, 1, 1).to(scores.dtype)
            scores = torch.cat([scores, sink], dim=-1)
            scores = scores - scores.amax(dim=-1, keepdim=True)
            p = torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype)
            env[self.out.name] = torch.matmul(p, v).reshape(self.out.shape)
            return
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        env[self.out.name] = torch.matmul(p, v).reshape(self.out.shape)


def _check(m: Any, graph: Any, tokens: int | None) -> str | None:
    if not m.inputs.get("mask"):
        return "decode attention without a mask input is not supported (the static cache needs one)"
    return None


def bool_to_additive(mask: torch.Tensor) -> torch.Tensor:
    """SDPA's boolean mask (True = attend) as the additive fp32 mask the kernel adds: 0 / the most negative fp32
    (the host converts each step's mask; ``ArgSource.convert``)."""
    return torch.zeros(mask.shape, dtype=torch.float32).masked_fill(~mask, torch.finfo(torch.float32).min)


def shared_mask_rows(mask: torch.Tensor, *, rows: int, boolean: bool) -> torch.Tensor:
    """A ``[1, 1, 1, L]`` mask shared by the batch as ``rows`` rows (one per sequence), additive fp32 when it is
    boolean."""
    mask = bool_to_additive(mask) if boolean else mask
    return mask.reshape(1, mask.shape[-1]).expand(rows, mask.shape[-1])


@register_lowering(decode_attention, decode_attention_softcap, decode_attention_sinks, check=_check,
                   instructions=[Attention])
def lower_attention(L: Lowerer, m: Any) -> None:
    q_node = L.input(m, "q")
    q = L.act(q_node, L.views(m, "q"))
    k = L.hbm(L.input(m, "k"))
    v = L.hbm(L.input(m, "v"))
    if k.kind != V.STATE:
        raise CodegenError("attention keys must be the KV cache updated by this step")
    B, Hkv, Lc, D = k.shape
    mask_node = m.inputs.get("mask")
    if not mask_node:
        raise CodegenError("decode attention without a mask input is not supported (the static cache needs one)")
    bool_mask = L.node(mask_node).get("dtype") == "bool"
    mask = L.step_input(mask_node, (L.T, Lc), torch.float32 if bool_mask else None, label="attn_mask")
    mask_shape = tuple(L.node(mask_node).get("shape") or ())
    if L.T > 1 and len(mask_shape) == 4 and mask_shape[0] == 1:
        # one mask row for every sequence (sdpa_shared_mask): repeated per sequence on the host
        L.arg_source(mask).convert = functools.partial(shared_mask_rows, rows=L.T, boolean=bool_mask)
    elif bool_mask:
        L.arg_source(mask).convert = bool_to_additive
    groups = int(m.params.get("num_key_value_groups") or (q.features // D) // Hkv)
    scale = float(m.params.get("scale", D ** -0.5))
    out = L.new_act(L.output(m), L.label(m, "attn"))
    # the pattern's SDPA implementations keep the scores in fp32; its eager one rounds them like HF eager
    rounding = "fused" if str(getattr(m, "variant", "")).startswith("sdpa") else "eager"
    # the positions this step's KV write of these keys uses bound what a streamed attention reads (positions
    # after the one a sequence writes are masked: HF's causal masks, the serving steps' length masks)
    index = kv_positions(L).get(k.name)
    sinks = L.hbm(L.input(m, "sinks")) if m.inputs.get("sinks") else None  # GPT-OSS: read as it is, [Hq]
    L.emit(Attention(q=q, k_cache=k, v_cache=v, mask=mask, out=out, scale=scale, groups=groups, rounding=rounding,
                     softcap=float(m.params.get("softcap") or 0.0), index=index, sinks=sinks), m)


def _settings_switches(settings: Any) -> contextlib.AbstractContextManager:
    """The ``attn_*`` options of ``settings`` as the switches of every kernel built under them."""
    return use_switches(StreamSwitches.from_settings(settings))


register_codegen_options("attention", _settings_switches)
