"""The separate process that runs an untrusted kernel: ``python -m fusegraph.llm.worker JOB_DIR``.

Nothing an LLM writes is imported or executed in the compiling process. The harness writes the kernel source,
the inputs (``inputs.npz``) and a ``job.json`` into a private temporary directory and starts this module with a
scrubbed environment. Before the kernel is loaded the worker

* caps its own address space, CPU time, file size and core dumps (``resource.setrlimit``, soft = hard, so the
  kernel cannot raise them again; the harness also enforces a wall-clock limit by killing the process group);
* replaces ``sys.stdout``/``sys.stderr`` by bounded sinks (a printing loop cannot fill a disk or a pipe);

then loads the source with :func:`fusegraph.nkisim.load_kernel_source`, strips the kernel namespace's builtins
down to the allow-list of :mod:`fusegraph.llm.safety` (defence in depth behind the static check), runs every
input case through the interpreter (``kernel[lnc]`` when the job says so) and writes ``outputs.npz`` plus
``result.json`` (with the first case's profile for the cost model). Per case it also reports where each output
came from — an input itself (``returned_inputs``), memory shared with an input (``input_views``: a view such as
``x.ap(...)`` that moved no data) or with an earlier output (``output_views``) — and which inputs the kernel
wrote (``written_inputs``), so the harness can insist that outputs are tensors the kernel allocated and wrote.
This module imports NumPy and the interpreter only (no torch): start-up stays around 0.2 s.
"""
from __future__ import annotations

import io
import json
import os
import sys
import time
import traceback
from typing import Any

import ml_dtypes
import numpy as np

_VIEW = {"bfloat16": np.uint16, "float8_e4m3": np.uint8, "float8_e5m2": np.uint8, "float8_e4m3fn": np.uint8}
_ML = {"bfloat16": ml_dtypes.bfloat16, "float8_e5m2": ml_dtypes.float8_e5m2, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}
MAX_TEXT = 4000
COMPUTE_ENGINES = ("tensor", "vector", "scalar", "gpsimd")
MAX_PROFILE_ENTRIES = 4000


def pack(arr: np.ndarray) -> tuple[np.ndarray, str]:
    """An array npz can store without pickling (ml_dtypes as raw bits) and its dtype name."""
    name = arr.dtype.name
    if name in _VIEW:
        return np.ascontiguousarray(arr).view(_VIEW[name]), name
    return np.ascontiguousarray(arr), name


def unpack(arr: np.ndarray, dtype_name: str) -> np.ndarray:
    if dtype_name in _ML:
        return arr.view(_ML[dtype_name])
    if arr.dtype.name != dtype_name:
        raise ValueError(f"array stored as {arr.dtype.name}, expected {dtype_name}")
    return arr


class _BoundedSink(io.TextIOBase):
    """Keeps the first ``limit`` characters written (kernel prints), drops the rest."""

    def __init__(self, limit: int = 16384) -> None:
        self.parts: list[str] = []
        self.size = 0
        self.limit = limit

    def write(self, s: str) -> int:
        if self.size < self.limit:
            keep = s[: self.limit - self.size]
            self.parts.append(keep)
            self.size += len(keep)
        return len(s)

    def text(self) -> str:
        return "".join(self.parts)


def _limit(memory_mb: int, cpu_s: int, file_mb: int) -> None:
    import resource

    def cap(which: int, value: int) -> None:
        soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))

    cap(resource.RLIMIT_AS, memory_mb * 1024 * 1024)
    cap(resource.RLIMIT_CPU, cpu_s)
    cap(resource.RLIMIT_FSIZE, file_mb * 1024 * 1024)
    cap(resource.RLIMIT_CORE, 0)


def _restricted_import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
    if level == 0 and (name == "math" or name == "nki" or name.startswith("nki.")):
        from fusegraph.nkisim.modules import kernel_import

        return kernel_import(name, globals, locals, fromlist, level)
    raise ImportError(f"import of {name!r} is not allowed in a kernel")


def _scrub_builtins(ns: dict) -> None:
    """Leave the kernel only the builtins the static allow-list admits (the dict is shared with its functions)."""
    from .safety import ALLOWED_BUILTINS

    bi = ns["__builtins__"]
    for key in list(bi):
        if key not in ALLOWED_BUILTINS:
            del bi[key]
    bi["__import__"] = _restricted_import


def _error(stage: str, exc: BaseException, kernel_file: str, case: str | None = None) -> dict:
    frames = [f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}: {(f.line or '').strip()}"
              for f in traceback.extract_tb(exc.__traceback__) if f.filename == kernel_file]
    return {"stage": stage, "case": case, "type": type(exc).__name__, "message": str(exc)[:MAX_TEXT],
            "rule": getattr(exc, "rule", None), "location": getattr(exc, "location", None), "trace": frames[-6:]}


