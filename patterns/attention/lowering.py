"""Grouped-query decode attention over a static KV cache with an additive mask (+ Gemma 2 soft-capping).

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
at the end), so a softmax instruction runs over ``Lb / groups`` columns. Rounding: scores exactly as below; the probabilities are
  rounded before normalization (``exp(s - running max)`` in the query dtype, the sum and the rescaling in fp32,
  one division at the end), see docs/serving.md for the tolerance.

The score rounding follows the captured implementation: HF eager rounds to the query dtype after each op, SDPA
keeps fp32 (the match's ``variant``).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator

import torch

from fusegraph.codegen.api import (aten, code, CodegenError, Context, Emitted, expr, inst_name, ir, KV_INDEX, KV_NEXT,
                                    kv_positions, Lowerer, MOVING_MAX, nbytes, nl_dtype, PMAX, PSUM_FREE_FP32,
                                    register_codegen_options, register_lowering, tiles)
from .decode_attention import decode_attention, decode_attention_softcap

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
    #: the largest streamed block, in positions (one K and one V DMA of Lb x head_dim per block and kv head)
    block_max: int = 2048
    #: the largest streamed block of a paged attention (``paged_attention.py``)
    paged_block_max: int = 512
    #: the largest SBUF scratch per partition a streamed block may take (a smaller block is chosen above it)
    scratch_max: int = 64 * 1024
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
    #: at most this many *row groups* share a score tile: each row group holds its own contiguous part of every
    #: block (positions j x Lb / groups ...) with its own running softmax state, and the groups are folded once at
    #: the end, so a core with few query rows (a TP rank's one kv head: 8 rows) fills more partitions and each
    #: Vector/Scalar instruction of a block runs over Lb / groups columns instead of Lb (its cost is its free size).
    #: 4: the P^T copies into a group's partitions must start at 0/32/64/96 (nkisim's start-partition rule); 1 off
    row_groups: int = 4

    @classmethod
    def from_settings(cls, settings: Any) -> "StreamSwitches":
        """The switches a :class:`fusegraph.settings.Settings` asks for (its ``attn_*`` fields)."""
        return cls(stream_above=settings.attn_stream_above, block_max=settings.attn_block_max,
                   paged_block_max=settings.attn_paged_block_max, scratch_max=settings.attn_stream_scratch_kib * 1024,
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


def stream_plan(L: int, D: int, G: int, split: int, kvb: int, qb: int, mb: int, sb: int, *, pos_split: bool = False,
                block: int = 0, heads: int = 1) -> tuple[int, int] | None:
    """(block positions, SBUF scratch per partition) of the streamed template for a cache of ``L`` positions, or
    None when the single-pass template takes it (``block``: force streaming with this block size, for tests).
    Blocks are multiples of 128 positions that divide ``L`` when ``L`` is a multiple of 128; any other length
    takes the largest block within the scratch limit and reads its first ``L % Lb`` positions as one more, shorter
    block (both cores need a block each under a block split);
    ``heads``: kv heads sharing one score tile (:func:`head_group`), whose K/V tiles a block holds at once."""
    sw = switches()
    if not block and L <= sw.stream_above:
        return None
    top = min(block or sw.block_max, L // 2 if pos_split else L)
    best = None
    for Lb in range(PMAX, top + 1, PMAX):
        if L % PMAX == 0 and L % Lb:
            continue  # a multiple of 128 streams in equal blocks; any other length has one more, shorter block
        scratch = _stream_scratch(Lb, D, G, split, kvb, qb, mb, sb, pos_split, heads)
        if best is None or scratch <= sw.scratch_max:
            best = (Lb, scratch)
    if best is None:
        raise CodegenError(f"no block of {PMAX}-multiples fits {L} cache positions"
                           + (" twice (LNC=2 splits the blocks between the cores)" if pos_split else ""))
    return best


def block_starts(L: int, Lb: int) -> tuple[list[int], list[int]]:
    """(first position, positions read) of each streamed block of a cache of ``L`` positions in blocks of ``Lb``.
    When ``Lb`` does not divide ``L``, the first ``r = L % Lb`` positions are one more block, read as the multiple
    of 128 above ``r`` (its positions past ``r`` belong to the next block and are masked in this one), so every
    read stays inside the cache and every block is a whole number of 128-position tiles."""
    r = L % Lb
    head = ([0], [-(-r // PMAX) * PMAX]) if r else ([], [])
    return head[0] + [r + k * Lb for k in range(L // Lb)], head[1] + [Lb] * (L // Lb)


def _stream_scratch(Lb: int, D: int, G: int, split: int, kvb: int, qb: int, mb: int, sb: int, pos_split: bool,
                    heads: int = 1, pg: int = 1) -> int:
    """SBUF bytes per partition of one streamed block, counted twice: the next block's tiles are allocated while
    this block's are live (double-buffered K/V loads); plus the zero-padded q and P^T tiles, allocated once."""
    nb = Lb // PMAX
    R = heads * G * pg
    block = (2 * heads * nb * D * kvb + heads * split * Lb * kvb + Lb // pg * (mb + sb + qb)
             + D * 4 + D * qb + 8 * 4 + (2 * (D + 2) * 4 if pos_split else 0) + ((D + 1) * 4 + R * 8 if pg > 1 else 0))
    return 2 * block + heads * nb * R * qb + split * heads * pg * R * qb


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


