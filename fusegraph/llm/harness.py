"""Verification of untrusted kernel source, in order, stopping at the first failing stage.

==============  ====================================================================================
stage           what is checked
==============  ====================================================================================
``parse``       the source is Python (size-capped; never executed here)
``safety``      the AST allow-list (:mod:`.safety`): imports, names, attributes, statements
``conformance`` every NKI reference and call exists with these parameters in NKI 0.3.0 *and* 0.6.0
``contract``    one ``@nki.jit`` kernel with the task's arity that calls NKI compute instructions and does
                not return its inputs (:mod:`.contract`)
``reference``   the torch reference runs on the verification inputs (a failure here is the caller's bug)
``run``         the kernel runs in a separate, resource-limited process (:mod:`.worker`) on every case,
                launched as ``kernel[2]`` for an LNC=2 task; the first case's profile comes back for the cost model
``computes``    the run executed compute-engine instructions; every output is a tensor the kernel allocated
                (not an input, a view of an input or another output); an ``alias_of`` output is the input
                buffer itself, written in place; inputs not declared in place are left unchanged
``compare``     every output matches the reference within the dtype's tolerance, on every case
==============  ====================================================================================

Each failure becomes a :class:`Verdict` whose ``reason`` is one line (for reports) and whose ``detail`` is the
concrete error the repair round sends back to the model. ``cheat`` marks a verdict where the kernel tried to
pass without computing (it returned an input or a view of one, or computed nothing); ``close`` a wrong answer
within :data:`LOOSE_FACTOR` times the tolerance. Both feed the reward ladder of :mod:`.outcome`.
"""
from __future__ import annotations

import ast
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fusegraph.nkisim.torch_io import to_numpy, to_torch

from . import compare as cmp
from .contract import KernelInfo, check_contract
from .inputs import make_cases
from .safety import check_safety
from .task import KernelTask

MAX_SOURCE_CHARS = 100_000
LOOSE_FACTOR = 10.0
"""A wrong answer within this multiple of the tolerance (on every output and case) counts as ``close``."""
CONFORMANCE_VERSIONS = ("0.3.0", "0.6.0")


@dataclass(frozen=True)
class Limits:
    """Resource limits of one verification run (all cases of one kernel)."""

    timeout_s: float = 60.0
    memory_mb: int = 4096
    file_mb: int = 256


@dataclass
class Verdict:
    ok: bool
    stage: str  # the stage that failed, or "accepted"
    reason: str  # one line
    detail: str = ""  # the full error text for the repair prompt
    max_abs_diff: float | None = None
    seconds: float = 0.0
    cases: list[dict[str, Any]] = field(default_factory=list)  # per-case run info from the worker
    profile: dict[str, Any] | None = None  # the first case's cost profile, once the kernel ran (for modeled time)
    cheat: bool = False  # it would pass without computing (returned / viewed an input, computed nothing)
    close: bool = False  # compare failed, but every output is within LOOSE_FACTOR x the tolerance

    @classmethod
    def fail(cls, stage: str, reason: str, detail: str = "", **kw: Any) -> "Verdict":
        return cls(False, stage, reason, detail or reason, **kw)


def _findings_verdict(stage: str, what: str, findings: list) -> Verdict:
    lines = [str(f) for f in findings]
    head = "; ".join(lines[:3]) + (f" (+{len(lines) - 3} more)" if len(lines) > 3 else "")
    if len(head) > 400:
        head = head[:397] + "..."
    return Verdict.fail(stage, f"{what}: {head}", f"{what}:\n" + "\n".join(f"  {x}" for x in lines[:30]),
                        cheat=any(getattr(f, "cheat", False) for f in findings))


def parse(source: str) -> tuple[ast.Module | None, Verdict | None]:
    if len(source) > MAX_SOURCE_CHARS:
        return None, Verdict.fail("parse", f"the kernel source is {len(source)} characters (limit {MAX_SOURCE_CHARS})")
    try:
        return ast.parse(source), None
    except SyntaxError as e:
        return None, Verdict.fail("parse", f"syntax error at line {e.lineno}: {e.msg}",
                                  f"the kernel is not valid Python: line {e.lineno}: {e.msg}\n  {(e.text or '').rstrip()}")
    except (ValueError, RecursionError, MemoryError) as e:
        return None, Verdict.fail("parse", f"the kernel source cannot be parsed: {type(e).__name__}: {e}")


