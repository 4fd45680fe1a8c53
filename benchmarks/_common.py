"""Shared helpers for benchmarks: run a measurement in a fresh process (clean peak-memory numbers), print a
table, write JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Sequence


def run_isolated(module: str, func: str, *args: str, timeout: int = 1800) -> dict[str, Any]:
    """Run ``module.func(*args)`` in a child interpreter; it must print one JSON line last."""
    code = f"import json,sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import {module} as m; print(json.dumps(m.{func}(*sys.argv[1:])))"
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{module}.{func}{args} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_isolated_partial(module: str, func: str, *args: str, timeout: int = 1800,
                         partial_env: str = "BENCH_PARTIAL", cpu_limit: int | None = None) -> dict[str, Any]:
    """:func:`run_isolated` that never raises: the child may write its row so far (JSON) to the file named by
    ``$partial_env`` as it goes; on a timeout or a failed process that row comes back with ``failure`` saying
    what stopped it (``timeout after N s`` or ``crash: <last stderr line>``). ``cpu_limit`` caps the child's CPU
    seconds (``RLIMIT_CPU``: a limit that does not depend on how loaded a shared machine is; ``timeout`` stays
    the wall-clock backstop); a child stopped by it comes back as ``timeout after N s of CPU``."""
    import resource
    import signal
    import tempfile

    def limit_cpu() -> None:
        if cpu_limit:
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_limit, cpu_limit + 5))

    fd, path = tempfile.mkstemp(prefix="bench-partial-", suffix=".json")
    os.close(fd)
    env = {**os.environ, partial_env: path, "FUSEGRAPH_PROGRESS": "0"}
    code = f"import json,sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import {module} as m; print(json.dumps(m.{func}(*sys.argv[1:])))"
    failure = None
    try:
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                           env=env, preexec_fn=limit_cpu if cpu_limit else None)
        if r.returncode == 0:
            return json.loads(r.stdout.strip().splitlines()[-1])
        tail = [line for line in r.stderr.strip().splitlines() if line.strip()]
        if cpu_limit and r.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            failure = f"timeout after {cpu_limit} s of CPU"
        else:
            failure = f"crash: exit {r.returncode}: {tail[-1][:240] if tail else 'no stderr'}"
    except subprocess.TimeoutExpired:
        failure = f"timeout after {timeout} s"
    finally:
        try:
            with open(path) as f:
                partial = json.load(f) if os.path.getsize(path) else {}
        except (OSError, ValueError):
            partial = {}
        os.unlink(path)
    return {**partial, "failure": failure}


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> None:
    widths = [max(len(title), *(len(_fmt(r.get(key))) for r in rows)) for key, title in columns]
    print("  ".join(t.ljust(w) for (_, t), w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(_fmt(r.get(k)).ljust(w) for (k, _), w in zip(columns, widths)))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return "" if v is None else str(v)


def write_json(path: str, data: Any, quiet: bool = False) -> None:
    """Write ``data`` as JSON (atomically); values JSON cannot hold (paths, enums) are written as their str."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=2, default=str)
    os.replace(path + ".tmp", path)
    if not quiet:
        print(f"wrote {path}")
