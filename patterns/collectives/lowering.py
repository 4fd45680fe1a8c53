"""Tensor-parallel collectives inside the megakernel: ``nki.collectives.all_reduce`` / ``all_gather`` on the SBUF
activation tiles (``fusegraph.all_reduce``, ``fusegraph.all_gather``; docs/tp.md).

Why SBUF: the hidden state lives in SBUF for the whole decoder stack; an SBUF collective ("2-D tensors with a single
free dimension", the 2.29 stub) keeps it there across the all-reduce after ``o_proj`` / ``down_proj`` / the MoE
experts, with no HBM round trip. An activation tile ``[P, FT, T]`` is contiguous, so ``.reshape((P, FT*T))`` is
the copy-free 2-D view the API wants.

* all-reduce: ``srcs=[x]``, ``dsts=[out]`` (same layout), ``op`` = ``nl.add`` / ``nl.maximum`` / ``nl.minimum``
  (torch's ``sum`` / ``max`` / ``min``; ``avg`` is refused: no NKI reduce op computes it).
* all-gather of the features (the ``lm_head`` logits, an ``embedding_colwise`` hidden slice): along the free dim
  (``collective_dim=1``). Rank r's block ``[P, FT*T]`` lands at free offset ``r*FT*T``, i.e. chunk ``r*FT + ft`` of
  a ``[P, W*FT, T]`` tile: with the chunk-major layout (feature ``ft*P + p``) and one partition count P for the
  local and the gathered value, that tile *is* the gathered vector (feature ``r*F + ft*P + p``), so no reshuffle
  is needed. The instruction pins both layouts to P partitions (``c.heads``); the gathered logits are then stored
  from a chunk-major tile (not the partition-major one a plain ``lm_head`` uses).

The replica group is the program's process group: its ranks must be the whole ``torch.distributed`` job's ranks
``0..W-1`` in order (the interpreter's transport carries kernel collectives over the job's default group; a
sub-mesh group is refused at region formation). LNC=2 composes: each of the two programs of a rank issues the
collective on its own full copy of the value (the ops before exchange their halves with ``sendrecv``), and the
interpreter pairs program p of every rank. The reference VM does the real collective over ``torch.distributed``
(a group of one: the identity).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fusegraph.codegen.api import (aten, CodegenError, Context, Emitted, inst_name, ir, Lowerer, nl_dtype,
                                    PrefetchPoint, register_lowering, x_tokens)
from .all_gather import all_gather as all_gather_pattern
from .all_reduce import all_reduce as all_reduce_pattern

#: torch's functional reduce ops -> the NKI reduce op of ``nki.collectives.all_reduce``
REDUCE_OPS = {"sum": "nl.add", "max": "nl.maximum", "min": "nl.minimum"}
_TORCH_REDUCE = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def _world() -> tuple[bool, int, int]:
    """(torch.distributed initialized, world size, this rank)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return True, dist.get_world_size(), dist.get_rank()
    except Exception:  # noqa: BLE001 - a half-initialized job behaves like none
        pass
    return False, 1, 0


def group_refusal(ranks: Any, size: Any) -> str | None:
    """Why a collective over ``ranks`` cannot run inside a kernel of this process (None: it can)."""
    if not ranks:
        return "its process group is unknown in this process"
    ranks = [int(r) for r in ranks]
    if size is not None and int(size) != len(ranks):
        return f"its group size {size} does not match its ranks {ranks}"
    if ranks != sorted(ranks) or len(set(ranks)) != len(ranks):
        return f"its group ranks {ranks} are not increasing"
    up, world, _ = _world()
    if len(ranks) > 1 and up and ranks != list(range(world)):
        # the interpreter's transport maps kernel ranks to the job's default group
        return f"its group {ranks} is not the whole job (ranks 0..{world - 1}); sub-mesh groups are not lowered"
    return None


def reference_collective(op: str, x: torch.Tensor, ranks: tuple[int, ...], reduce: str = "sum") -> torch.Tensor:
    """The collective on the real ``torch.distributed`` job (features gathered along the last dim): what the
    reference VM computes for :class:`AllReduce` / :class:`AllGather`."""
    if len(ranks) == 1:
        return x.clone()
    up, world, _ = _world()
    if not up or list(ranks) != list(range(world)):
        raise CodegenError(f"the reference of a {op} over ranks {list(ranks)} needs those ranks' torch.distributed "
                           f"job (this process has {'none' if not up else f'{world} ranks'})")
    import torch.distributed as dist

    if op == "all_reduce":
        t = x.detach().clone().contiguous()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, _TORCH_REDUCE[reduce]))
        return t
    parts = [torch.empty_like(x) for _ in ranks]
    dist.all_gather(parts, x.detach().contiguous())
    return torch.cat(parts, dim=-1)


