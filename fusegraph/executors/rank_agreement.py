"""Ranks of a tensor-parallel job agree on how a graph with collectives runs, before it runs any (docs/tp.md).

Every rank of a graph's collective groups must issue the same collectives in the same order: a kernel with its
collectives inside on one rank and the eager ops on another, a first call verified on one rank (kernel, then the
eager region: its collectives twice) and not on another, or kernels built differently never pair up, and the job
would wait in a collective forever. So when a graph with collectives is built, before its first call, every rank
publishes a fingerprint: the executor it will actually run (after any build fallback), the settings that decide
which collectives run and in what order (every option except the rank-local ones of :data:`RANK_LOCAL`) and the
kernel plan (which collective nodes its kernels cover). If any rank's fingerprint differs, every rank runs the
graph on the eager executor, with one warning naming the settings and the ranks.

The exchange goes through the job's key-value store (the ``TCPStore`` ``torch.distributed`` rendezvoused on), not a
collective: it is bounded by an explicit timeout (5 x ``FUSEGRAPH_NKISIM_SYNC_TIMEOUT``: 300 s), and an abandoned
exchange leaves nothing pending in the process group the model's own collectives use. The first rank to decide
writes the verdict (agreed, differ, or timed out) with an atomic ``compare_set``; every rank acts on that one verdict,
so a rank arriving after its peers gave up learns that they did and runs eagerly too.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import threading
from typing import Any

from ..program import Program
from ..settings import ENV_PREFIX, Settings
from ..warnings import one_line, warn
from .base import get_executor
from .kernels import covered_collectives

log = logging.getLogger(__name__)

#: options that only change this rank's files, logs or time limits, or outcomes that are agreed at run time anyway
#: (the verification tolerance: ``kernels.agree`` takes every rank's verdict): they may differ between ranks.
#: ``executor`` and ``dryrun`` are compared as the executor each rank actually runs.
RANK_LOCAL = frozenset({"executor", "dryrun", "report", "dump_dir", "cache_dir", "llm_cache_dir", "match_debug",
                        "llm_timeout_s", "llm_run_timeout_s", "llm_run_memory_mb", "verify_tolerance"})

#: the interpreter's own environment switches that change where a kernel's collectives go (``FUSEGRAPH_NKISIM_DIST``:
#: over torch.distributed or between threads) or whether a kernel runs at all (enum leniency, the run backend, the NKI
#: version's semantics)
NKISIM_ENV = ("FUSEGRAPH_NKISIM_DIST", "FUSEGRAPH_NKISIM_LENIENT_ENUMS", "FUSEGRAPH_NKISIM_BACKEND",
              "FUSEGRAPH_NKISIM_API")

#: builds are not in lock step (a rank generating kernels while its peer has them cached takes longer): the build
#: agreement waits this many times ``FUSEGRAPH_NKISIM_SYNC_TIMEOUT`` (default 5 x 60 s) before every rank runs eagerly
BUILD_WAIT_FACTOR = 5

_SEQ: dict[str, int] = {}
_SEQ_LOCK = threading.Lock()


def plan_digest(program: Program, runner: Any) -> str:
    """Which collective nodes the runner's scheduled kernels compute, kernel by kernel (``n kernel(s) with m
    collective(s) [digest]``); ``none`` for a runner without kernels (the eager executor)."""
    plans = list(getattr(runner, "plans", None) or [])
    active = getattr(runner, "active", range(len(plans)))
    covering = [covered_collectives(program, plans[k]) for k in sorted(active)
                if not getattr(plans[k], "disabled", False)]
    covering = [c for c in covering if c]
    if not covering:
        return "none"
    digest = hashlib.sha1(";".join(",".join(c) for c in covering).encode()).hexdigest()[:16]
    return f"{len(covering)} kernel(s) with {sum(map(len, covering))} collective(s) [{digest}]"


def fingerprint(settings: Settings, executor: str, kernels: str, graph_index: int) -> dict[str, str]:
    """What every rank must have alike to issue the same collectives in the same order (see the module docstring)."""
    out = {"graph": str(graph_index), "executor": executor}
    out.update({k: repr(v) for k, v in sorted(settings.to_dict().items()) if k not in RANK_LOCAL})
    out.update({name: repr(os.environ.get(name, "")) for name in NKISIM_ENV})
    out["kernels"] = kernels
    return out


def group_members(program: Program, graph_index: int) -> list[int]:
    """The job ranks of every process group the graph's collectives run on (sorted)."""
    G = program.graph
    ranks: set[int] = set()
    for n in program.collectives(graph_index):
        ranks.update(getattr(G.nodes[n]["collective"].group, "ranks", None) or ())
    return sorted(ranks)


def agree_or_eager(program: Program, graph_index: int, settings: Settings, executor: str,
                   runner: Any) -> tuple[str, Any]:
    """(executor, runner) of graph ``graph_index`` once its ranks agreed: unchanged when they did (or the graph has
    no collectives), else the eager executor's runner on every rank, one warning naming what differs."""
    if not program.collectives(graph_index):
        return executor, runner
    try:
        why = agree_on_build(program, graph_index, settings, executor, runner)
    except Exception as e:  # noqa: BLE001 - unexpected: the peers time out waiting for this rank and run eagerly
        if settings.pass_through_build_failures:
            raise
        why = f"rank agreement failed on this rank ({one_line(e)})"
    if why is None:
        return executor, runner
    retire(program, graph_index, why)
    warn(f"graph {graph_index}: {why}; every rank runs this graph (and its collectives) on the eager path")
    return "eager", get_executor("eager").compile(program, graph_index, settings)


