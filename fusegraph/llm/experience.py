"""Experience records: every conversation the writer had with a model, as the harness judged it.

Why: the writer's repair loop produces exactly the data an NKI-writing model learns from best — a failing
answer, the concrete error the harness sent back, and the corrected kernel that then passed — plus a verdict
for every answer (a reward signal). :func:`record` keeps one JSON file per :func:`~fusegraph.llm.writer.write_kernel`
call that asked the model anything; ``fusegraph export-sft --experience DIR`` turns them into repair
trajectories and reward records (:mod:`.sft`). The writer records into ``<llm_cache_dir>/experience`` (the
default cache's when the option is empty); ``fusegraph llm-eval --experience DIR`` records its runs too.

A record (``format`` :data:`FORMAT`) is self-contained: the task (reference source, tensor specs with constants
inline, cases, LNC), the exact messages of the first request, and per answer its full text, the extracted
code, the stage/reason/detail of its verdict and the repair message sent back after it (``feedback``; empty
when none was sent). The request of round *k* > 1 is the first request plus answer *k-1* and its feedback.

Trust: like the kernel cache, the directory is trusted like code — :func:`task_from_json` executes the
recorded reference source (fusegraph wrote it; it is the region's torch code, never model output). Model
answers in it are only ever handed to the harness.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from .task import KernelTask, TensorSpec

log = logging.getLogger(__name__)

FORMAT = "fusegraph-llm-experience/1"
MAX_FIXED_ELEMENTS = 1 << 16  # constants larger than this are not recorded (the record is then not re-runnable)


def default_dir(cache_dir: str = "") -> Path:
    """Where the writer records: ``<cache_dir>/experience`` (the default kernel cache's when empty)."""
    from .cache import default_dir as cache_default

    return (Path(cache_dir) if cache_dir else cache_default()) / "experience"


# ---- tasks as JSON --------------------------------------------------------------------------------------------
def spec_to_json(s: TensorSpec) -> dict[str, Any]:
    from .examples import spec_to_json as base

    d = base(s)
    if s.fixed is not None:
        t = s.fixed.detach().to("cpu")
        if t.numel() > MAX_FIXED_ELEMENTS:
            raise ValueError(f"constant input {s.name!r} has {t.numel()} elements (limit {MAX_FIXED_ELEMENTS})")
        d["fixed_values"] = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                             "values": t.double().flatten().tolist()}
    return d


def spec_from_json(d: dict[str, Any]) -> TensorSpec:
    from .examples import spec_from_json as base

    spec = base({k: v for k, v in d.items() if k != "fixed_values"})
    fv = d.get("fixed_values")
    if fv:
        t = torch.tensor(fv["values"], dtype=torch.float64).reshape(fv["shape"]).to(getattr(torch, fv["dtype"]))
        spec = replace(spec, fixed=t)
    return spec


def task_to_json(task: KernelTask) -> dict[str, Any]:
    return {"name": task.name, "reference_source": task.reference_source, "model": task.model,
            "context": task.context, "structure": task.structure, "cases": list(task.cases),
            "data_movement_only": task.data_movement_only, "lnc": getattr(task, "lnc", 1),
            "inputs": [spec_to_json(s) for s in task.inputs], "outputs": [spec_to_json(s) for s in task.outputs]}


def load_reference(source: str, name: str) -> Callable[..., Any]:
    """Execute recorded reference text (trusted, see the module docstring): ``reference``, else ``name``."""
    ns: dict[str, Any] = {}
    exec(compile(source, "<fusegraph recorded reference>", "exec"), ns)  # noqa: S102 - fusegraph's own text
    fn = ns.get("reference") or ns.get(name)
    if not callable(fn):
        raise ValueError(f"the recorded reference defines neither 'reference' nor {name!r}")
    return fn