def _flat(var: str, P: int, n: int) -> str:
    return f"{var}.reshape(({P}, {n}))"


@dataclass
class AllReduce(ir.Instruction):
    """``out = reduce(x over the ranks)``: one SBUF ``nki.collectives.all_reduce`` of the activation tile."""

    opcode: ClassVar[str] = "all_reduce"
    x: ir.Value
    out: ir.Value
    ranks: tuple[int, ...] = (0,)
    reduce: str = "sum"

    def constrain(self, c: ir.Constraints) -> None:
        c.same(self.x, self.out)

    def emit(self, ctx: Context, i: int) -> Emitted:
        lay = ctx.layout(self.out)
        n = lay.FT * ctx.tokens
        e = Emitted(sbuf=n * torch.empty((), dtype=self.out.dtype).element_size())
        e.code("collective_all_reduce.j2", module=self.module or "", aten=aten(self), name=inst_name(self),
               P=lay.P, FT=lay.FT, T=ctx.tokens, out=ctx.var(self.out), dtype=nl_dtype(self.out.dtype),
               src=_flat(ctx.var(self.x), lay.P, n), dst=_flat(ctx.var(self.out), lay.P, n),
               ranks=list(self.ranks), op=REDUCE_OPS[self.reduce], reduce=self.reduce, lnc=ctx.lnc)
        # the kernel waits for its peers here (what reads the sum waits): weight DMAs issued now fill that time
        e.pieces.append(PrefetchPoint(i))
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        env[self.out.name] = reference_collective("all_reduce", env[self.x.name], self.ranks, self.reduce)


