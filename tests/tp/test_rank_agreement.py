"""Ranks configured differently never hang (issue 24): the build-time rank agreement of
``fusegraph/executors/rank_agreement.py``.

Before it, one rank with ``FUSEGRAPH_VERIFY=0`` (its first call runs the kernel once; a verifying rank runs the kernel
and then the eager region, i.e. its collectives twice) or one rank with ``FUSEGRAPH_EXECUTOR=eager`` (collectives as
ATen ops, paired with a peer's collectives inside a kernel or its agreement all-gather) waited in a collective until
the job was killed. Now every rank publishes a fingerprint when it builds a graph with collectives (its executor, the
settings that decide the collectives, its kernel plan) through the job's store, bounded; a mismatch sends every rank
to the eager executor with one warning naming the setting and the ranks.

The 2-rank cases run under torchrun (gloo, loopback) and the harness kills the whole process group at 240 s, so a
regression fails instead of hanging. The store protocol itself is tested in-process on a real ``TCPStore`` with
threads as ranks (fast, bounded).
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tp_harness import run_ranks, save_tiny, skip_without_distributed


def _check_eager_on_every_rank(ranks: list[dict], setting: str, values: tuple[str, str]) -> None:
    """Both ranks ran the graph eagerly (tokens, logits and KV caches equal the eager TP step's) after one warning
    that names ``setting``, both values and both ranks."""
    for r in ranks:
        tag = f"rank {r['rank']}"
        assert r["tokens_compiled"] == r["tokens_eager"] and r["kv_equal"], tag
        assert r["logits_compiled"] == r["logits_eager"], tag  # the eager executor: the same ATen ops, same inputs
        agreement = [w for w in r["warnings"] if "not configured alike" in w]
        assert len(agreement) == 1, (tag, r["warnings"])
        w = agreement[0]
        assert setting in w and "every rank runs this graph" in w, (tag, w)
        assert f"{values[0]} on rank 0" in w and f"{values[1]} on rank 1" in w, (tag, w)
        for graph in r["executed"].values():
            assert set(graph["executed_by"].values()) <= {"eager"}, (tag, graph)
        assert all(step == [0] or step == [] or step == [None] for step in r["launches"]), (tag, r["launches"])


def test_two_ranks_configured_differently_run_eagerly_not_hang(tmp_path: Path) -> None:
    """Rank 1 with FUSEGRAPH_VERIFY=0 (rank 0 verifies), and rank 1 with FUSEGRAPH_EXECUTOR=eager (rank 0 runs the
    interpreter): both finish, every rank eager, the warning names the setting (and its variable) and the ranks."""
    skip_without_distributed()
    save_tiny("Llama", tmp_path / "llama")
    base = {"kind": "hf", "family": "Llama", "dir": str(tmp_path / "llama"), "steps": 2, "executor": "nkisim"}
    res = run_ranks([{**base, "name": "verify", "rank_env": {"1": {"FUSEGRAPH_VERIFY": "0"}}},
                     {**base, "name": "executor", "rank_env": {"1": {"FUSEGRAPH_EXECUTOR": "eager"}}}],
                    tmp_path / "out", timeout_s=240)
    _check_eager_on_every_rank(res["verify"], "verify (FUSEGRAPH_VERIFY)", ("True", "False"))
    _check_eager_on_every_rank(res["executor"], "executor (FUSEGRAPH_EXECUTOR)", ("nkisim", "eager"))


# ---- the store protocol, in-process (threads as ranks on one TCPStore) ------------------------------------------
@pytest.fixture
def store():
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    import datetime

    return dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=datetime.timedelta(seconds=30),
                         wait_for_workers=False)


def _client(master):
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=30))


def _as_ranks(store, members: list[int], prints: dict[int, dict], timeout: float) -> dict[int, tuple[dict, float]]:
    """Each member's verdict (and how long it took) when ``members`` exchange ``prints`` on ``store``; a member
    absent from ``prints`` never answers."""
    from fusegraph.executors.rank_agreement import _exchange

    out: dict[int, tuple[dict, float]] = {}

    def rank(r: int) -> None:
        client = _client(store)  # each rank has its own connection (a wait blocks it)
        t0 = time.monotonic()
        out[r] = (_exchange(client, "t", r, members, prints[r], timeout), time.monotonic() - t0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in prints]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return out


def test_agreeing_ranks_get_ok(store) -> None:
    fp = {"graph": "0", "executor": "nkisim", "verify": "True", "kernels": "1 kernel(s) with 6 collective(s) [ab]"}
    out = _as_ranks(store, [0, 1], {0: dict(fp), 1: dict(fp)}, timeout=30)
    assert [out[r][0] for r in (0, 1)] == [{"ok": True, "why": ""}] * 2


def test_a_differing_setting_is_named_with_its_ranks(store) -> None:
    fp = {"graph": "0", "executor": "nkisim", "lnc": "1", "kernels": "none"}
    out = _as_ranks(store, [0, 1, 2], {0: fp, 1: {**fp, "lnc": "2"}, 2: fp}, timeout=30)
    verdicts = {r: v for r, (v, _) in out.items()}
    assert verdicts[0] == verdicts[1] == verdicts[2] and not verdicts[0]["ok"]
    assert verdicts[0]["why"] == ("the ranks are not configured alike: lnc (FUSEGRAPH_LNC) is 1 on ranks 0, 2, "
                                  "2 on rank 1")


def test_a_peer_that_never_answers_is_waited_for_a_bounded_time(store) -> None:
    """Rank 1 never publishes: rank 0 gives up after the timeout (not the process group's 30 minutes) and runs
    eagerly; rank 1 arriving later adopts that verdict instead of running kernels alone."""
    fp = {"graph": "0", "executor": "nkisim"}
    (verdict, seconds), = _as_ranks(store, [0, 1], {0: fp}, timeout=1.0).values()
    assert not verdict["ok"] and "timed out after 1 s (no answer from rank(s) [1])" in verdict["why"]
    assert 0.9 <= seconds < 10
    late = _as_ranks(store, [0, 1], {1: fp}, timeout=1.0)
    assert late[1][0] == verdict and late[1][1] < 1.0  # everybody's keys are there: it reads the verdict at once


def test_no_job_means_nothing_to_agree_with() -> None:
    """Without an initialized process group (one process, the usual case) no exchange is attempted."""
    import torch.distributed as dist

    from fusegraph.executors.rank_agreement import agree_on_build
    from fusegraph.program import Program
    from fusegraph.settings import Settings

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    assert agree_on_build(Program(), 0, Settings(), "nkisim", None) is None


def test_judge_names_graphs_and_kernels_apart_from_settings() -> None:
    """Ranks compiling other graphs, or building other kernels with the same settings, are told as such; the
    kernels of ranks with different executors are not listed again (the executor says it all)."""
    from fusegraph.executors.rank_agreement import judge

    a = {"graph": "0", "executor": "nkisim", "verify": "True", "kernels": "1 kernel(s) with 6 collective(s) [ab]"}
    assert judge({0: a, 1: dict(a)}) == {"ok": True, "why": ""}
    assert judge({0: a, 1: {**a, "kernels": "none"}})["why"] == (
        "the ranks built different kernels with collectives (1 kernel(s) with 6 collective(s) [ab] on rank 0, "
        "none on rank 1)")
    assert judge({0: a, 1: {**a, "graph": "1"}})["why"] == (
        "the ranks are compiling different graphs (0 on rank 0, 1 on rank 1)")
    assert judge({0: a, 1: {**a, "executor": "eager", "kernels": "none"}})["why"] == (
        "the ranks are not configured alike: executor (FUSEGRAPH_EXECUTOR) is nkisim on rank 0, eager on rank 1")
    assert judge({0: {**a, "FUSEGRAPH_NKISIM_DIST": "''"}, 1: {**a, "FUSEGRAPH_NKISIM_DIST": "'off'"}})["why"] == (
        "the ranks are not configured alike: FUSEGRAPH_NKISIM_DIST is '' on rank 0, 'off' on rank 1")


def test_build_agreement_waits_five_sync_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Builds are not in lock step (one rank may generate kernels its peer has cached): the exchange's bound is
    5 x FUSEGRAPH_NKISIM_SYNC_TIMEOUT, and the fingerprint names the graph, the executor and the kernels."""
    import fusegraph.executors.rank_agreement as ra
    from fusegraph.program import Program
    from fusegraph.settings import Settings

    seen: dict = {}

    def exchange(store, prefix, me, members, mine, timeout):
        seen.update(timeout=timeout, mine=mine)
        return {"ok": True, "why": ""}

    monkeypatch.setattr(ra, "_peers", lambda program, graph_index: (object(), 0, [0, 1]))
    monkeypatch.setattr(ra, "_exchange", exchange)
    monkeypatch.setenv("FUSEGRAPH_NKISIM_SYNC_TIMEOUT", "7")
    monkeypatch.delenv("FUSEGRAPH_NKISIM_DIST", raising=False)
    assert ra.agree_on_build(Program(), 3, Settings(), "eager", None) is None
    assert seen["timeout"] == 35
    assert seen["mine"]["graph"] == "3" and seen["mine"]["executor"] == "eager" and seen["mine"]["kernels"] == "none"
    assert seen["mine"]["verify"] == "True" and not set(seen["mine"]) & (ra.RANK_LOCAL - {"executor"})
    assert seen["mine"]["FUSEGRAPH_NKISIM_DIST"] == "''"
