"""Experience records -> training data: repair trajectories (SFT) and per-answer reward records (RL/preference).

``fusegraph export-sft OUT.jsonl --experience DIR`` calls :func:`export_experience`, which writes next to
``OUT.jsonl``:

* ``OUT.trajectories.jsonl`` — one chat record per repair that worked: the writer's first request (system,
  few-shot turns, task), the failing answer, the concrete error the harness sent back, and the corrected kernel
  that passed. Every assistant turn but the last carries ``"weight": 0`` (OpenAI's fine-tuning format; other
  stacks: train on the last assistant turn only), so a model learns the repair, never the failing answer.
  ``OUT.trajectories.meta.jsonl`` (same line order) holds the task (to rebuild and re-run it), the failed
  stage and reason, and where it came from.
* ``OUT.rewards.jsonl`` — one record per model answer: the request's ``messages``, the ``completion``, its
  ``stage`` and ``level`` (:mod:`.outcome`), ``valid``, ``correct``, the modeled ``speedup`` of a correct
  kernel over the per-op baseline (:mod:`.speed`), a scalar ``reward`` in [0, 1] and ``prompt_id`` (answers
  with the same prompt_id answered the same request: the pairs for preference training).

Provenance: every meta line and reward record carries ``source`` (``"compile"`` or ``"llm-eval"``) and
``benchmark`` (the evalset version and problem, or null). Records of ``llm-eval`` runs answer the held-out
benchmark problems, so they are **left out by default** (``include_benchmark=True``, ``export-sft
--include-benchmark``, includes them, still marked): training on them would train on the test set.

Nothing is written on trust: before a trajectory is written its corrected kernel passes the harness again and
its failing answer fails again at the recorded stage; a correct answer's reward record comes from a fresh
verification (which also yields the profile for the speedup). Records that do not reproduce are skipped and
listed. :func:`reverify_trajectories` repeats both checks on an exported file.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import outcome
from .experience import is_benchmark, load, provenance, request_messages, task_from_json
from .extract import extract_code
from .harness import Limits, Verdict, static_checks, verify
from .task import KernelTask

log = logging.getLogger(__name__)


def _sibling(out: str | Path, suffix: str) -> Path:
    p = Path(out)
    stem = p.name[: -len(".jsonl")] if p.name.endswith(".jsonl") else p.name
    return p.with_name(stem + suffix)


def trajectories_path(out: str | Path) -> Path:
    return _sibling(out, ".trajectories.jsonl")


def trajectories_meta_path(out: str | Path) -> Path:
    return _sibling(out, ".trajectories.meta.jsonl")


def rewards_path(out: str | Path) -> Path:
    return _sibling(out, ".rewards.jsonl")


@dataclass
class ExperienceStats:
    records: int = 0
    trajectories: int = 0
    rewards: int = 0
    benchmark_excluded: int = 0  # llm-eval records left out (include_benchmark=False)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        text = (f"{self.trajectories} repair trajectory record(s) and {self.rewards} reward record(s) from "
                f"{self.records} experience record(s)")
        if self.benchmark_excluded:
            text += (f"; {self.benchmark_excluded} llm-eval (benchmark) record(s) left out (--include-benchmark "
                     f"includes them)")
        if self.skipped:
            text += f"; skipped {len(self.skipped)}: " + "; ".join(f"{n} ({r})" for n, r in self.skipped[:10])
        return text


def _weighted(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant turns get ``weight`` 0, except the last one (the training target)."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return [dict(m, weight=int(i == last)) if m["role"] == "assistant" else dict(m) for i, m in enumerate(messages)]


def prompt_id(messages: list[dict[str, Any]]) -> str:
    text = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _stage_of(answer: str, task: KernelTask, target: str, limits: Limits, seed: int) -> tuple[str, Verdict | None]:
    code = extract_code(answer)
    if code is None:
        return "extract", None
    v = verify(code, task, target=target, limits=limits, seed=seed)
    return v.stage, v


def repair_index(rec: dict[str, Any]) -> int | None:
    """Index of the failing answer of the record's successful repair (the one before the accepted answer)."""
    atts = rec.get("attempts") or []
    if not rec.get("accepted") or len(atts) < 2 or not atts[-1].get("accepted"):
        return None
    prev = atts[-2]
    if prev.get("stage") in ("endpoint", "reference") or not prev.get("feedback"):
        return None
    return len(atts) - 2


def export_experience(directory: str | Path, out: str | Path, *, limits: Limits = Limits(), seed: int = 0,
                      speedups: bool = True, include_benchmark: bool = False) -> ExperienceStats:
    """Write the trajectories and rewards files for ``out`` from the records in ``directory`` (see above).

    ``include_benchmark``: also export ``llm-eval`` records (left out by default: they are the test set)."""
    from .speed import modeled_speedup

    stats = ExperienceStats()
    out_t, out_m, out_r = trajectories_path(out), trajectories_meta_path(out), rewards_path(out)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out_t, "w", encoding="utf-8") as ft, open(out_m, "w", encoding="utf-8") as fm, \
            open(out_r, "w", encoding="utf-8") as fr:
        for path, rec in load(directory):
            stats.records += 1
            if not include_benchmark and is_benchmark(rec):
                stats.benchmark_excluded += 1
                continue
            try:
                task = task_from_json(rec["task"])
            except Exception as e:  # noqa: BLE001 - a record we cannot rebuild is skipped, not fatal
                stats.skipped.append((path.name, f"task not rebuildable: {type(e).__name__}: {e}"))
                continue
            target = rec.get("target", "trn2")
            atts = rec.get("attempts") or []
            fresh: dict[int, Verdict] = {}
            for i, a in enumerate(atts):
                if a.get("accepted"):
                    v = verify(a.get("code") or "", task, target=target, limits=limits, seed=seed)
                    if not v.ok:
                        stats.skipped.append((path.name, f"the accepted answer of round {a.get('round')} no longer "
                                                         f"passes: {v.reason}"))
                        break
                    fresh[i] = v
            else:
                stats.trajectories += _write_trajectory(path.name, rec, task, fresh, ft, fm, stats, limits, seed)
                stats.rewards += _write_rewards(path.name, rec, task, fresh, fr, speedups and modeled_speedup)
    return stats