def static_checks(source: str, task: KernelTask) -> tuple[KernelInfo | None, Verdict | None]:
    """Stages parse, safety, conformance and contract. Returns the kernel found, or the failing verdict."""
    from fusegraph.nkiapi.conformance import check_source

    tree, bad = parse(source)
    if bad is not None:
        return None, bad
    findings = check_safety(tree)
    if findings:
        return None, _findings_verdict("safety", "not allowed in a kernel", findings)
    violations = check_source(source, versions=CONFORMANCE_VERSIONS)
    if violations:
        return None, _findings_verdict("conformance", "NKI API conformance", violations)
    info, findings = check_contract(tree, task)
    if findings or info is None:
        return None, _findings_verdict("contract", "kernel contract", findings)
    return info, None


def _as_tuple(out: Any) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def reference_outputs(task: KernelTask, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Run the trusted reference on clones of ``inputs`` (it may write them in place, like a KV update)."""
    with torch.no_grad():
        outs = _as_tuple(task.reference(*[t.clone() for t in inputs]))
    if len(outs) != len(task.outputs):
        raise ValueError(f"the reference returned {len(outs)} value(s), the task declares {len(task.outputs)} output(s)")
    for o, spec in zip(outs, task.outputs):
        if not isinstance(o, torch.Tensor) or tuple(o.shape) != spec.shape:
            got = tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
            raise ValueError(f"the reference's output {spec.name!r} is {got}, the task declares {spec.shape}")
    return tuple(o.detach().to("cpu") for o in outs)


def _np_dtype_name(dtype: torch.dtype) -> str:
    return "bfloat16" if dtype == torch.bfloat16 else str(dtype).replace("torch.", "")


@dataclass
class RunOutcome:
    ok: bool
    reason: str = ""
    detail: str = ""
    outputs: list[list[torch.Tensor]] = field(default_factory=list)  # per case, per output
    cases: list[dict[str, Any]] = field(default_factory=list)
    printed: str = ""
    seconds: float = 0.0
    profile: dict[str, Any] | None = None  # the first case's cost profile (worker.cost_profile)


def run_isolated(source: str, kernel: str, task: KernelTask, cases: list[tuple[str, list[torch.Tensor]]],
                 target: str = "trn2", limits: Limits = Limits()) -> RunOutcome:
    """Run ``kernel`` from ``source`` on every case in a fresh, limited worker process; never in this one."""
    from .worker import pack, unpack

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fusegraph-llm-") as job_dir:
        with open(os.path.join(job_dir, "kernel.py"), "w") as f:
            f.write(source)
        arrays = {}
        for c, (_, ins) in enumerate(cases):
            for a, t in enumerate(ins):
                arrays[f"c{c}_a{a}"] = pack(to_numpy(t.contiguous()).copy())[0]
        np.savez(os.path.join(job_dir, "inputs.npz"), **arrays)
        job = {"kernel": kernel, "target": target, "cases": [c for c, _ in cases],
               "inputs": [{"name": s.name, "dtype": _np_dtype_name(s.kernel_dtype)} for s in task.inputs],
               "memory_mb": int(limits.memory_mb), "cpu_s": int(math.ceil(limits.timeout_s)) + 1,
               "file_mb": int(limits.file_mb), "lnc": int(getattr(task, "lnc", 1))}
        with open(os.path.join(job_dir, "job.json"), "w") as f:
            json.dump(job, f)
        env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": job_dir, "TMPDIR": job_dir, "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
               "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [sys.executable, "-I", "-m", "fusegraph.llm.worker", job_dir]
        proc = subprocess.Popen(cmd, cwd=job_dir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            _kill(proc)
            return RunOutcome(False, f"killed by the time limit ({limits.timeout_s:g} s): the kernel did not finish",
                              f"the kernel ran longer than the {limits.timeout_s:g} s limit and was killed (an "
                              f"endless loop, or far too much work for the shapes of the task)",
                              seconds=time.perf_counter() - t0)
        seconds = time.perf_counter() - t0
        result_path = os.path.join(job_dir, "result.json")
        if not os.path.exists(result_path):
            return RunOutcome(False, *_death_reason(proc.returncode, err, limits), seconds=seconds)
        with open(result_path) as f:
            result = json.load(f)
        if not result.get("ok"):
            reason, detail = _error_text(result.get("error") or {}, limits)
            return RunOutcome(False, reason, detail, printed=result.get("printed", ""), seconds=seconds)
        data = np.load(os.path.join(job_dir, "outputs.npz"), allow_pickle=False)
        outputs = []
        for c, info in enumerate(result["cases"]):
            outs = []
            for k, meta in enumerate(info["outputs"]):
                outs.append(to_torch(unpack(data[f"c{c}_o{k}"], meta["dtype"])))
            outputs.append(outs)
        profile = result.get("profile")
        return RunOutcome(True, outputs=outputs, cases=result["cases"], printed=result.get("printed", ""),
                          seconds=seconds, profile=profile if isinstance(profile, dict) else None)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _death_reason(code: int | None, err: bytes, limits: Limits) -> tuple[str, str]:
    tail = (err or b"").decode("utf-8", "replace")[-1500:]
    if code is not None and code < 0:
        sig = -code
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        if sig == signal.SIGXCPU:
            return (f"killed by the CPU time limit ({limits.timeout_s:g} s)",
                    "the kernel used more CPU time than allowed and was killed")
        if sig == signal.SIGXFSZ:
            return "killed by the file size limit", "the verification process exceeded its file size limit"
        return f"the verification process died with {name}", f"the verification process died with {name}\n{tail}"
    if "MemoryError" in tail:
        return (f"memory limit exceeded ({limits.memory_mb} MiB)",
                f"the kernel exceeded the {limits.memory_mb} MiB memory limit of the verification process")
    return (f"the verification process failed (exit code {code})",
            f"the verification process failed (exit code {code}):\n{tail}")


def _error_text(e: dict, limits: Limits) -> tuple[str, str]:
    etype, msg = e.get("type", "Error"), (e.get("message") or "").strip()
    if etype == "MemoryError":
        return (f"memory limit exceeded ({limits.memory_mb} MiB)",
                f"the kernel exceeded the {limits.memory_mb} MiB memory limit of the verification process")
    where = {"load": "loading the kernel", "run": "running the kernel", "check": "checking the kernel's outputs",
             "worker": "starting the verification process"}.get(e.get("stage"), "running the kernel")
    case = f" (input case '{e['case']}')" if e.get("case") else ""
    first = msg.splitlines()[0] if msg else ""
    reason = f"{etype} while {where}{case}: {first}"[:300]
    detail = f"{etype} while {where}{case}:\n{msg}"
    if e.get("trace"):
        detail += "\nkernel traceback (innermost last):\n" + "\n".join(f"  {t}" for t in e["trace"])
    return reason, detail


def verify(source: str, task: KernelTask, *, target: str = "trn2", limits: Limits = Limits(),
           seed: int = 0) -> Verdict:
    """Run every stage on ``source``; the kernel itself only ever runs in the worker process."""
    t0 = time.perf_counter()

    def done(v: Verdict) -> Verdict:
        v.seconds = round(time.perf_counter() - t0, 3)
        return v

    problems = task.problems()
    if problems:
        return done(Verdict.fail("reference", "invalid task: " + "; ".join(problems)))
    info, bad = static_checks(source, task)
    if bad is not None:
        return done(bad)
    assert info is not None
    try:
        cases = make_cases(task, seed)
        refs, kept, skipped = [], [], []
        for case, ins in cases:
            out = reference_outputs(task, ins)
            if any(o.is_floating_point() and bool(torch.isnan(o).any()) for o in out):
                if case == "random":
                    return done(Verdict.fail("reference", "the torch reference produces NaN on random inputs"))
                skipped.append(case)
                continue
            refs.append(out)
            kept.append((case, ins))
    except Exception as e:  # noqa: BLE001 - the reference is the caller's code; report, do not raise
        return done(Verdict.fail("reference", f"the torch reference failed: {type(e).__name__}: {e}"))
    run = run_isolated(source, info.name, task, kept, target=target, limits=limits)
    if not run.ok:
        return done(Verdict.fail("run", run.reason, run.detail))
    bad = check_provenance(task, kept, run.cases)
    if bad is not None:
        return done(bad)
    worst = 0.0
    for (case, _), ref, got in zip(kept, refs, run.outputs):
        if len(got) != len(task.outputs):
            return done(Verdict.fail("compare", f"the kernel returned {len(got)} output(s), expected {len(task.outputs)}",
                                     cases=run.cases))
        for spec, g, r in zip(task.outputs, got, ref):
            want = _np_dtype_name(spec.kernel_dtype)
            have = "bfloat16" if g.dtype == torch.bfloat16 else str(g.dtype).replace("torch.", "")
            if have != want:
                return done(Verdict.fail("compare", f"output '{spec.name}' has dtype {have}, expected {want}",
                                         cases=run.cases))
            msg, diff = cmp.compare(g, r.to(g.dtype) if not r.is_floating_point() else r, spec, case)
            worst = max(worst, diff)
            if msg is not None:
                return done(Verdict.fail("compare", msg.split(";")[0], msg, max_abs_diff=diff, cases=run.cases,
                                         close=_close(task, refs, run.outputs)))
    note = f" (cases skipped: reference NaN on {', '.join(skipped)})" if skipped else ""
    return done(Verdict(True, "accepted", f"verified on {len(kept)} input case(s){note}; max |diff| {worst:.3g}",
                        max_abs_diff=worst, cases=run.cases, profile=run.profile))


def _close(task: KernelTask, refs: list[tuple[torch.Tensor, ...]], outputs: list[list[torch.Tensor]]) -> bool:
    """Every output of every case within LOOSE_FACTOR x its tolerance (a near miss, not a wrong algorithm)."""
    for ref, got in zip(refs, outputs):
        if len(got) != len(task.outputs):
            return False
        for spec, g, r in zip(task.outputs, got, ref):
            if g.dtype != spec.kernel_dtype or not cmp.within(g, r.to(g.dtype) if not r.is_floating_point() else r,
                                                              spec, LOOSE_FACTOR):
                return False
    return True


def _provenance_fail(reason: str, detail: str, cases: list[dict[str, Any]], cheat: bool) -> Verdict:
    return Verdict.fail("computes", reason, detail, cases=cases, cheat=cheat)


def check_provenance(task: KernelTask, kept: list[tuple[str, list[torch.Tensor]]],
                     cases: list[dict[str, Any]]) -> Verdict | None:
    """The run-time half of "the kernel computed its outputs": None when every case passes, else the verdict.

    Why at run time: ``return x.ap(pattern=...)`` (a transposed view of the input, no data moved) or writing
    the answer into an input and returning a view of it cannot be told from the source; the worker reports
    which memory each output shares (:mod:`.worker`).
    """
    names = [s.name for s in task.inputs]
    in_place = {names.index(o.alias_of) for o in task.outputs if o.alias_of in names}
    for (case, _), c in zip(kept, cases):
        if c["compute_instructions"] == 0 and not task.data_movement_only:
            return _provenance_fail(
                f"no compute-engine instruction ran (input case '{case}'): the kernel only moves data",
                "the kernel ran without executing a single Tensor/Vector/Scalar/GpSimd engine instruction; it must "
                "compute its outputs with NKI instructions", cases, cheat=True)
        bad = _output_provenance(task, names, c)
        if bad is not None:
            reason, detail, cheat = bad
            return _provenance_fail(reason, detail, cases, cheat=cheat)
        wrote = [names[i] for i in c.get("written_inputs", []) if i not in in_place]
        if wrote:
            return _provenance_fail(
                f"the kernel wrote its input '{wrote[0]}' (input case '{case}'), which the task does not declare as "
                f"written in place",
                f"the kernel modified its input(s) {', '.join(repr(w) for w in wrote)}; inputs are read-only unless an "
                f"output is declared as written in place (alias_of): write results into tensors you allocate with "
                f"nl.ndarray(..., buffer=nl.shared_hbm)", cases, cheat=False)
    return None


def _output_provenance(task: KernelTask, names: list[str], c: dict[str, Any]) -> tuple[str, str, bool] | None:
    """(reason, detail, cheat) for the first output that is not what the contract requires, else None."""
    allocate = "allocate the output with nl.ndarray(..., buffer=nl.shared_hbm) and write every element of it"
    views = c.get("input_views") or [None] * len(c["returned_inputs"])
    others = c.get("output_views") or [None] * len(c["returned_inputs"])
    for k, spec in enumerate(task.outputs[: len(c["returned_inputs"])]):
        same, view, other = c["returned_inputs"][k], views[k], others[k]
        if spec.alias_of is not None:
            want = names.index(spec.alias_of)
            if same != want:
                got = (f"a view of the input '{names[view]}'" if view is not None and same is None
                       else f"the input '{names[same]}'" if same is not None else "a new tensor")
                return (f"output '{spec.name}' must be the input '{spec.alias_of}' written in place, the kernel "
                        f"returned {got}",
                        f"output '{spec.name}' is declared as the input '{spec.alias_of}' written in place: write the "
                        f"result into '{spec.alias_of}' itself (the buffer the kernel was given) and return "
                        f"'{spec.alias_of}', not {got}", False)
            continue
        if same is not None:
            how = "with the result written into it" if same in c.get("written_inputs", []) else "returned unchanged"
            return (f"output {k} is the input '{names[same]}' itself, {how}",
                    f"the kernel returned its input '{names[same]}' as output {k}; {allocate}", True)
        if view is not None:
            return (f"output '{spec.name}' is a view of the input '{names[view]}' (it shares the input's memory; "
                    f"no data was moved into an output)",
                    f"output {k} ('{spec.name}') is a view of the kernel's input '{names[view]}' (for example "
                    f"{names[view]}.ap(...) or a reshape), not a tensor the kernel allocated and wrote; {allocate}",
                    True)
        if other is not None:
            return (f"output '{spec.name}' shares its memory with output '{task.outputs[other].name}'",
                    f"outputs {other} and {k} are the same tensor (or views of one); every output needs its own "
                    f"tensor: {allocate}", False)
    return None
