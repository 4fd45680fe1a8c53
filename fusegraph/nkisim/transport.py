"""Where the data of ``nki.collectives`` goes: between threads of this process, or over ``torch.distributed``.

A launch has one transport:

* :class:`ThreadTransport` -- ``run(kernel, ..., ranks=N)`` simulates N ranks as threads of this process; every
  collective deposits each rank's payload in the launch's :class:`~fusegraph.nkisim.sync.SyncHub` and each rank
  combines the payloads itself (:func:`combine`).
* :class:`TorchTransport` -- the kernel runs once per process of a ``torch.distributed`` job (the ``torchrun``
  launch a user runs on Trainium, here N CPU processes with gloo): ``run(kernel, ..., process_group=pg)``, or
  automatically when ``torch.distributed`` is initialized with more than one process and the kernel is launched
  with ``ranks=1`` (``FUSEGRAPH_NKISIM_DIST=off`` disables the automatic mode). ``nccl.rank_id()`` is the process's
  rank in the group; the kernel's replica groups name ranks of that group and map to sub-groups of the job, one
  per (replica group, program id), created once (``new_group(use_local_synchronization=True)``, gloo: the
  interpreter's tensors are CPU tensors) and cached. Collectives call ``dist.all_reduce`` /
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` / ``all_to_all_single`` on CPU tensors.

Both transports compute reductions in float32 (integers: int64) and the caller rounds the result to the
destination dtype once; every rank gets the same bits (gloo reduces each element once and broadcasts it). For
two ranks the thread and process results are identical; for more, gloo's summation order may differ from the
threads' rank order in the last float32 bit before that rounding.

Every wait (threads, sub-group creation, a torch collective) is bounded by ``FUSEGRAPH_NKISIM_SYNC_TIMEOUT``
(seconds, default 60) and raises :class:`~fusegraph.nkisim.errors.NkiSyncError`. Ranks that issue different
collectives are caught too: the threads compare the tensors, and every torch transfer carries a two-number
signature of the collective (launch, program, call number, op, shapes), so a rank that skipped one is "out of
step" instead of mixing data. A rank whose launch fails publishes the failure in the job's store (key
``fusegraph.nkisim/<group>/abort/<launch>``) and its peers waiting in a collective of the same launch stop with
``NkiSyncError`` naming it. An abandoned torch collective cannot be cancelled, so its sub-group is retired (later
collectives on it raise at once), and so is every sub-group of a process whose launch failed. Making every rank
fall back together after such an error is the executor's job, not the interpreter's.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import NkiSyncError, NkiUsageError
from .sync import default_timeout

log = logging.getLogger(__name__)

ENV_DIST = "FUSEGRAPH_NKISIM_DIST"

#: collectives whose payload is reduced (float32 / int64) rather than moved bit for bit
REDUCING = frozenset({"all_reduce", "reduce_scatter"})


@dataclass
class Call:
    """One collective of one program, as a transport sees it."""

    op: str  # all_reduce | all_gather | reduce_scatter | all_to_all
    group: tuple[int, ...]  # ranks of the caller's sub-group, in order
    position: int  # the caller's index in ``group``
    program: int
    seq: int  # the caller's collective count (per program)
    payload: list[np.ndarray]  # one array per tensor: float32/int64 (reductions) or the storage dtype (moves)
    reduce: str | None = None  # add | minimum | maximum
    dim: int = 0  # collective_dim
    what: str = ""
    where: str | None = None
    replica_groups: tuple[tuple[int, ...], ...] = field(default_factory=tuple)


# ---- semantics (shared by both transports) --------------------------------------------------------------------
_FOLD = {"add": np.add, "minimum": np.minimum, "maximum": np.maximum}


def fold(arrays: list[np.ndarray], reduce: str) -> np.ndarray:
    """Reduce ``arrays`` in order (float32 or int64, as given)."""
    fn = _FOLD[reduce]
    acc = np.array(arrays[0], copy=True)
    for a in arrays[1:]:
        acc = fn(acc, a)
    return acc


def combine(op: str, per_rank: list[list[np.ndarray]], position: int, reduce: str | None, dim: int) -> list[np.ndarray]:
    """The outputs of the rank at ``position`` given every rank's payload (in group order)."""
    n = len(per_rank)
    out = []
    for i in range(len(per_rank[0])):
        parts = [p[i] for p in per_rank]
        if op == "all_reduce":
            out.append(fold(parts, reduce or "add"))
        elif op == "reduce_scatter":
            out.append(np.split(fold(parts, reduce or "add"), n, axis=0)[position])
        elif op == "all_gather":
            out.append(np.concatenate(parts, axis=dim))
        elif op == "all_to_all":
            out.append(np.concatenate([np.split(p, n, axis=0)[position] for p in parts], axis=0))
        else:  # pragma: no cover - guarded by the callers
            raise ValueError(op)
    return out