@dataclass
class AllGather(ir.Instruction):
    """``out = concat(x of every rank, features)``: one SBUF ``nki.collectives.all_gather`` along the free dim.

    ``store`` (set by the lowering when the gathered value is only a kernel output, the ``lm_head`` logits): the
    local value is partition-major (``f = p*FT + ft``), its gathered tile ``[P, W*FT, T]`` holds rank r's block at
    chunks ``[r*FT, (r+1)*FT)`` (feature ``r*F + p*FT + ft``, not a :class:`Layout`), and this instruction stores it
    to the HBM output itself: ``P x W`` descriptors of ``FT`` contiguous features (the chunk-major form is one
    element per descriptor). ``tail``: the last ``F mod 128`` local features as their own partition-major value
    (``lm_head`` split by :func:`..linear.lower_linear` so that the bulk has 128 output partitions), gathered and
    stored the same way after ``x``'s ``F - F mod 128`` features of each rank."""

    opcode: ClassVar[str] = "all_gather"
    x: ir.Value
    out: ir.Value
    ranks: tuple[int, ...] = (0,)
    store: bool = False
    tail: ir.Value | None = None

    def partitions(self) -> int:
        from fusegraph.codegen.api import largest_divisor

        return largest_divisor(self.x.features)

    def local_features(self) -> int:
        return self.x.features + (self.tail.features if self.tail is not None else 0)

    def constrain(self, c: ir.Constraints) -> None:
        if self.store:  # stored by this instruction: large descriptors need the partition-major local layout
            c.prefer_pmajor(self.x)
            if self.tail is not None:
                c.prefer_pmajor(self.tail)
            return
        # the rank blocks concatenate into the gathered vector only for chunk-major tiles of one partition count
        P = self.partitions()
        c.heads(self.x, P)
        c.heads(self.out, P)

    def emit(self, ctx: Context, i: int) -> Emitted:
        if self.store:
            return self._emit_stored(ctx)
        lx, lo = ctx.layout(self.x), ctx.layout(self.out)
        W = len(self.ranks)
        if lx.pmajor or lo.pmajor or lx.split != 1 or lo.split != 1 or lx.P != lo.P or lo.FT != W * lx.FT:
            raise CodegenError(f"all-gather needs chunk-major tiles of one partition count, got {lx} -> {lo}")
        n = lx.FT * ctx.tokens
        e = Emitted(sbuf=W * n * torch.empty((), dtype=self.out.dtype).element_size())
        e.code("collective_all_gather.j2", module=self.module or "", aten=aten(self), name=inst_name(self),
               P=lo.P, FT=lo.FT, T=ctx.tokens, out=ctx.var(self.out), dtype=nl_dtype(self.out.dtype),
               src=_flat(ctx.var(self.x), lx.P, n), dst=_flat(ctx.var(self.out), lo.P, W * n),
               ranks=list(self.ranks), W=W, lnc=ctx.lnc)
        return e

    def _emit_stored(self, ctx: Context) -> Emitted:
        """One SBUF all-gather of the local tile (``x``'s chunks, then ``tail`` as one more chunk), then the stores
        of the gathered tile straight to the HBM output, ``FT`` contiguous features per descriptor."""
        dst = ctx.stores.get(self.out.name)
        if dst is None or self.out.name not in ctx.store_only:
            raise CodegenError(f"all-gather {self.out.name}: lowered as stored by the gather, but its value is read "
                               f"by more than one store")
        W, T = len(self.ranks), ctx.tokens
        Fl = self.local_features()
        if self.out.features != W * Fl:
            raise CodegenError(f"all-gather of {Fl} features over {W} ranks gives {self.out.features} features")
        lx = ctx.layout(self.x)
        lt = ctx.layout(self.tail) if self.tail is not None else None
        for v, lay in ((self.x, lx), (self.tail, lt)):
            if lay is not None and (not lay.pmajor or lay.split != 1):
                raise CodegenError(f"a stored all-gather needs partition-major pieces, got {lay} for {v.name}")
        if lt is not None and (lt.FT != 1 or lt.P > lx.P):
            raise CodegenError(f"the tail {self.tail.name} ({lt}) is not one chunk of at most {lx.P} partitions")
        P, FT = lx.P, lx.FT
        FTc = FT + (1 if lt is not None else 0)  # the tail rides as one more chunk: one collective, not two
        item = torch.empty((), dtype=self.out.dtype).element_size()
        # LNC=2: each program stores the blocks of half the ranks (a whole rank block is contiguous per partition)
        per = W // 2 if ctx.lnc == 2 and W % 2 == 0 else W
        out = ctx.var(self.out)
        local = f"{out}_l" if lt is not None else ctx.var(self.x)
        g, gt = f"{out}_g", (f"{out}_t" if T > 1 else None)
        e = Emitted(sbuf=(FTc * T if lt is not None else 0) * item + W * FTc * T * item * (2 if gt else 1))
        ranks = "0:" + str(W) if per == W else f"nl.ds(pid * {per}, {per})"
        base = "" if per == W else f"pid * {per * Fl} + "
        stores = []
        for t in range(T):
            # token t of the gathered tile as [P, rank, chunk]: token-major copy when several tokens (contiguous)
            def at(parts: str, chunks: str, t: int = t) -> str:
                return f"{gt}[{parts}, {t}, {ranks}, {chunks}]" if gt else f"{g}[{parts}, {ranks}, {chunks}, {t}]"

            # (p, rank r, ft) -> out[t, r*Fl + p*FT + ft]: FT contiguous features per descriptor
            stores.append({"pattern": [[FT, P], [Fl, per], [1, FT]], "offset": f"{base}{t * W * Fl}",
                           "src": at(":", f"0:{FT}")})
            if lt is not None:  # (p, rank r) -> out[t, r*Fl + P*FT + p]
                stores.append({"pattern": [[1, lt.P], [Fl, per]], "offset": f"{base}{t * W * Fl + P * FT}",
                               "src": at(f"0:{lt.P}", str(FT))})
        e.code("collective_all_gather_store.j2", module=self.module or "", aten=aten(self), name=inst_name(self),
               P=P, FT=FT, FTc=FTc, W=W, T=T, g=g, gt=gt, local=local, x=ctx.var(self.x),
               tail=ctx.var(self.tail) if self.tail is not None else None, Pt=lt.P if lt else 0,
               dtype=nl_dtype(self.out.dtype), src=_flat(local, P, FTc * T), dst=_flat(g, P, W * FTc * T),
               ranks=list(self.ranks), lnc=ctx.lnc, stores=stores, dst_hbm=ctx.var(dst),
               what=f"{dst.name} [{T}, {self.out.features}]", Fl=Fl, per=per, only_core0=ctx.lnc == 2 and per == W)
        ctx.stored.add(self.out.name)
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        x = env[self.x.name]
        if self.tail is not None:
            x = torch.cat([x, env[self.tail.name]], dim=-1)
        env[self.out.name] = reference_collective("all_gather", x, self.ranks)