def _write_trajectory(name: str, rec: dict[str, Any], task: KernelTask, fresh: dict[int, Verdict], ft: Any, fm: Any,
                      stats: ExperienceStats, limits: Limits, seed: int) -> int:
    i = repair_index(rec)
    if i is None or (i + 1) not in fresh:
        return 0
    atts = rec["attempts"]
    failed, fixed = atts[i], atts[i + 1]
    stage, _ = _stage_of(failed.get("answer", ""), task, rec.get("target", "trn2"), limits, seed)
    if stage != failed.get("stage"):
        stats.skipped.append((name, f"the failing answer now stops at {stage}, recorded {failed.get('stage')}"))
        return 0
    messages = request_messages(rec, i + 1) + [{"role": "assistant", "content": fixed.get("answer", "")}]
    ft.write(json.dumps({"messages": _weighted(messages)}, ensure_ascii=False) + "\n")
    fm.write(json.dumps({"kind": "repair", "experience": name, "llm_model": rec.get("llm_model", ""),
                         "prompt_version": rec.get("prompt_version", ""), "target": rec.get("target", "trn2"),
                         "failed_round": failed.get("round"), "failed_stage": failed.get("stage"),
                         "failed_reason": failed.get("reason", ""), "fixed_round": fixed.get("round"),
                         **provenance(rec), "task": rec["task"]}, ensure_ascii=False) + "\n")
    return 1


def _write_rewards(name: str, rec: dict[str, Any], task: KernelTask, fresh: dict[int, Verdict], fr: Any,
                   speed_fn: Any) -> int:
    n = 0
    for i, a in enumerate(rec.get("attempts") or []):
        stage = a.get("stage", "")
        level = outcome.level_of(a)
        if stage == "endpoint" or level is None:
            continue  # no answer, or the task's own failure: nothing to reward
        messages = request_messages(rec, i)
        speedup = note = None
        if i in fresh and speed_fn:
            info, _ = static_checks(a["code"], task)
            sp = speed_fn(task, a["code"], info.name if info else "", fresh[i].profile, rec.get("target", "trn2"))
            speedup, note = sp.speedup, sp.note or None
        fr.write(json.dumps({
            "messages": messages, "completion": a.get("answer", ""), "prompt_id": prompt_id(messages),
            "task": task.name, "round": a.get("round"), "stage": stage, "level": level,
            "valid": outcome.is_valid_level(level), "correct": outcome.is_correct(stage),
            "speedup": None if speedup is None else round(speedup, 4), "speedup_note": note,
            "reward": outcome.reward(level, speedup), "reason": a.get("reason", ""), "tokens": a.get("tokens", 0),
            "llm_model": rec.get("llm_model", ""), "prompt_version": rec.get("prompt_version", ""),
            "experience": name, **provenance(rec)}, ensure_ascii=False) + "\n")
        n += 1
    return n


@dataclass
class TrajectoryCheck:
    """Re-verification of one exported trajectory."""

    line: int
    fixed: Verdict
    failed_stage: str  # the stage the failing answer stops at now
    recorded_stage: str  # the stage recorded when the harness rejected it

    @property
    def ok(self) -> bool:
        return self.fixed.ok and self.failed_stage == self.recorded_stage


def reverify_trajectories(path: str | Path, *, limits: Limits = Limits(), seed: int = 0) -> list[TrajectoryCheck]:
    """Re-run the harness on every exported trajectory, from the file's own text plus its meta line."""
    out = []
    with open(path, encoding="utf-8") as f, open(trajectories_meta_path_for(path), encoding="utf-8") as side:
        for i, (line, mline) in enumerate(zip(f, side), start=1):
            msgs, meta = json.loads(line)["messages"], json.loads(mline)
            task = task_from_json(meta["task"])
            target = meta.get("target", "trn2")
            fixed_code = extract_code(msgs[-1]["content"])
            fixed = (verify(fixed_code, task, target=target, limits=limits, seed=seed) if fixed_code is not None
                     else Verdict.fail("extract", "no code block in the corrected answer"))
            stage, _ = _stage_of(msgs[-3]["content"], task, target, limits, seed)
            out.append(TrajectoryCheck(i, fixed, stage, meta.get("failed_stage", "")))
    return out


def trajectories_meta_path_for(path: str | Path) -> Path:
    """The meta side file of a trajectories file (``X.trajectories.jsonl`` -> ``X.trajectories.meta.jsonl``)."""
    p = Path(path)
    return p.with_name(p.name[: -len(".jsonl")] + ".meta.jsonl") if p.name.endswith(".jsonl") else \
        p.with_name(p.name + ".meta.jsonl")