def task_from_json(d: dict[str, Any]) -> KernelTask:
    return KernelTask(name=d["name"], reference_source=d["reference_source"],
                      reference=load_reference(d["reference_source"], d["name"]),
                      inputs=[spec_from_json(s) for s in d["inputs"]],
                      outputs=[spec_from_json(s) for s in d["outputs"]],
                      model=d.get("model", ""), context=d.get("context", ""), structure=d.get("structure", ""),
                      cases=tuple(d.get("cases") or ()), data_movement_only=bool(d.get("data_movement_only")),
                      lnc=int(d.get("lnc", 1)))


# ---- records --------------------------------------------------------------------------------------------------
def record(directory: str | os.PathLike, task: KernelTask, messages: list[dict[str, str]], attempts: list[Any],
           *, accepted: bool, llm_model: str, prompt_version: str, target: str, cache_key: str = "",
           origin: str = "compile", benchmark: dict[str, str] | None = None) -> Path | None:
    """Write one experience record atomically; a failure is logged, never raised (recording is best effort).

    ``benchmark`` (``llm-eval``: evalset version and problem) marks the record's provenance: ``source`` is
    ``"llm-eval"`` and the problem is named, so an export can keep the benchmark out of training data.
    """
    try:
        task_json = task_to_json(task)
    except ValueError as e:
        log.info("not recording the LLM conversation for %s: %s", task.name, e)
        return None
    rec = {"format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "origin": origin,
           "source": "llm-eval" if benchmark else "compile", "benchmark": dict(benchmark) if benchmark else None,
           "llm_model": llm_model, "prompt_version": prompt_version, "target": target, "cache_key": cache_key,
           "accepted": bool(accepted), "task": task_json, "messages": messages,
           "attempts": [a.experience() if hasattr(a, "experience") else dict(a) for a in attempts]}
    root = Path(directory)
    ns = time.time_ns()  # names sort in recording order (load() relies on it)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(ns // 1_000_000_000)) + f".{ns % 1_000_000_000:09d}"
    name = f"{stamp}-{task.kernel_name[:40]}-{uuid.uuid4().hex[:8]}.json"
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(rec, f, ensure_ascii=False)
        os.replace(tmp, root / name)
        return root / name
    except OSError as e:
        log.warning("could not record the LLM conversation for %s in %s: %s", task.name, root, e)
        return None


def load(directory: str | os.PathLike) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every readable record of ``directory`` in name (= time) order; unreadable or foreign files are skipped."""
    root = Path(directory)
    for p in sorted(root.glob("*.json")) if root.is_dir() else []:
        try:
            data = json.loads(p.read_text("utf-8"))
        except (OSError, ValueError) as e:
            log.warning("skipping unreadable experience record %s: %s", p, e)
            continue
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            log.warning("skipping %s: not a %s record", p, FORMAT)
            continue
        yield p, data


def provenance(rec: dict[str, Any]) -> dict[str, Any]:
    """``{"source": "llm-eval" | "compile", "benchmark": {...} | None}`` of a record (older records: from
    ``origin``, which ``llm-eval`` sets to ``"llm-eval v<version>"``)."""
    bench = rec.get("benchmark")
    origin = str(rec.get("origin", ""))
    is_eval = rec.get("source") == "llm-eval" or bool(bench) or origin.startswith("llm-eval")
    if is_eval and not isinstance(bench, dict):
        bench = {"evalset_version": origin.split(" v", 1)[1] if " v" in origin else "",
                 "problem": str((rec.get("task") or {}).get("name", ""))}
    return {"source": "llm-eval" if is_eval else "compile", "benchmark": bench if is_eval else None}


def is_benchmark(rec: dict[str, Any]) -> bool:
    """Whether a record answers a benchmark problem (``llm-eval``): held-out data, not training data."""
    return provenance(rec)["source"] == "llm-eval"


def request_messages(rec: dict[str, Any], index: int) -> list[dict[str, str]]:
    """The messages of the request that produced answer ``index`` (0-based) of a record."""
    msgs = list(rec["messages"])
    if index == 0:
        return msgs
    prev = rec["attempts"][index - 1]
    return msgs + [{"role": "assistant", "content": prev.get("answer", "")},
                   {"role": "user", "content": prev.get("feedback", "")}]
