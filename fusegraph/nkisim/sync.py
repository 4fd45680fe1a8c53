"""Rendezvous between the threads of one launch: LNC=2 programs (sendrecv, core_barrier) and ranks
(collectives).

Every wait has a timeout (``FUSEGRAPH_NKISIM_SYNC_TIMEOUT`` seconds, default 60) so that a mismatched
sendrecv or a barrier reached by only one program becomes an error instead of a hang, and a failure in one
thread aborts the waits of all the others.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ..warnings import warn
from .errors import NkiSyncError


SYNC_TIMEOUT_ENV = "FUSEGRAPH_NKISIM_SYNC_TIMEOUT"
DEFAULT_SYNC_TIMEOUT = 60.0


def default_timeout() -> float:
    """The rendezvous timeout from ``FUSEGRAPH_NKISIM_SYNC_TIMEOUT`` (seconds, default 60). Why lenient: a typo in
    a deployment's environment must not fail a forward pass at its first collective with an error that does not
    name the variable; a value that is not a positive finite number warns once (naming it) and the default is used."""
    raw = os.environ.get(SYNC_TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_SYNC_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (0 < value < float("inf")):
        warn(f"{SYNC_TIMEOUT_ENV}={raw!r} is not a positive number of seconds; using {DEFAULT_SYNC_TIMEOUT:g}")
        return DEFAULT_SYNC_TIMEOUT
    return value


class SyncHub:
    def __init__(self, ranks: int, lnc: int, timeout: float | None = None, rank_ids: list[int] | None = None):
        self.ranks = ranks
        self.lnc = lnc
        self.timeout = default_timeout() if timeout is None else timeout
        self.cond = threading.Condition()
        self.mail: dict[tuple, Any] = {}
        # rank ids of the ranks this process runs (a torch.distributed launch runs one rank, e.g. rank 3)
        self.barriers: dict[int, threading.Barrier] = {
            r: threading.Barrier(lnc, timeout=self.timeout) for r in (rank_ids if rank_ids is not None else range(ranks))
        }
        self.collectives: dict[tuple, dict[int, Any]] = {}
        self.aborted: str | None = None

    def abort(self, why: str) -> None:
        with self.cond:
            if self.aborted is None:
                self.aborted = why
            self.cond.notify_all()
        for b in self.barriers.values():
            b.abort()

    def _wait(self, pred, what: str, where: str | None) -> None:
        ok = self.cond.wait_for(lambda: pred() or self.aborted is not None, timeout=self.timeout)
        if self.aborted is not None and not pred():
            raise NkiSyncError(f"{what}: aborted because another program failed ({self.aborted})", rule="sync",
                               location=where)
        if not ok:
            raise NkiSyncError(
                f"{what}: no matching peer after {self.timeout:.0f}s (deadlock: programs diverged or the peer "
                f"never issued the matching operation)",
                rule="sync",
                location=where,
            )

    # -------------------------------------------------------------- sendrecv
    def sendrecv(self, rank: int, pipe: int, seq: int, me: int, to: int, frm: int, payload: Any,
                 what: str, where: str | None) -> Any:
        with self.cond:
            self.mail[(rank, pipe, seq, me, to)] = payload
            self.cond.notify_all()
            key = (rank, pipe, seq, frm, me)
            self._wait(lambda: key in self.mail, what, where)
            return self.mail.pop(key)

    # -------------------------------------------------------------- barrier
    def barrier(self, rank: int, what: str, where: str | None) -> None:
        try:
            self.barriers[rank].wait()
        except threading.BrokenBarrierError:
            if self.aborted is not None:
                raise NkiSyncError(f"{what}: aborted because another program failed ({self.aborted})", rule="sync",
                                   location=where) from None
            raise NkiSyncError(
                f"{what}: the other program did not reach the barrier within {self.timeout:.0f}s", rule="sync",
                location=where,
            ) from None

    # -------------------------------------------------------------- collectives
    def exchange(self, key: tuple, group: tuple[int, ...], rank: int, payload: Any, what: str,
                 where: str | None) -> dict[int, Any]:
        """Deposit ``payload`` for ``rank`` under ``key`` and wait until every rank of ``group`` did."""
        with self.cond:
            slot = self.collectives.setdefault(key, {})
            slot[rank] = payload
            self.cond.notify_all()
            self._wait(lambda: all(r in slot for r in group), what, where)
            return dict(slot)