# ---- lowerings ---------------------------------------------------------------------------------------------
def _ranks(m: Any) -> tuple[int, ...]:
    ranks = m.params.get("ranks")
    if not ranks:
        raise CodegenError(f"{m.pattern.name}: the process group {m.params.get('group_name')!r} is unknown here")
    return tuple(int(r) for r in ranks)


def _check_all_reduce(m: Any, graph: Any, tokens: int | None) -> str | None:
    reduce = m.params.get("reduce_op", "sum")
    if reduce not in REDUCE_OPS:
        return f"all-reduce {reduce!r} has no NKI reduce op (nl.add / nl.maximum / nl.minimum)"
    return group_refusal(m.params.get("ranks"), m.params.get("group_size"))


def _check_all_gather(m: Any, graph: Any, tokens: int | None) -> str | None:
    if m.params.get("gather_dim") != -1:
        return f"an all-gather along dim {m.params.get('gather_dim')} (not the features) is not lowered"
    return group_refusal(m.params.get("ranks"), m.params.get("group_size"))


@register_lowering(all_reduce_pattern, tokens=x_tokens, check=_check_all_reduce,
                   instructions=[AllReduce])
def lower_all_reduce(L: Lowerer, m: Any) -> None:
    why = _check_all_reduce(m, L.G, L.T)
    if why:
        raise CodegenError(why)
    x = L.act(L.input(m, "x"), L.views(m, "x"))
    node = L.output(m)
    out = L.new_act(node, L.label(m, "allreduce"))
    # HF's in-place form: ``copy(linear_out, reduced)`` (folded by canonicalization) *is* the reduced value
    for c in in_place_copies(L.G, node):
        L.alias(c, node)
    L.emit(AllReduce(x=x, out=out, ranks=_ranks(m), reduce=m.params.get("reduce_op", "sum")), m)


def in_place_copies(G: Any, node: str) -> list[str]:
    """``aten.copy(dst, node)`` consumers of ``node`` with its shape and dtype: functionalization's trace of
    ``dist.all_reduce(out)`` writing the reduced value back into ``out`` (the copy's result is the reduced value)."""
    found = []
    d = G.nodes[node]
    for s in G.successors(node):
        sd = G.nodes[s]
        args = sd.get("args", ())
        if (sd.get("op") == "aten.copy.default" and not sd.get("writes_state") and len(args) >= 2
                and getattr(args[1], "node", None) == node and sd.get("shape") == d.get("shape")
                and sd.get("dtype") == d.get("dtype")):
            found.append(s)
    return found


@register_lowering(all_gather_pattern, tokens=x_tokens, check=_check_all_gather,
                   instructions=[AllGather])
def lower_all_gather(L: Lowerer, m: Any) -> None:
    why = _check_all_gather(m, L.G, L.T)
    if why:
        raise CodegenError(why)
    x = L.act(L.input(m, "x"), L.views(m, "x"))
    tail = L.values.get(tail_key(L.input(m, "x")))  # the lm_head's last F mod 128 features (ops/linear.py)
    out = L.new_act(L.output(m), L.label(m, "allgather"))
    local = x.features + (tail.features if tail is not None else 0)
    if out.features != len(_ranks(m)) * local:
        raise CodegenError(f"all-gather of {local} features over {len(_ranks(m))} ranks gives "
                           f"{out.features} features")
    L.emit(AllGather(x=x, out=out, ranks=_ranks(m), store=only_stored(L, m), tail=tail), m)


def tail_key(node: str) -> str:
    """The :attr:`Lowerer.values` key of the ``tail`` piece of a projection split for a stored gather."""
    return f"{node}#gather_tail"


def only_stored(L: Lowerer, m: Any) -> bool:
    """Whether the gather's result is only a kernel output (the logits): no op of the region reads it, so the
    gather may store it itself in any order of its tile."""
    inside, glue = L.matched_nodes, set(getattr(L.region, "glue_nodes", ()))
    todo, seen = [L.output(m)], set()
    while todo:  # through glue views (they are layout only) to the first real reader
        n = todo.pop()
        for s in L.G.successors(n):
            if L.G.edges[n, s].get("hazard") or s in seen:
                continue
            if s in inside:
                return False
            seen.add(s)
            if s in glue:
                todo.append(s)
    return True


def stored_gather_of(L: Lowerer, node: str) -> Any | None:
    """The all-gather match of the region that reads ``node`` (a projection's output) and whose result is only
    stored; None if there is none."""
    for m in L.region.matches:
        if (getattr(m.pattern, "template", None) == "all_gather" and m.inputs.get("x") == node
                and _check_all_gather(m, L.G, L.T) is None and only_stored(L, m)):
            return m
    return None