def agree_on_build(program: Program, graph_index: int, settings: Settings, executor: str,
                   runner: Any, timeout_s: float | None = None) -> str | None:
    """Exchange this rank's fingerprint with the ranks of the graph's collective groups (bounded by ``timeout_s``,
    default :data:`BUILD_WAIT_FACTOR` x ``FUSEGRAPH_NKISIM_SYNC_TIMEOUT``); None if every rank has the same, else why
    not (the same text on every rank). Without collectives, without a multi-process job, or on torch's fake process
    group: None (no peers)."""
    store, me, members = _peers(program, graph_index)
    if store is None:
        return None
    from ..nkisim.sync import default_timeout

    timeout = BUILD_WAIT_FACTOR * default_timeout() if timeout_s is None else timeout_s
    mine = fingerprint(settings, executor, plan_digest(program, runner), graph_index)
    verdict = _exchange(store, _prefix(members), me, members, mine, timeout)
    return None if verdict.get("ok") else str(verdict.get("why") or "rank agreement failed")


def retire(program: Program, graph_index: int, why: str) -> None:
    """The graph's execution record (if an executor with kernels filled one) says no kernel of it runs, and why."""
    record = program.execution.get(graph_index)
    if record is None:
        return
    run = getattr(record, "run", None)
    for plan in getattr(run, "plans", None) or []:
        plan.disabled = True
    for region in record.regions:
        region.disabled = True
        region.verification = f"not run: {why}"
    for island in record.llm:
        island.disabled = True
    record.launches_per_call = 0


def _peers(program: Program, graph_index: int) -> tuple[Any, int, list[int]]:
    """(the job's store, this rank, the ranks to agree with), or (None, 0, []) when there is nobody to agree with."""
    members = group_members(program, graph_index)
    if len(members) < 2:
        return None, 0, []
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() == "fake":
            return None, 0, []
        me = dist.get_rank()
        store = dist.distributed_c10d._get_default_store()
    except Exception as e:  # noqa: BLE001 - no usable job or store: nothing to exchange with
        log.debug("rank agreement skipped: %s", e)
        return None, 0, []
    if me not in members:
        return None, 0, []
    return store, me, members


def _prefix(members: list[int]) -> str:
    """A key prefix unique per exchange: the same on every member as long as they build the same graphs in the same
    order (the fingerprint names the graph, so ranks out of step are told apart), and per elastic restart."""
    tag = "-".join(map(str, members))
    with _SEQ_LOCK:
        _SEQ[tag] = seq = _SEQ.get(tag, 0) + 1
    return f"fusegraph.agree/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{tag}/{seq}"


def _exchange(store: Any, prefix: str, me: int, members: list[int], mine: dict[str, str],
              timeout: float) -> dict[str, Any]:
    """Publish ``mine``, wait (bounded) for every member's, judge, and return the one verdict every member acts on
    (the first written: ``compare_set`` on an absent key writes it, on a present one returns the value there)."""
    keys = {r: f"{prefix}/fp/{r}" for r in members}
    try:
        store.set(keys[me], json.dumps(mine))
        store.wait(list(keys.values()), datetime.timedelta(seconds=timeout))
        verdict = judge({r: json.loads(store.get(k)) for r, k in keys.items()})
    except Exception as e:  # noqa: BLE001 - a peer that never answers (or a store going down): bounded, eager
        missing = _missing(store, keys)
        who = f"no answer from rank(s) {missing}" if missing else one_line(e)
        verdict = {"ok": False, "why": f"rank agreement timed out after {timeout:.0f} s ({who})"}
    try:
        final = store.compare_set(f"{prefix}/verdict", "", json.dumps(verdict))
        return json.loads(final)
    except Exception as e:  # noqa: BLE001 - the store is gone: this rank cannot know the peers' verdict
        return {"ok": False, "why": f"rank agreement failed ({one_line(e)})"}


def _missing(store: Any, keys: dict[int, str]) -> list[int]:
    try:
        return [r for r, k in keys.items() if not store.check([k])]
    except Exception:  # noqa: BLE001 - the store is unreachable: every peer is unknown
        return []


def judge(prints: dict[int, dict[str, str]]) -> dict[str, Any]:
    """The verdict on every rank's fingerprint: agreed, or which entries differ and on which ranks (the kernels only
    when the executors are alike: another executor builds other kernels anyway)."""
    names = sorted({k for p in prints.values() for k in p} - {"graph", "kernels"}, key=lambda k: (k != "executor", k))
    settings = [_describe(n, _by_value(prints, n)) for n in names if len(_by_value(prints, n)) > 1]
    why = ["the ranks are not configured alike: " + "; ".join(settings)] if settings else []
    if len(_by_value(prints, "graph")) > 1:
        why.append(_describe("graph", _by_value(prints, "graph")))
    if len(_by_value(prints, "kernels")) > 1 and len(_by_value(prints, "executor")) == 1:
        why.append(_describe("kernels", _by_value(prints, "kernels")))
    return {"ok": not why, "why": "; ".join(why)}


def _by_value(prints: dict[int, dict[str, str]], name: str) -> dict[str, list[int]]:
    by_value: dict[str, list[int]] = {}
    for r in sorted(prints):
        by_value.setdefault(prints[r].get(name, "<unset>"), []).append(r)
    return by_value


def _describe(name: str, by_value: dict[str, list[int]]) -> str:
    values = ", ".join(f"{v} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
                       for v, rs in by_value.items())
    if name == "kernels":
        return f"the ranks built different kernels with collectives ({values})"
    if name == "graph":
        return f"the ranks are compiling different graphs ({values})"
    if name.startswith(ENV_PREFIX):  # an environment variable of the interpreter
        return f"{name} is {values}"
    return f"{name} ({ENV_PREFIX}{name.upper()}) is {values}"