def cost_profile(prof: Any) -> dict:
    """What the cost model needs of one run (per-line sites and DMAs, per-program instruction counts), bounded.

    ``program_instructions`` is only given when the profile kept every instruction record (it caps them), so an
    LNC=2 split can be measured instead of assumed.
    """
    from dataclasses import asdict

    d = {"sites": [asdict(x) for x in prof.sites], "dmas": [asdict(x) for x in prof.dmas]}
    programs = None
    if not prof.records_dropped:
        programs = [0] * max(1, int(prof.lnc))
        for r in prof.records:
            if 0 <= r.program < len(programs):
                programs[r.program] += 1
    return {"lnc": prof.lnc, "instructions": prof.instructions, "sites": d["sites"][:MAX_PROFILE_ENTRIES],
            "dmas": d["dmas"][:MAX_PROFILE_ENTRIES], "program_instructions": programs,
            "truncated": len(d["sites"]) > MAX_PROFILE_ENTRIES or len(d["dmas"]) > MAX_PROFILE_ENTRIES}


def _changed(now: np.ndarray, before: np.ndarray) -> bool:
    """Whether the kernel wrote ``now`` (bit patterns, so NaN inputs compare equal to themselves)."""
    return now.shape != before.shape or not np.array_equal(np.ascontiguousarray(now).view(np.uint8),
                                                           np.ascontiguousarray(before).view(np.uint8))


def run_job(job_dir: str) -> dict:
    with open(os.path.join(job_dir, "job.json")) as f:
        job = json.load(f)
    kernel_file = os.path.join(job_dir, "kernel.py")
    with open(kernel_file) as f:
        source = f.read()
    data = np.load(os.path.join(job_dir, "inputs.npz"), allow_pickle=False)
    # private, writable, contiguous copies: the interpreter then aliases them (writes land in them, views of an
    # input share their memory), which is what output_provenance() inspects
    cases = [[np.array(unpack(data[f"c{c}_a{a}"], spec["dtype"]), order="C", copy=True)
              for a, spec in enumerate(job["inputs"])] for c in range(len(job["cases"]))]

    from fusegraph import nkisim

    _limit(job["memory_mb"], job["cpu_s"], job["file_mb"])
    result: dict[str, Any] = {"ok": False, "cases": []}
    try:
        ns = nkisim.load_kernel_source(source, kernel_file, target=job["target"])
        kernel = ns.get(job["kernel"])
        if not isinstance(kernel, nkisim.Kernel):
            raise TypeError(f"{job['kernel']} is not an @nki.jit kernel after loading the file")
        _scrub_builtins(ns)
    except BaseException as exc:  # noqa: BLE001 - everything the kernel raises is a finding
        result["error"] = _error("load", exc, kernel_file)
        return result
    outputs: dict[str, np.ndarray] = {}
    for c, (case, args) in enumerate(zip(job["cases"], cases)):
        t0 = time.perf_counter()
        before = [a.copy() for a in args]
        try:
            out = nkisim.run(kernel, *args, target=job["target"], lnc=int(job.get("lnc", 1)))
        except BaseException as exc:  # noqa: BLE001
            result["error"] = _error("run", exc, kernel_file, case)
            return result
        outs = list(out) if isinstance(out, tuple) else [out]
        prof = nkisim.last_profile()
        if c == 0:
            result["profile"] = cost_profile(prof)
        info = {"case": case, "seconds": round(time.perf_counter() - t0, 4), "instructions": prof.instructions,
                "compute_instructions": sum(prof.engines[e].instructions for e in COMPUTE_ENGINES),
                "outputs": [], "returned_inputs": [], "input_views": [], "output_views": [],
                "written_inputs": [a for a, (x, x0) in enumerate(zip(args, before)) if _changed(x, x0)]}
        for k, o in enumerate(outs):
            hit = next((a for a, arr in enumerate(args) if o is arr), None)
            info["returned_inputs"].append(hit)
            if not isinstance(o, np.ndarray):
                result["error"] = {"stage": "check", "case": case, "type": "TypeError", "rule": None,
                                   "location": None, "trace": [],
                                   "message": f"output {k} is a {type(o).__name__}, not an array"}
                return result
            info["input_views"].append(next((a for a, arr in enumerate(args) if np.may_share_memory(o, arr)), None))
            info["output_views"].append(next((j for j in range(k) if np.may_share_memory(o, outs[j])), None))
            arr, name = pack(o)
            outputs[f"c{c}_o{k}"] = arr
            info["outputs"].append({"dtype": name, "shape": list(o.shape)})
        result["cases"].append(info)
    np.savez(os.path.join(job_dir, "outputs.npz"), **outputs)
    result["ok"] = True
    return result


def main(argv: list[str]) -> int:
    job_dir = argv[0]
    sink = _BoundedSink()
    sys.stdout = sys.stderr = sink
    try:
        result = run_job(job_dir)
    except MemoryError:
        result = {"ok": False, "cases": [], "error": {"stage": "run", "case": None, "type": "MemoryError",
                                                      "message": "memory limit exceeded", "rule": None,
                                                      "location": None, "trace": []}}
    except BaseException as exc:  # noqa: BLE001
        result = {"ok": False, "cases": [], "error": _error("worker", exc, "")}
    result["printed"] = sink.text()[-MAX_TEXT:]
    with open(os.path.join(job_dir, "result.json"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