# ---- transports -----------------------------------------------------------------------------------------------
class ThreadTransport:
    """Ranks are threads of this launch (``run(..., ranks=N)``)."""

    kind = "threads"

    def __init__(self, hub: Any):
        self.hub = hub

    def collective(self, call: Call, run: Any) -> list[np.ndarray]:
        key = (call.op, call.program, call.group, call.seq)
        got = self.hub.exchange(key, call.group, call.group[call.position], call.payload, call.what, call.where)
        mine = [(a.dtype, a.shape) for a in call.payload]
        bad = [r for r in call.group if [(a.dtype, a.shape) for a in got[r]] != mine or len(got[r]) != len(mine)]
        if bad:
            raise NkiSyncError(f"{call.what}: rank(s) {bad} issued this collective with other tensors "
                               f"({[str(a.dtype) + str(a.shape) for a in got[bad[0]]]} vs "
                               f"{[str(d) + str(sh) for d, sh in mine]})", rule="sync", location=call.where)
        return combine(call.op, [got[r] for r in call.group], call.position, call.reduce, call.dim)

    def rendezvous(self, call: Call) -> None:
        """Shape-only: meet the simulated peers (so divergent collectives still fail) without data."""
        key = (call.op, call.program, call.group, call.seq)
        self.hub.exchange(key, call.group, call.group[call.position], None, call.what, call.where)

    def failed(self, why: str) -> None:  # the launch's SyncHub already aborts the other threads
        pass


def _dist():
    import torch.distributed as dist

    return dist


class _Group:
    """A cached sub-group of the job for one (replica group, program id)."""

    __slots__ = ("pg", "ranks", "retired")

    def __init__(self, pg: Any, ranks: tuple[int, ...]):
        self.pg = pg
        self.ranks = ranks
        self.retired: str | None = None


class TorchGroup:
    """State kept per ``torch.distributed`` process group the kernels run on (sub-groups, launch counter)."""

    def __init__(self, pg: Any):
        dist = _dist()
        self.pg = pg
        self.rank = dist.get_rank(group=pg)
        self.size = dist.get_world_size(group=pg)
        self.global_ranks = [dist.get_global_rank(pg, r) if pg is not dist.group.WORLD else r
                             for r in range(self.size)]
        try:
            self.name = str(dist.distributed_c10d._get_process_group_name(pg))
        except Exception:  # noqa: BLE001 - private helper; only used in store keys
            self.name = "g" + "_".join(map(str, self.global_ranks))
        self.lock = threading.Lock()
        self.create_lock = threading.Lock()
        self.subgroups: dict[tuple, _Group] = {}
        self.broken: str | None = None  # a sub-group creation was abandoned: creating more would be out of step
        self.launches = 0

    def lookup(self, group: tuple[int, ...], program: int) -> _Group | None:
        with self.lock:
            return self.subgroups.get((group, program))

    def create(self, replica_groups: tuple[tuple[int, ...], ...], lnc: int, timeout: float) -> None:
        """Create the job's sub-groups of ``replica_groups`` (kernel ranks = ranks of :attr:`pg`) that this process
        belongs to, for every program id, in one canonical order (sorted groups, then program ids), so that all
        members create them alike (``new_group(use_local_synchronization=True)`` names a group by its ranks and the
        number of groups the process has; ranks outside a group take no part in creating it)."""
        dist = _dist()
        td = datetime.timedelta(seconds=timeout)
        with self.create_lock:
            for grp in sorted(replica_groups):
                if self.rank not in grp:
                    continue
                for p in range(lnc):
                    if self.lookup(grp, p) is not None:
                        continue
                    granks = [self.global_ranks[r] for r in grp]
                    log.debug("creating the gloo sub-group %s (program %d) of %s", granks, p, self.name)
                    pg = dist.new_group(granks, timeout=td, backend="gloo", use_local_synchronization=True)
                    with self.lock:
                        self.subgroups[(grp, p)] = _Group(pg, grp)


