"""nki.collectives over torch.distributed (gloo, CPU processes on loopback) against the in-process thread ranks.

Every rank is its own process, started the way ``torchrun`` starts workers (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``, ``GLOO_SOCKET_IFNAME=lo``); each runs the kernels of
``test_collectives.KERNELS`` on its own arguments with ``process_group=`` (and once in the automatic mode) and, for
comparison, the same launch with every rank as a thread (``ranks=N, rank_args=...``). Processes run in their own
sessions and are killed at a deadline, so nothing can hang the suite.

    python tests/nkisim/test_collectives_dist.py MODE OUT_DIR     # one rank (the tests start them)
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


# ---- launching ranks -------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, world: int, port: int, timeout: float) -> dict[str, str]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
           "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
           "FUSEGRAPH_NKISIM_SYNC_TIMEOUT": str(timeout),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")])}
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def launch(mode: str, world: int, out_dir: Path, deadline_s: float = 90.0, timeout: float = 20.0,
           torchrun: bool = False) -> list[dict[str, Any]]:
    """Start ``world`` ranks of ``mode``; return each rank's result. Kills every process group at the deadline."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
               "--master-addr", "127.0.0.1", "--master-port", str(port), __file__, mode, str(out_dir)]
        env = _env(0, world, port, timeout)
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
            env.pop(k)
        procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True)]
    else:
        procs = [subprocess.Popen([sys.executable, __file__, mode, str(out_dir)], env=_env(r, world, port, timeout),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
                 for r in range(world)]
    end = time.monotonic() + deadline_s
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, end - time.monotonic()))
            logs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # only the sessions this test started
            except ProcessLookupError:
                pass
        pytest.fail(f"{mode}: the ranks did not finish within {deadline_s:.0f} s")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-6000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


# ---- one rank -------------------------------------------------------------------------------------------------
def _digest(outs: Any) -> list[str]:
    import numpy as np

    outs = outs if isinstance(outs, tuple) else (outs,)
    return [hashlib.sha1(np.ascontiguousarray(o).tobytes()).hexdigest() + f":{o.dtype}:{list(o.shape)}" for o in outs]


def _compare_cases(K: dict, rank: int, world: int, pg: Any) -> dict[str, Any]:
    import numpy as np

    import test_collectives as tc
    from fusegraph import nkisim

    n = world
    groups = (tuple(range(world)),)
    res: dict[str, Any] = {}
    for case, kname, lnc, kw in tc.CASES:
        for dtype in ("float32", "bfloat16"):
            kw2 = dict(kw, groups=groups)
            if kname in ("ag_hbm", "ag_sbuf", "rs_hbm", "rs_sbuf"):
                kw2["n"] = n
            all_args = [tc.case_args(tc.args_name(case), r, dtype, n) for r in range(world)]
            mine = nkisim.run(K[kname], *all_args[rank], lnc=lnc, process_group=pg, **kw2)
            prof = nkisim.last_profile()
            threads = nkisim.run(K[kname], lnc=lnc, ranks=world, rank_args=all_args, **kw2)[rank]
            a, b = tc.as_tuple(mine), tc.as_tuple(threads)
            diff = max(float(np.max(np.abs(tc.f32(x) - tc.f32(y)))) for x, y in zip(a, b))
            res[f"{case}/{dtype}"] = {"process": _digest(mine), "threads": _digest(threads), "max_abs_diff": diff,
                                      "collectives": prof.collectives, "ranks": prof.ranks}
    return res


def _attempt(fn: Any) -> dict[str, Any]:
    from fusegraph.nkisim import NkiSyncError

    t0 = time.monotonic()
    try:
        fn()
        return {"raised": None, "elapsed": time.monotonic() - t0}
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        return {"raised": type(exc).__name__, "rule": getattr(exc, "rule", None), "message": str(exc),
                "sync": isinstance(exc, NkiSyncError), "elapsed": time.monotonic() - t0}


