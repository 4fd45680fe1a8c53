"""``nki.collectives`` (NKI 0.3.0): ``rank_id``, ``ReplicaGroup``, ``all_reduce``, ``all_gather``, ``reduce_scatter``,
``all_to_all``.

Ranks are either threads of this process (``run(kernel, ..., ranks=N)``: each rank gets its own copy of the array
arguments unless ``rank_args=`` gives per-rank argument tuples) or the processes of a ``torch.distributed`` job
(``run(kernel, ..., process_group=pg)``, or automatically under ``torchrun``); see :mod:`.transport`. With LNC=2
each program id forms its own collective group across ranks (program 0 of every rank of the replica group
together, program 1 together). Shape-only runs need no peers: a replica group may name ranks that are not there
(the profile of one rank of a TP group is computed alone) and nothing is exchanged over ``torch.distributed``.

Rules, from the stub docstrings of SDK 2.29 (``aws-neuron/aws-neuron-sdk@03323f7a``,
``nki/api/nki/collectives/__init__.py``) where they say so, else ours (rejected where the docs are silent):

* ``srcs``/``dsts`` are lists of tensors (coalesced collectives); "all tensors must be on HBM or all must be on
  SBUF" (rule ``buffer``; PSUM is neither); "Coalesced collective communication (multiple tensors) is only
  supported when tensors are on HBM" (rule ``shape``); "SBUF collectives currently only operate on 2D tensors with
  a single free dimension" (rule ``shape``); ``all_to_all``: "Tensors must reside on HBM" (rule ``buffer``);
* ``op``: ``nl.add``, ``nl.minimum`` or ``nl.maximum`` (rule ``op``);
* ``collective_dim``: ``all_gather`` "only 0 is supported for HBM tensors. For SBUF tensors, 0 or 1"; ``reduce_scatter``
  and ``all_to_all`` "only 0" (rule ``collective-dim``);
* ``ReplicaGroup``: "Sub-groups ... should not have any overlap" (rule ``replica-group``); ours: the caller's rank is
  in one sub-group, each sub-group lists its ranks in increasing order (the concatenation order of a group listed
  otherwise is undocumented; nki-library's examples gather ``[data_0 | data_1 | ...]`` in rank order);
* ours: ``srcs[i]``/``dsts[i]`` have one dtype (rule ``dtype``; no conversion is documented); all-reduce: equal element
  counts; all-gather: ``dst`` is ``src`` with ``collective_dim`` n times longer; reduce-scatter: ``src`` is ``dst``
  with dim 0 n times longer; all-to-all: equal shapes, dim 0 divisible by n (rule ``shape``); no runtime-offset views
  (rule ``dynamic-offset``); a data run needs every rank of the group (rule ``ranks``).

Numerics: reductions are computed in float32 (integer dtypes: int64) and rounded to the dst dtype once;
all-gather and all-to-all move bits. Every rank of a group gets the same result.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from . import access
from .checks import SBUF, Instr
from .context import current, maybe_current
from .enums import MemoryRegion
from .errors import NkiValidationError
from .nkiobject import NKIObject  # noqa: E402 - nccl.NKIObject is the same base as nl.NKIObject
from .opsdef import spec_of
from .transport import REDUCING, Call

log = logging.getLogger(__name__)

_REDUCE_OPS = ("add", "minimum", "maximum")


class ReplicaGroup(NKIObject):
    """Groups of ranks that take part in a collective: ``ReplicaGroup([[0, 1, 2, 3]])``.

    "Sub-groups represented by lists of ranks should not have any overlap" (the 2.29 stub). A flat list of ranks is
    taken as one group."""

    def __init__(self, replica_groups: Any = None):
        ctx = maybe_current()
        where = ctx.where() if ctx is not None else None
        groups = replica_groups if replica_groups is not None else [[0]]
        if isinstance(groups, (list, tuple)) and groups and isinstance(groups[0], (int, np.integer)):
            groups = [groups]
        try:
            self.groups = tuple(tuple(int(r) for r in g) for g in groups)
        except (TypeError, ValueError):
            raise NkiValidationError(f"ReplicaGroup takes lists of integer ranks, got {replica_groups!r}",
                                     rule="replica-group", location=where) from None
        seen: set[int] = set()
        for g in self.groups:
            if not g:
                raise NkiValidationError(f"replica groups must not be empty: {replica_groups!r}", rule="replica-group",
                                         location=where)
            if seen & set(g) or len(set(g)) != len(g):
                raise NkiValidationError(f"replica groups must not overlap: {replica_groups!r}", rule="replica-group",
                                         location=where)
            seen |= set(g)

    def group_of(self, rank: int) -> tuple[int, ...] | None:
        for g in self.groups:
            if rank in g:
                return g
        return None

    def __repr__(self) -> str:
        return f"ReplicaGroup({[list(g) for g in self.groups]!r})"


def rank_id():
    """The rank of the running program: the simulated rank, or the process's rank in its ``torch.distributed`` group
    (0 for a launch of one rank)."""
    return current("nccl.rank_id").rank


# ---- shared validation ---------------------------------------------------------------------------------------
def _tensors(I: Instr, srcs: Any, dsts: Any) -> tuple[list, list]:
    if not isinstance(srcs, (list, tuple)) or not isinstance(dsts, (list, tuple)):
        raise I.fail("srcs and dsts must be lists of tensors", "shape")
    if not srcs or len(srcs) != len(dsts):
        raise I.fail(f"srcs and dsts must be non-empty lists of the same length, got {len(srcs)} and {len(dsts)}",
                     "shape")
    ts = [I.tensor(x, f"srcs[{i}]") for i, x in enumerate(srcs)]
    td = [I.tensor(x, f"dsts[{i}]") for i, x in enumerate(dsts)]
    for i, t in enumerate(ts + td):
        if t._ind is not None:
            arg = f"srcs[{i}]" if i < len(ts) else f"dsts[{i - len(ts)}]"
            raise I.fail(f"{arg} has a runtime offset (scalar_offset/vector_offset); collectives take direct views",
                         "dynamic-offset")
    return ts, td


def _memory(I: Instr, ts: list, td: list, hbm_only: bool = False) -> bool:
    """Validate the memory rules; returns whether the tensors are on SBUF."""
    for i, t in enumerate(ts + td):
        if t.buffer is MemoryRegion.psum:
            arg = f"srcs[{i}]" if i < len(ts) else f"dsts[{i - len(ts)}]"
            raise I.fail(f"{arg} is in PSUM; collective tensors reside on HBM or SBUF", "buffer")
    kinds = {t.buffer.is_hbm for t in ts + td}
    if len(kinds) != 1:
        raise I.fail("tensors must be all on HBM or all on SBUF (mixing memory spaces is not supported)", "buffer")
    on_sbuf = not kinds.pop()
    if on_sbuf and hbm_only:
        raise I.fail("tensors must reside on HBM (SBUF is not supported for this collective)", "buffer")
    if on_sbuf:
        if len(ts) != 1:
            raise I.fail(f"coalesced collectives ({len(ts)} tensors) are only supported on HBM; SBUF collectives take "
                         f"a single tensor", "shape")
        for i, t in enumerate(ts + td):
            arg = "srcs[0]" if i == 0 else "dsts[0]"
            if len(t.shape) != 2:
                raise I.fail(f"{arg} has shape {t.shape}; SBUF collectives operate on 2-D tensors with a single free "
                             f"dimension", "shape")
            I.onchip(t, arg, allowed=(SBUF,), compute=False)
    return on_sbuf


def _dtypes(I: Instr, ts: list, td: list, reducing: bool) -> None:
    for i, (s, d) in enumerate(zip(ts, td)):
        if s.dtype is not d.dtype:
            raise I.fail(f"srcs[{i}] is {s.dtype.name} but dsts[{i}] is {d.dtype.name}; source and destination must "
                         f"have the same dtype", "dtype")
        if reducing and s.dtype.is_packed:
            raise I.fail(f"srcs[{i}]: cannot reduce packed dtype {s.dtype.name}", "dtype")


def _reduce_op(I: Instr, op: Any) -> str:
    spec = spec_of(op)
    if spec is None or spec.name not in _REDUCE_OPS:
        raise I.fail(f"op must be one of nl.add, nl.minimum, nl.maximum, got {op!r}", "op")
    return spec.name


def _dim(I: Instr, collective_dim: Any, allowed: tuple[int, ...], where: str) -> int:
    if isinstance(collective_dim, bool) or not isinstance(collective_dim, (int, np.integer)):
        raise I.fail(f"collective_dim must be an int, got {collective_dim!r}", "collective-dim")
    d = int(collective_dim)
    if d not in allowed:
        raise I.fail(f"collective_dim={d} is not supported {where} (supported: {', '.join(map(str, allowed))})",
                     "collective-dim")
    return d


def _group(I: Instr, replica_group: Any) -> tuple[tuple[int, ...], int, bool]:
    """(the caller's sub-group, its position in it, whether every rank of the group takes part here)."""
    ctx = I.ctx
    if not isinstance(replica_group, ReplicaGroup):
        raise I.fail(f"replica_group must be a nccl.ReplicaGroup, got {type(replica_group).__name__}",
                     "replica-group")
    group = replica_group.group_of(ctx.rank)
    if group is None:
        raise I.fail(f"rank {ctx.rank} is not in {replica_group!r}", "replica-group")
    if list(group) != sorted(group):
        raise I.fail(f"the ranks of sub-group {list(group)} must be listed in increasing order (the order of a group "
                     f"listed otherwise is undocumented)", "replica-group")
    missing = [r for r in group if r >= ctx.run.ranks or r < 0]
    if missing and not ctx.shape_only:
        raise I.fail(
            f"{replica_group!r} includes ranks {missing} but the launch has {ctx.run.ranks} rank(s); simulate "
            f"ranks={max(group) + 1} or launch one process per rank (data runs need every rank of the group)",
            "ranks",
        )
    return group, group.index(ctx.rank), not missing


# ---- payloads and results -------------------------------------------------------------------------------------
def _payload(I: Instr, ts: list, reducing: bool) -> list[np.ndarray]:
    out = []
    for t in ts:
        v = access.read(I.ctx, t)
        if reducing:
            out.append(np.asarray(v, dtype=np.int64) if t.dtype.is_int else
                       np.asarray(access.read_f32(I.ctx, t), dtype=np.float32).copy())
        else:
            out.append(np.array(v, copy=True))
    return out


def _run(I: Instr, op: str, ts: list, td: list, replica_group: ReplicaGroup, group: tuple[int, ...], position: int,
         complete: bool, reduce: str | None, dim: int) -> None:
    ctx = I.ctx
    seq = ctx.collective_seq
    ctx.collective_seq += 1
    transport = ctx.run.transport
    if not complete or transport is None:
        return
    call = Call(op, group, position, ctx.program_id, seq, [], reduce, dim, I.name, I.where(), replica_group.groups)
    if len(group) == 1 and not ctx.shape_only:  # a group of one: a local copy
        call.payload = _payload(I, ts, op in REDUCING)
        results = call.payload
    elif ctx.shape_only:
        transport.rendezvous(call)
        return
    else:
        call.payload = _payload(I, ts, op in REDUCING)
        results = transport.collective(call, ctx.run)
    for d, v in zip(td, results):
        access.write(ctx, d, np.asarray(v).reshape(d.shape))


def _record(I: Instr, op: str, ts: list, td: list, group: tuple[int, ...], replica_group: ReplicaGroup,
            on_sbuf: bool, reduce: str | None, dim: int) -> None:
    ctx = I.ctx
    rec = ctx.rec
    nbytes = sum(t.size * t.dtype.itemsize for t in ts)
    out_bytes = sum(t.size * t.dtype.itemsize for t in td)
    for t in ts:
        if t.buffer.is_hbm:
            rec.hbm_traffic(t._st.label, t._st.kind, read=t.size * t.dtype.itemsize)
    for t in td:
        if t.buffer.is_hbm:
            rec.hbm_traffic(t._st.label, t._st.kind, write=t.size * t.dtype.itemsize)
    lab = [t._st.label if t.buffer.is_hbm else t._st.name for t in (ts[0], td[0])]
    parts = ts[0].shape[0] if ts[0].shape else 1
    rec.dma(ctx.site(), op, (ts[0].buffer.name, lab[0]), (td[0].buffer.name, lab[1]), "cc", "none",
            (nbytes + out_bytes) // 2, parts, len(ts), read_bytes=nbytes, write_bytes=out_bytes)
    buffer = "sbuf" if on_sbuf else "hbm"
    info = {"op": op, "reduce": reduce, "group_size": len(group), "group": list(group),
            "replica_groups": len(replica_group.groups), "buffer": buffer, "dtype": ts[0].dtype.name,
            "tensors": len(ts), "bytes": nbytes, "out_bytes": out_bytes, "collective_dim": dim, "lnc": ctx.run.lnc}
    tr = rec.tracer
    if tr is not None and tr.pending_dma is not None:
        tr.pending_dma["collective"] = info
    site = ctx.site()
    key = (site[0], site[1], op, reduce, buffer, ts[0].dtype.name, tuple(group), len(ts), dim)
    entry = ctx.collective_log.get(key)
    if entry is None:
        entry = ctx.collective_log[key] = {
            "rank": ctx.rank, "program": ctx.program_id, "file": site[0], "line": site[1], "op": op,
            "reduce": reduce, "buffer": buffer, "dtype": ts[0].dtype.name, "group": list(group),
            "group_size": len(group), "tensors": len(ts), "collective_dim": dim, "count": 0, "bytes": 0,
            "out_bytes": 0}
    entry["count"] += 1
    entry["bytes"] += nbytes
    entry["out_bytes"] += out_bytes
    free = max(ts[0].size // max(parts, 1), 1)
    I.record(op, "dma", parts, free, ts[0].dtype.name, None)


def profile_rows(contexts: list[list[Any]]) -> list[dict[str, Any]]:
    """Per rank and program: every collective call site with its count and bytes (``Profile.collectives``)."""
    rows = []
    for row in contexts:
        for ctx in row:
            rows.extend(dict(v) for v in ctx.collective_log.values())
    rows.sort(key=lambda r: (r["rank"], r["program"], r["file"], r["line"], r["op"]))
    return rows


# ---- the collectives ------------------------------------------------------------------------------------------
def all_reduce(srcs, dsts, replica_group, op):
    """Reduce ``srcs[i]`` element-wise across the ranks of the caller's replica group into ``dsts[i]`` (HBM or SBUF)."""
    I = Instr("nccl.all_reduce")
    red = _reduce_op(I, op)
    group, pos, complete = _group(I, replica_group)
    ts, td = _tensors(I, srcs, dsts)
    on_sbuf = _memory(I, ts, td)
    _dtypes(I, ts, td, True)
    for i, (s, d) in enumerate(zip(ts, td)):
        if s.size != d.size or (on_sbuf and s.shape[0] != d.shape[0]):
            raise I.fail(f"srcs[{i}] {s.shape} and dsts[{i}] {d.shape} must have the same number of elements"
                         + (" and partitions" if on_sbuf else ""), "shape")
    _run(I, "all_reduce", ts, td, replica_group, group, pos, complete, red, 0)
    _record(I, "all_reduce", ts, td, group, replica_group, on_sbuf, red, 0)


def all_gather(srcs, dsts, replica_group, collective_dim):
    """Concatenate ``srcs[i]`` of every rank of the group (in rank order) along ``collective_dim`` into ``dsts[i]``."""
    I = Instr("nccl.all_gather")
    group, pos, complete = _group(I, replica_group)
    ts, td = _tensors(I, srcs, dsts)
    on_sbuf = _memory(I, ts, td)
    dim = _dim(I, collective_dim, (0, 1) if on_sbuf else (0,), "for SBUF tensors" if on_sbuf else "for HBM tensors")
    _dtypes(I, ts, td, False)
    n = len(group)
    for i, (s, d) in enumerate(zip(ts, td)):
        want = tuple(n * v if k == dim else v for k, v in enumerate(s.shape))
        if tuple(d.shape) != want:
            raise I.fail(f"dsts[{i}] has shape {d.shape}; gathering srcs[{i}] {s.shape} from {n} ranks along dim {dim} "
                         f"gives {want}", "shape")
    _run(I, "all_gather", ts, td, replica_group, group, pos, complete, None, dim)
    _record(I, "all_gather", ts, td, group, replica_group, on_sbuf, None, dim)


def reduce_scatter(srcs, dsts, replica_group, collective_dim, op):
    """Reduce ``srcs[i]`` across the group and give the rank at position k of the group the k-th of n equal chunks
    along dim 0 (in ``dsts[i]``)."""
    I = Instr("nccl.reduce_scatter")
    red = _reduce_op(I, op)
    group, pos, complete = _group(I, replica_group)
    ts, td = _tensors(I, srcs, dsts)
    on_sbuf = _memory(I, ts, td)
    dim = _dim(I, collective_dim, (0,), "(only 0 is supported for HBM and SBUF tensors)")
    _dtypes(I, ts, td, True)
    n = len(group)
    for i, (s, d) in enumerate(zip(ts, td)):
        want = (n * d.shape[0],) + tuple(d.shape[1:]) if d.shape else ()
        if tuple(s.shape) != want:
            raise I.fail(f"srcs[{i}] has shape {s.shape}; scattering it over {n} ranks along dim 0 into dsts[{i}] "
                         f"{d.shape} needs {want}", "shape")
    _run(I, "reduce_scatter", ts, td, replica_group, group, pos, complete, red, dim)
    _record(I, "reduce_scatter", ts, td, group, replica_group, on_sbuf, red, dim)


def all_to_all(srcs, dsts, replica_group, collective_dim):
    """Split ``srcs[i]`` into n chunks along dim 0; chunk j goes to the rank at position j of the group, and
    ``dsts[i]`` is the chunks received from every rank, in rank order (HBM only)."""
    I = Instr("nccl.all_to_all")
    group, pos, complete = _group(I, replica_group)
    ts, td = _tensors(I, srcs, dsts)
    on_sbuf = _memory(I, ts, td, hbm_only=True)
    dim = _dim(I, collective_dim, (0,), "(only 0 is supported)")
    _dtypes(I, ts, td, False)
    n = len(group)
    for i, (s, d) in enumerate(zip(ts, td)):
        if tuple(s.shape) != tuple(d.shape) or not s.shape or s.shape[0] % n:
            raise I.fail(f"srcs[{i}] {s.shape} and dsts[{i}] {d.shape} must have the same shape with dim 0 divisible "
                         f"by the group size {n}", "shape")
    _run(I, "all_to_all", ts, td, replica_group, group, pos, complete, None, dim)
    _record(I, "all_to_all", ts, td, group, replica_group, on_sbuf, None, dim)