_GROUPS: dict[int, tuple[Any, TorchGroup]] = {}
_GROUPS_LOCK = threading.Lock()


def torch_group(pg: Any) -> TorchGroup:
    """The (cached) :class:`TorchGroup` of ``pg``; a cache entry of a process group that no longer exists (after
    ``destroy_process_group``) is replaced."""
    with _GROUPS_LOCK:
        hit = _GROUPS.get(id(pg))
        if hit is not None and hit[0] is pg and _alive(pg):
            return hit[1]
        tg = TorchGroup(pg)
        _GROUPS[id(pg)] = (pg, tg)  # keeps pg referenced, so its id cannot be reused while cached
        return tg


def _alive(pg: Any) -> bool:
    dist = _dist()
    try:
        return dist.is_initialized() and pg in dist.distributed_c10d._world.pg_map
    except Exception:  # noqa: BLE001 - private table; assume alive
        return dist.is_initialized()


def _store() -> Any:
    try:
        return _dist().distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - private helper: without it peers only stop at the timeout
        return None


def _torch_op(dist: Any, reduce: str) -> Any:
    return {"add": dist.ReduceOp.SUM, "minimum": dist.ReduceOp.MIN, "maximum": dist.ReduceOp.MAX}[reduce]


def _as_bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


class TorchTransport:
    """One launch of the kernel on this process's rank of a ``torch.distributed`` process group."""

    kind = "torch.distributed"

    def __init__(self, pg: Any, lnc: int, data: bool):
        self.group = torch_group(pg)
        self.lnc = lnc
        self.timeout = default_timeout()
        self.run_state: Any = None  # set by the runner (its SyncHub tells when another program failed)
        self.store = _store()
        self.launch = None
        if data:  # shape-only launches need no peers (and may be run by one rank alone): not counted
            with self.group.lock:
                self.group.launches += 1
                self.launch = self.group.launches

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    def _abort_key(self) -> str:
        return f"fusegraph.nkisim/{self.group.name}/abort/{self.launch}"

    def failed(self, why: str) -> None:
        """This rank's launch failed: its peers may be waiting in a collective it will never issue, or have
        abandoned one it issued, so every sub-group of this process group is retired (later collectives on them
        raise at once; re-create the process group to use them again), and the failure is published for the
        peers waiting in this launch (the first failure of a launch is kept). Shape-only launches exchange nothing
        and change nothing."""
        if self.launch is None:
            return
        with self.group.lock:
            for g in self.group.subgroups.values():
                g.retired = g.retired or f"retired after a failed launch of rank {self.rank} ({why[:200]})"
            self.group.broken = self.group.broken or f"a launch of rank {self.rank} failed ({why[:200]})"
        if self.store is None:
            return
        key = self._abort_key()
        try:
            if not self.store.check([key]):
                self.store.set(key, f"rank {self.rank}: {why}"[:2000])
        except Exception as exc:  # noqa: BLE001 - best effort; the peers still stop at their timeout
            log.debug("could not publish the failure of rank %d: %s", self.rank, exc)

    def _remote_abort(self) -> str | None:
        if self.store is None or self.launch is None:
            return None
        key = self._abort_key()
        try:
            if self.store.check([key]):
                v = self.store.get(key)
                return v.decode(errors="replace") if isinstance(v, bytes) else str(v)
        except Exception:  # noqa: BLE001 - store unreachable (the job is going down): keep waiting for the timeout
            return None
        return None

    def _await(self, fn: Any, call: Call, ranks: tuple[int, ...], abandon: Any, waiting_for: str) -> None:
        """Run ``fn`` (a blocking torch.distributed step) in a helper thread and wait for it while watching this
        launch's other programs, the peers' published failures and the deadline; ``abandon(why)`` is called when the
        wait is given up (the step then ends in the background with gloo's own timeout, the same one). A helper
        thread is needed anyway: gloo's emulated reduce-scatter returns a Work whose ``is_completed()`` never turns
        true."""
        done = threading.Event()
        box: list[BaseException] = []

        def waiter() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the kernel's thread
                box.append(exc)
            finally:
                done.set()

        threading.Thread(target=waiter, name="nkisim-cc-wait", daemon=True).start()
        deadline = time.monotonic() + self.timeout
        delay = 1e-4
        next_check = 0.0
        while not done.is_set():
            now = time.monotonic()
            hub = self.run_state.sync if self.run_state is not None else None
            if hub is not None and hub.aborted is not None:
                abandon("abandoned after another program of this rank failed")
                raise NkiSyncError(f"{call.what}: aborted because another program failed ({hub.aborted})",
                                   rule="sync", location=call.where)
            if now >= next_check:
                why = self._remote_abort()
                if why is not None:
                    abandon(f"abandoned after {why}")
                    raise NkiSyncError(f"{call.what}: aborted because another rank failed ({why})", rule="sync",
                                       location=call.where)
                next_check = now + 0.05
            if now >= deadline:
                abandon(f"timed out after {self.timeout:.0f}s")
                raise NkiSyncError(
                    f"{call.what}: no matching {waiting_for} from the ranks {list(ranks)} (program {call.program}) "
                    f"after {self.timeout:.0f}s (a rank diverged, failed or never issued it)",
                    rule="sync", location=call.where)
            done.wait(delay)
            delay = min(delay * 2, 0.005)
        if box:  # gloo reports a dead peer or its own timeout this way
            exc = box[0]
            abandon(f"failed: {type(exc).__name__}")
            raise NkiSyncError(f"{call.what}: torch.distributed {waiting_for} failed ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''})", rule="sync",
                               location=call.where) from exc

    def _wait(self, work: Any, sub: _Group, call: Call) -> None:
        def abandon(why: str) -> None:
            sub.retired = why

        self._await(work.wait, call, sub.ranks, abandon, "collective")

    def _subgroup(self, call: Call) -> _Group:
        g = self.group.lookup(call.group, call.program)
        if g is not None:
            return g
        if self.group.broken:
            raise NkiSyncError(f"{call.what}: no new sub-groups of {self.group.name} after {self.group.broken}",
                               rule="sync", location=call.where)

        def abandon(why: str) -> None:
            self.group.broken = self.group.broken or f"a sub-group creation was {why}"

        self._await(lambda: self.group.create(call.replica_groups, self.lnc, self.timeout), call, call.group,
                    abandon, "collective (creating its sub-group)")
        g = self.group.lookup(call.group, call.program)
        assert g is not None
        return g

    def _signature(self, call: Call) -> tuple[int, int]:
        """Two numbers in [1, 255] naming this collective (launch, program, call number, op, shapes, dtypes): every
        transfer carries them, so ranks that are out of step (one skipped a collective, or is in another launch)
        are detected instead of mixing up data."""
        text = (f"{self.launch}/{call.program}/{call.seq}/{call.op}/{call.reduce}/{call.dim}/"
                + ";".join(f"{a.dtype}{a.shape}" for a in call.payload))
        h = hashlib.sha1(text.encode()).digest()
        return 1 + h[0] % 255, 1 + h[1] % 255

    def _mismatch(self, sub: _Group, call: Call, detail: str) -> NkiSyncError:
        sub.retired = "out of step"
        return NkiSyncError(f"{call.what}: the ranks {list(sub.ranks)} (program {call.program}) are out of step: "
                            f"{detail} (a rank skipped a collective, is in another launch, or used other shapes)",
                            rule="sync", location=call.where)

    @staticmethod
    def _tail(sig: tuple[int, int], reduce: str | None, dtype: Any) -> np.ndarray:
        """Signature elements appended to a reduced payload: (s, s^2) per number for a sum (all equal iff the sums
        are n*s and n*s^2), (s, -s) for min/max (all equal iff both extremes are s)."""
        a, b = sig
        vals = [a, a * a, b, b * b] if reduce == "add" else [a, -a, b, -b]
        return np.array(vals, dtype=dtype)

    def _check_tail(self, got: np.ndarray, sig: tuple[int, int], reduce: str | None, n: int, sub: _Group,
                    call: Call) -> None:
        want = self._tail(sig, reduce, got.dtype)
        if reduce == "add":
            want = want * n
        if not np.array_equal(got, want):
            raise self._mismatch(sub, call, "another rank's reduction carried a different collective signature")

    def collective(self, call: Call, run: Any) -> list[np.ndarray]:
        """Exchange ``call``'s payload with its group over ``torch.distributed``; this rank's outputs.

        Every transfer carries the call's signature (a reduced tail or a byte tag), so ranks that are out of
        step are detected instead of mixing up data; one method per collective op does the transfer."""
        sub = self._subgroup(call)
        if sub.retired:
            raise NkiSyncError(f"{call.what}: the sub-group of ranks {list(call.group)} (program {call.program}) "
                               f"is out of step: an earlier collective on it was {sub.retired}", rule="sync",
                               location=call.where)
        sig = self._signature(call)
        if call.op in REDUCING:
            if len({a.dtype for a in call.payload}) > 1:
                return self._per_dtype(call, run)
            if call.op == "all_reduce":
                return self._all_reduce(call, sub, sig)
            return self._reduce_scatter(call, sub, sig)
        if call.op == "all_gather":
            return self._all_gather(call, sub, sig)
        if call.op == "all_to_all":
            return self._all_to_all(call, sub, sig)
        raise ValueError(call.op)  # pragma: no cover

    def _per_dtype(self, call: Call, run: Any) -> list[np.ndarray]:
        """A reduction over tensors of several dtypes (float32 and int64 coalesced): a reduction cannot mix
        dtypes in one buffer, so one transfer per dtype, the outputs put back in payload order."""
        pay = call.payload
        out: list[np.ndarray | None] = [None] * len(pay)
        for kind in sorted({a.dtype for a in pay}, key=str):
            idx = [i for i, a in enumerate(pay) if a.dtype == kind]
            part = Call(call.op, call.group, call.position, call.program, call.seq, [pay[i] for i in idx],
                        call.reduce, call.dim, call.what, call.where, call.replica_groups)
            for i, v in zip(idx, self.collective(part, run)):
                out[i] = v
        return out  # type: ignore[return-value]

    def _all_reduce(self, call: Call, sub: _Group, sig: tuple[int, int]) -> list[np.ndarray]:
        """All payload tensors flattened into one buffer with the signature tail, reduced in one transfer."""
        import torch

        dist = _dist()
        pay = call.payload
        op = _torch_op(dist, call.reduce)
        tail = self._tail(sig, call.reduce, pay[0].dtype)
        flat = np.concatenate([a.reshape(-1) for a in pay] + [tail])
        t = torch.from_numpy(np.ascontiguousarray(flat))
        self._wait(dist.all_reduce(t, op=op, group=sub.pg, async_op=True), sub, call)
        res = t.numpy()
        self._check_tail(res[-tail.size:], sig, call.reduce, len(call.group), sub, call)
        outs, o = [], 0
        for a in pay:
            outs.append(res[o:o + a.size].reshape(a.shape).copy())
            o += a.size
        return outs

    def _reduce_scatter(self, call: Call, sub: _Group, sig: tuple[int, int]) -> list[np.ndarray]:
        """Block j of the send buffer is every tensor's j-th chunk plus the signature tail; this rank receives
        the reduced block at its position."""
        import torch

        dist = _dist()
        pay, n, k = call.payload, len(call.group), call.position
        op = _torch_op(dist, call.reduce)
        tail = self._tail(sig, call.reduce, pay[0].dtype)
        chunks = [np.split(a, n, axis=0) for a in pay]
        blocks = [np.concatenate([c[j].reshape(-1) for c in chunks] + [tail]) for j in range(n)]
        t_in = torch.from_numpy(np.ascontiguousarray(np.concatenate(blocks)))
        t_out = torch.empty(blocks[0].size, dtype=t_in.dtype)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self._wait(fn(t_out, t_in, op=op, group=sub.pg, async_op=True), sub, call)
        res = t_out.numpy()
        self._check_tail(res[-tail.size:], sig, call.reduce, n, sub, call)
        outs, o = [], 0
        for c in chunks:
            m = c[k].size
            outs.append(res[o:o + m].reshape(c[k].shape).copy())
            o += m
        return outs

    def _all_gather(self, call: Call, sub: _Group, sig: tuple[int, int]) -> list[np.ndarray]:
        """The payload's bytes plus a signature tag gathered from every rank; a rank whose tag differs sent
        another collective."""
        import torch

        dist = _dist()
        pay, n = call.payload, len(call.group)
        tag = np.array(sig, dtype=np.uint8)
        flat = np.concatenate([_as_bytes(a) for a in pay] + [tag])
        t_in = torch.from_numpy(flat)
        t_out = torch.empty(n * flat.size, dtype=torch.uint8)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._wait(fn(t_out, t_in, group=sub.pg, async_op=True), sub, call)
        rows = t_out.numpy().reshape(n, flat.size)
        bad = [call.group[j] for j in range(n) if not np.array_equal(rows[j, -2:], tag)]
        if bad:
            raise self._mismatch(sub, call, f"rank(s) {bad} sent a different collective")
        per_rank = []
        for j in range(n):
            arrs, o = [], 0
            for a in pay:
                arrs.append(rows[j, o:o + a.nbytes].copy().view(a.dtype).reshape(a.shape))
                o += a.nbytes
            per_rank.append(arrs)
        return combine("all_gather", per_rank, call.position, None, call.dim)

    def _all_to_all(self, call: Call, sub: _Group, sig: tuple[int, int]) -> list[np.ndarray]:
        """Block j (every tensor's j-th chunk as bytes, plus the signature tag) goes to rank j; the received
        blocks are concatenated per tensor in group order."""
        import torch

        dist = _dist()
        pay, n, k = call.payload, len(call.group), call.position
        tag = np.array(sig, dtype=np.uint8)
        chunks = [np.split(a, n, axis=0) for a in pay]
        blocks = [np.concatenate([_as_bytes(c[j]) for c in chunks] + [tag]) for j in range(n)]
        t_in = torch.from_numpy(np.concatenate(blocks))
        t_out = torch.empty_like(t_in)
        self._wait(dist.all_to_all_single(t_out, t_in, group=sub.pg, async_op=True), sub, call)
        res = t_out.numpy().reshape(n, blocks[0].size)
        bad = [call.group[j] for j in range(n) if not np.array_equal(res[j, -2:], tag)]
        if bad:
            raise self._mismatch(sub, call, f"rank(s) {bad} sent a different collective")
        got: list[list[np.ndarray]] = [[] for _ in pay]
        for j in range(n):
            o = 0
            for i, c in enumerate(chunks):
                m = c[k].nbytes
                got[i].append(res[j, o:o + m].copy().view(c[k].dtype).reshape(c[k].shape))
                o += m
        return [np.concatenate(g, axis=0) for g in got]

    def rendezvous(self, call: Call) -> None:  # shape-only: no peers needed
        pass