def row_groups(R: int, nb: int, *, r: int, paged: bool, kt_dma: bool,
               scratch: Callable[[int], int] | None = None) -> int:
    """Row groups of a streamed block (``StreamSwitches.row_groups``): the most, up to it, with at most 128 rows in all that
    divide the block's 128-position tiles (``nb``) and whose block scratch (``scratch(groups)``) stays within
    ``StreamSwitches.scratch_max`` (or within one group's, if that is above it: the zero-padded q and P^T grow with the
    groups); 1 for a short first block (``r``), paged gathers and K^T by DMA (its strided score read is per
    position row)."""
    if r or paged or kt_dma:
        return 1
    sw = switches()
    fits = [g for g in range(1, sw.row_groups + 1) if g == 1 or (g * R <= PMAX and nb % g == 0 and PMAX % g == 0
                                                              and (PMAX // g) % 32 == 0)]
    if scratch is not None:
        limit = max(sw.scratch_max, scratch(1))
        fits = [g for g in fits if scratch(g) <= limit]
    return max(fits)


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

    def constrain(self, c: ir.Constraints) -> None:
        c.heads(self.q, self.k_cache.shape[-1])
        c.heads(self.out, self.k_cache.shape[-1])

    def _plan(self, ctx: Context) -> tuple[int, int] | None:
        Hkv, L, D = self.kv_dims()
        lay = ctx.layout(self.q)
        exact = self.q.dtype != torch.float32 and self.rounding == "eager"
        return stream_plan(L, D, self.groups, lay.split, nbytes(self.k_cache.dtype), nbytes(self.q.dtype),
                           nbytes(self.mask.dtype), nbytes(self.q.dtype) if exact else 4,
                           pos_split=ctx.lnc == 2 and not ctx.split(Hkv), block=self.block,
                           heads=head_group(ctx.split(Hkv) or Hkv, self.groups))

    def _scratch(self, ctx: Context, Lb: int, heads: int, pos_split: bool, pg: int = 1) -> int:
        """SBUF bytes per partition of this attention's streamed block (:func:`_stream_scratch` with its dtypes)."""
        D = self.kv_dims()[2]
        qb = nbytes(self.q.dtype)
        exact = self.q.dtype != torch.float32 and self.rounding == "eager"
        return _stream_scratch(Lb, D, self.groups, ctx.layout(self.q).split, nbytes(self.k_cache.dtype), qb,
                               nbytes(self.mask.dtype), qb if exact else 4, pos_split, heads, pg)

    def _groups(self, ctx: Context, Lb: int = 0, paged: bool = False) -> tuple[int, int]:
        """(rows R of a head group, row groups) of the streamed template in blocks of ``Lb`` (0: the plan's); (R, 1)
        when it does not stream. The one place both the constants (the fold matrix) and the emitter ask."""
        Hkv, L, D = self.kv_dims()
        HC = head_group(ctx.split(Hkv) or Hkv, self.groups)
        R = HC * self.groups
        plan = self._plan(ctx)
        if plan is None or paged:
            return R, 1
        Lb = Lb or plan[0]
        pos_split = ctx.lnc == 2 and not ctx.split(Hkv)
        kt = kt_by_dma(Lb, 0, D, ctx.layout(self.q).split, nbytes(self.k_cache.dtype),
                       self.k_cache.shape[0] * Hkv * L, paged=False, pos_split=pos_split)
        return R, row_groups(R, Lb // PMAX, r=L % Lb, paged=False, kt_dma=kt,
                             scratch=lambda g: self._scratch(ctx, Lb, HC, pos_split, g))

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
               half=per_core * G if per_core else 0, whole=L > PMAX and L % PMAX == 0, split=S, P=lay.P)
        return e

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
        scratch = self._scratch(ctx, Lb, HC, pos_split, pg)
        pipe = switches().pipeline and more and not paged.get("paged") and not (r and not pos_split)
        chunks = tiles(Lb // pg, MOVING_MAX)
        # pipelined: the block's score chunks are all live in PSUM at once (evicted after the previous block's softmax)
        e = Emitted(sbuf=scratch + Hq * S * T * qb, psum_banks=5 + (len(chunks) - 1 if pipe else 0))
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
               fold=ctx.consts.get(f"fold_{pg}x{R}", ""),
               **{"paged": False, "segments": [], "table": "", "MB": 0, **paged}, **names)
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


@register_lowering(decode_attention, decode_attention_softcap, check=_check, instructions=[Attention])
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
    if bool_mask:
        L.arg_source(mask).convert = bool_to_additive
    groups = int(m.params.get("num_key_value_groups") or (q.features // D) // Hkv)
    scale = float(m.params.get("scale", D ** -0.5))
    out = L.new_act(L.output(m), L.label(m, "attn"))
    # the pattern's SDPA implementations keep the scores in fp32; its eager one rounds them like HF eager
    rounding = "fused" if str(getattr(m, "variant", "")).startswith("sdpa") else "eager"
    # the positions this step's KV write of these keys uses bound what a streamed attention reads (positions
    # after the one a sequence writes are masked: HF's causal masks, the serving steps' length masks)
    index = kv_positions(L).get(k.name)
    L.emit(Attention(q=q, k_cache=k, v_cache=v, mask=mask, out=out, scale=scale, groups=groups, rounding=rounding,
                     softcap=float(m.params.get("softcap") or 0.0), index=index), m)


def _settings_switches(settings: Any) -> contextlib.AbstractContextManager:
    """The ``attn_*`` options of ``settings`` as the switches of every kernel built under them."""
    return use_switches(StreamSwitches.from_settings(settings))


register_codegen_options("attention", _settings_switches)