def worker(mode: str, out_dir: str) -> None:
    import datetime

    import numpy as np
    import torch.distributed as dist

    import test_collectives as tc
    from fusegraph import nkisim

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    K = tc.kernels()
    out: dict[str, Any] = {"rank": rank, "world": world}
    if mode in ("compare", "tp4"):
        out["cases"] = _compare_cases(K, rank, world, dist.group.WORLD)
        # the automatic mode: no process_group, torch.distributed initialized, one rank per process
        x = tc.case_args("ar_sbuf", rank, "float32")[0]
        auto = nkisim.run(K["ar_sbuf"], x, groups=(tuple(range(world)),))
        all_x = [tc.case_args("ar_sbuf", r, "float32")[0] for r in range(world)]
        out["auto"] = {"process": _digest(auto),
                       "threads": _digest(nkisim.run(K["ar_sbuf"], ranks=world, rank_args=[(a,) for a in all_x],
                                                     groups=(tuple(range(world)),))[rank])}
        # shape-only: no peers, no communication (rank 1 alone profiles a full-size rank)
        if rank == 1:
            nkisim.run(K["ar_sbuf"], nkisim.Abstract((128, 16), "bfloat16"), shape_only=True,
                       groups=((0, 1, 2, 3, 4, 5, 6, 7),))
            out["shape_only"] = nkisim.last_profile().collectives
    if mode in ("compare", "timeout", "outofstep"):
        kname = "fail_on_rank" if mode == "compare" else "skip_on_rank"
        x = np.ones((32, 8), np.float32)
        out["failure"] = _attempt(lambda: nkisim.run(K[kname], x, process_group=dist.group.WORLD, bad_rank=1))
        if mode != "outofstep":  # outofstep: rank 1 goes on to its next launch while rank 0 still waits
            dist.barrier()  # the default group is not the kernels' sub-group: it is still in step
        # a later collective on a retired sub-group fails at once (no hang); out of step ranks are detected
        out["after"] = _attempt(lambda: nkisim.run(K["ar_sbuf"], x, process_group=dist.group.WORLD))
        dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out, default=str))
    sys.stdout.flush()
    os._exit(0)  # abandoned gloo work (the failure cases) must not delay the exit


# ---- the tests -------------------------------------------------------------------------------------------------
def _skip_without_gloo() -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")


def _check_equal(results: list[dict], exact: bool = True) -> None:
    for r, res in enumerate(results):
        assert res["rank"] == r
        for name, c in res["cases"].items():
            if exact:
                assert c["process"] == c["threads"], (r, name, c["max_abs_diff"])
            else:
                assert c["max_abs_diff"] <= (0.05 if "bfloat16" in name else 1e-5), (r, name, c["max_abs_diff"])
            assert c["ranks"] == len(results)
            assert {row["rank"] for row in c["collectives"]} == {r}
        if exact:
            assert res["auto"]["process"] == res["auto"]["threads"]


def test_two_processes_match_threads_and_a_failing_rank_stops_the_other(tmp_path):
    """2 gloo processes: every kernel of test_collectives (fp32, bf16, HBM/SBUF, LNC=2) gives the same bytes as the
    thread ranks; rank 1 breaking a rule before an all-reduce makes rank 0 raise NkiSyncError naming it, quickly."""
    _skip_without_gloo()
    t0 = time.monotonic()
    res = launch("compare", 2, tmp_path, deadline_s=90, timeout=20)
    _check_equal(res)
    f0, f1 = res[0]["failure"], res[1]["failure"]
    assert f1["raised"] == "NkiValidationError" and f1["rule"] == "op"
    assert f0["sync"] and f0["rule"] == "sync", f0
    assert "another rank failed" in f0["message"] and "rank 1" in f0["message"], f0["message"]
    assert f0["elapsed"] < 10, f0  # far below the 20 s timeout: the failure was published, not waited out
    for r in (0, 1):
        assert res[r]["after"]["raised"] == "NkiSyncError" and res[r]["after"]["elapsed"] < 10, res[r]["after"]
    (c,) = res[1]["shape_only"]
    assert c["group_size"] == 8 and c["bytes"] == 128 * 16 * 2
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_rank_that_never_issues_the_collective_times_out(tmp_path):
    _skip_without_gloo()
    res = launch("timeout", 2, tmp_path, deadline_s=60, timeout=3)
    f0 = res[0]["failure"]
    assert f0["sync"] and "no matching collective" in f0["message"] and 2.5 < f0["elapsed"] < 15, f0
    assert res[1]["failure"]["raised"] is None
    assert res[0]["after"]["raised"] == "NkiSyncError" and res[0]["after"]["elapsed"] < 2  # retired sub-group


@pytest.mark.slow
def test_ranks_out_of_step_are_detected_not_mixed(tmp_path):
    """Rank 1 skips an all-reduce and issues its next launch's: both ranks see the signatures differ."""
    _skip_without_gloo()
    res = launch("outofstep", 2, tmp_path, deadline_s=60, timeout=20)
    f0, a1 = res[0]["failure"], res[1]["after"]
    assert f0["sync"] and "out of step" in f0["message"] and f0["elapsed"] < 15, f0
    assert a1["sync"] and "out of step" in a1["message"], a1


@pytest.mark.slow
def test_four_processes_tp4_and_lnc2(tmp_path):
    """TP=4: movement ops and min/max bit-identical to threads; sums within rounding (gloo's order for 4 ranks)."""
    _skip_without_gloo()
    res = launch("tp4", 4, tmp_path, deadline_s=240, timeout=60)
    _check_equal(res, exact=False)
    for r in range(4):
        for name, c in res[r]["cases"].items():
            if not name.startswith(("ar_", "rs_", "lnc_")) or "_min" in name or "_max" in name:
                assert c["process"] == c["threads"], (r, name)


@pytest.mark.slow
def test_under_torchrun(tmp_path):
    _skip_without_gloo()
    res = launch("compare", 2, tmp_path, deadline_s=180, timeout=20, torchrun=True)
    _check_equal(res)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    worker(sys.argv[1], sys.argv[2])