# ---- choosing the transport of a launch -----------------------------------------------------------------------
@dataclass
class Resolved:
    """What a launch runs: the torch process group (or None for threads), this process's rank ids, job ranks."""

    pg: Any
    rank_ids: list[int]
    job_ranks: int


def _auto_group() -> Any:
    if os.environ.get(ENV_DIST, "auto").strip().lower() in ("off", "0", "no", "false", "threads"):
        return None
    dist = sys.modules.get("torch.distributed")  # never import torch just to find out
    if dist is None:
        return None
    try:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist.group.WORLD
    except Exception:  # noqa: BLE001 - a half-initialized job: stay in-process
        return None
    return None


def resolve(process_group: Any, ranks: int, rank_args: Any) -> Resolved:
    """The transport choice of ``run(..., ranks=, rank_args=, process_group=)``."""
    pg = process_group
    if pg is None and ranks == 1 and rank_args is None:
        pg = _auto_group()
        if pg is not None:
            log.debug("torch.distributed is initialized: nki.collectives run on the job's default group")
    if pg is None:
        return Resolved(None, list(range(ranks)), ranks)
    if ranks != 1 or rank_args is not None:
        raise NkiUsageError("ranks=/rank_args= simulate ranks as threads of one process; with process_group= every "
                            "process runs its own rank (launch the kernel once per rank)", rule="args")
    dist = _dist()
    if not (dist.is_available() and dist.is_initialized()):
        raise NkiUsageError("process_group= needs an initialized torch.distributed job "
                            "(dist.init_process_group)", rule="args")
    tg = torch_group(pg)
    return Resolved(pg, [tg.rank], tg.size)
