"""``nki.collectives`` over simulated ranks.

``run(kernel, *args, ranks=N)`` runs the kernel once per rank (each rank in its own thread, each with its
own copy of the array arguments unless ``rank_args=`` gives per-rank argument tuples).  ``rank_id()``
returns the rank; ``all_reduce`` exchanges the source tensors of every rank of the caller's replica group
and writes the reduction into ``dsts``.  With LNC=2, each program id forms its own collective group across
ranks.  In shape-only runs a replica group may name ranks that are not simulated (the profile of one rank
of a TP group is computed without running the others); data runs need every rank of the group.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import access
from .checks import Instr
from .context import current
from .opsdef import spec_of


from .nkiobject import NKIObject  # noqa: E402 - nccl.NKIObject is the same base as nl.NKIObject


class ReplicaGroup(NKIObject):
    """Groups of ranks that take part in a collective: ``ReplicaGroup([[0, 1, 2, 3]])``."""

    def __init__(self, replica_groups: Any = None):
        groups = replica_groups if replica_groups is not None else [[0]]
        if groups and isinstance(groups[0], (int, np.integer)):
            groups = [groups]
        self.groups = [tuple(int(r) for r in g) for g in groups]
        seen: set[int] = set()
        for g in self.groups:
            if seen & set(g):
                raise ValueError(f"replica groups must not overlap: {replica_groups!r}")
            seen |= set(g)

    def group_of(self, rank: int) -> tuple[int, ...] | None:
        for g in self.groups:
            if rank in g:
                return g
        return None

    def __repr__(self) -> str:
        return f"ReplicaGroup({[list(g) for g in self.groups]!r})"


def rank_id():
    """The rank of the running program (0 unless the launch simulates several ranks)."""
    return current("nccl.rank_id").rank


_REDUCE_OPS = ("add", "minimum", "maximum")


def all_reduce(srcs, dsts, replica_group, op):
    """Reduce ``srcs`` element-wise across the ranks of the replica group into ``dsts`` (HBM or SBUF)."""
    I = Instr("nccl.all_reduce")
    ctx = I.ctx
    spec = spec_of(op)
    if spec is None or spec.name not in _REDUCE_OPS:
        raise I.fail(f"op must be one of nl.add, nl.minimum, nl.maximum, got {op!r}", "op")
    if not isinstance(replica_group, ReplicaGroup):
        raise I.fail(f"replica_group must be a nccl.ReplicaGroup, got {type(replica_group).__name__}", "shape")
    if not isinstance(srcs, (list, tuple)) or not isinstance(dsts, (list, tuple)) or len(srcs) != len(dsts) or not srcs:
        raise I.fail("srcs and dsts must be non-empty lists of the same length", "shape")
    ts = [I.tensor(x, f"srcs[{i}]") for i, x in enumerate(srcs)]
    td = [I.tensor(x, f"dsts[{i}]") for i, x in enumerate(dsts)]
    kinds = {t.buffer.is_hbm for t in ts + td}
    if len(kinds) != 1:
        raise I.fail("tensors must be all in HBM or all in SBUF (mixing memory spaces is not supported)", "buffer")
    on_sbuf = not kinds.pop()
    if on_sbuf:
        if len(ts) != 1:
            raise I.fail("SBUF collectives support a single tensor (no coalescing)", "shape")
        for t in ts + td:
            if t.buffer.name != "sbuf" or len(t.shape) != 2:
                raise I.fail("SBUF collectives operate on 2-D SBUF tensors", "buffer")
    for i, (s, d) in enumerate(zip(ts, td)):
        if s.size != d.size or s.dtype is not d.dtype:
            raise I.fail(f"srcs[{i}] {s.shape} {s.dtype.name} and dsts[{i}] {d.shape} {d.dtype.name} must match",
                         "shape")
    group = replica_group.group_of(ctx.rank)
    if group is None:
        raise I.fail(f"rank {ctx.rank} is not in {replica_group!r}", "shape")
    missing = [r for r in group if r >= ctx.run.ranks]
    seq = ctx.collective_seq
    ctx.collective_seq += 1
    if missing:
        if not ctx.shape_only:
            raise I.fail(
                f"{replica_group!r} includes ranks {missing} but the launch simulates {ctx.run.ranks} rank(s); run with "
                f"ranks={max(group) + 1} (data runs need every rank of the group)",
                "ranks",
            )
    else:
        payload = None if ctx.shape_only else [np.asarray(access.read_f32(ctx, t), dtype=np.float32).copy() for t in ts]
        key = ("all_reduce", ctx.program_id, group, seq)
        got = ctx.run.sync.exchange(key, group, ctx.rank, payload, I.name, I.where())
        if not ctx.shape_only:
            fn = {"add": np.add, "minimum": np.minimum, "maximum": np.maximum}[spec.name]
            for i, d in enumerate(td):
                acc = None
                for r in group:
                    v = got[r][i]
                    acc = v.copy() if acc is None else fn(acc, v)
                access.write(ctx, d, acc.reshape(d.shape))
    nbytes = sum(t.size * t.dtype.itemsize for t in ts)
    rec = ctx.rec
    for t in ts:
        if t.buffer.is_hbm:
            rec.hbm_traffic(t._st.label, t._st.kind, read=t.size * t.dtype.itemsize)
    for t in td:
        if t.buffer.is_hbm:
            rec.hbm_traffic(t._st.label, t._st.kind, write=t.size * t.dtype.itemsize)
    lab = [t._st.label if t.buffer.is_hbm else t._st.name for t in (ts[0], td[0])]
    rec.dma(ctx.site(), "all_reduce", (ts[0].buffer.name, lab[0]), (td[0].buffer.name, lab[1]),
            "cc", "none", nbytes, ts[0].shape[0], len(ts))
    I.record("all_reduce", "dma", ts[0].shape[0], max(ts[0].size // max(ts[0].shape[0], 1), 1), ts[0].dtype.name,
             None)

