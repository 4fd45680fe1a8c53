"""``fusegraph llm-eval``: score a model behind any OpenAI-compatible endpoint on the fixed problem set.

Why through the writer: the benchmark must measure what the compile pipeline would get from the model — the
same prompt, the same untrusted-code harness, the same repair loop — so each problem is one
:func:`~fusegraph.llm.writer.write_with_config` call with the requested number of repair rounds and **no
kernel cache** (an accepted kernel from an earlier run must never be scored again). ``--rounds 0`` measures
the model alone, as the seed did.

Per problem: valid NKI (some answer parsed, was allow-listed and conformant, ran and computed with NKI:
:func:`fusegraph.llm.outcome.is_valid`), correct (an answer matched the reference on every case), repair
rounds used, tokens (the endpoint's ``usage``; 0 when it sends none) and the *modeled* speedup of the accepted
kernel over the per-op baseline of the same reference (:mod:`.speed`). Totals: counts, sums, and the geometric
mean of the modeled speedups of the correct problems.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from . import outcome
from .evalset import EVALSET_VERSION, Problem, select
from .speed import Speed, modeled_speedup
from .task import KernelTask
from .writer import WriterConfig, WriterResult, write_with_config

log = logging.getLogger(__name__)


@dataclass
class ProblemResult:
    """One problem's outcome (``attempts`` are the writer's per-answer report dicts)."""

    problem: str
    lnc: int
    valid: bool
    correct: bool
    first_valid: bool
    first_correct: bool
    stage: str  # the last answer's stage (accepted, compare, safety, ..., endpoint)
    reached: str  # the best level any answer reached (outcome.LEVELS), "" when no answer came back
    requests: int
    repair_rounds: int
    tokens: int
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    reason: str
    speed: Speed = field(default_factory=Speed)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    experience: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("problem", "lnc", "valid", "correct", "first_valid", "first_correct",
                                            "stage", "reached", "requests", "repair_rounds", "tokens",
                                            "prompt_tokens", "completion_tokens", "seconds", "reason")}
        d.update(self.speed.to_dict())
        d["attempts"] = self.attempts
        if self.experience:
            d["experience"] = self.experience
        return d


@dataclass
class EvalReport:
    model: str
    url: str
    rounds: int
    target: str
    results: list[ProblemResult]
    version: str = EVALSET_VERSION
    seconds: float = 0.0

    def totals(self) -> dict[str, Any]:
        rs = self.results
        speeds = [r.speed.speedup for r in rs if r.correct and r.speed.speedup]
        geo = math.exp(sum(math.log(s) for s in speeds) / len(speeds)) if speeds else None
        return {"problems": len(rs), "valid": sum(r.valid for r in rs), "correct": sum(r.correct for r in rs),
                "first_try_valid": sum(r.first_valid for r in rs),
                "first_try_correct": sum(r.first_correct for r in rs),
                "endpoint_errors": sum(r.stage == "endpoint" for r in rs), "requests": sum(r.requests for r in rs),
                "repair_rounds": sum(r.repair_rounds for r in rs), "tokens": sum(r.tokens for r in rs),
                "prompt_tokens": sum(r.prompt_tokens for r in rs),
                "completion_tokens": sum(r.completion_tokens for r in rs),
                "modeled_speedup_geomean": None if geo is None else round(geo, 3), "modeled_speedups": len(speeds)}

    def to_dict(self) -> dict[str, Any]:
        return {"evalset_version": self.version, "model": self.model, "url": self.url, "rounds": self.rounds,
                "target": self.target, "seconds": round(self.seconds, 2), "totals": self.totals(),
                "problems": [r.to_dict() for r in self.results],
                "speedup_note": "modeled on fusegraph's cost model: the accepted kernel's verification profile vs "
                                "the per-op (XLA-style) baseline of the reference; not a measurement"}

    def format(self) -> str:
        """A text table: one row per problem and a total row."""
        def yn(b: bool) -> str:
            return "yes" if b else "no"

        head = (f"fusegraph llm-eval v{self.version}: {self.model} at {self.url}, {self.rounds} repair round(s), "
                f"target {self.target}")
        rows = [("problem", "valid", "correct", "repairs", "tokens", "last stage", "modeled speedup")]
        for r in self.results:
            sp = r.speed.speedup
            rows.append((r.problem, yn(r.valid), yn(r.correct), str(r.repair_rounds), str(r.tokens), r.stage,
                         f"{sp:.2f}x" if sp else "-"))
        t = self.totals()
        geo = t["modeled_speedup_geomean"]
        rows.append((f"total ({t['problems']})", f"{t['valid']}/{t['problems']}", f"{t['correct']}/{t['problems']}",
                     str(t["repair_rounds"]), str(t["tokens"]), f"{t['endpoint_errors']} endpoint error(s)",
                     f"{geo:.2f}x geomean" if geo else "-"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [head]
        for i, row in enumerate(rows):
            if i == len(rows) - 1:
                lines.append("  ".join("-" * w for w in widths))
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        lines.append(f"first try: {t['first_try_valid']} valid, {t['first_try_correct']} correct; speedups are "
                     f"modeled (cost model vs per-op baseline), not measured")
        return "\n".join(lines)


def score(problem: Problem, task: KernelTask, result: WriterResult, target: str = "trn2") -> ProblemResult:
    """Turn one writer result into the problem's row (computing the modeled speedup of an accepted kernel)."""
    atts = result.attempts
    answered = [a for a in atts if a.stage != "endpoint"]
    levels = [outcome.level_of(a.to_dict()) for a in answered]
    best = max((outcome.LEVELS.index(lv) for lv in levels if lv is not None), default=None)
    speed = Speed()
    if result.accepted and result.kernel_source:
        speed = modeled_speedup(task, result.kernel_source, result.kernel_name, result.profile, target)
    first = atts[0] if atts else None
    return ProblemResult(
        problem=problem.name, lnc=problem.lnc, valid=any(outcome.is_valid_level(lv) for lv in levels),
        correct=result.accepted,
        first_valid=bool(first and first.stage != "endpoint" and outcome.is_valid_level(levels[0])),
        first_correct=bool(first and first.accepted), stage=atts[-1].stage if atts else "",
        reached=outcome.LEVELS[best] if best is not None else "", requests=len(atts),
        repair_rounds=max(0, len(atts) - 1), tokens=result.tokens,
        prompt_tokens=sum(a.prompt_tokens for a in atts), completion_tokens=sum(a.completion_tokens for a in atts),
        seconds=round(sum(a.seconds for a in atts), 3), reason=result.reason, speed=speed,
        attempts=[a.to_dict() for a in atts], experience=result.experience_path)


def evaluate(url: str, model: str, *, rounds: int = 2, problems: list[str] | None = None, target: str = "trn2",
             timeout_s: float = 120.0, max_tokens: int = 4096, run_timeout_s: float = 60.0,
             run_memory_mb: int = 4096, experience_dir: str = "",
             progress: Callable[[ProblemResult], None] | None = None) -> EvalReport:
    """Run the (selected) problems against ``url``/``model``; ``experience_dir`` also records every conversation.

    Raises ``KeyError`` for unknown problem names; everything a model or endpoint does is a result, not an error.
    """
    chosen = select(problems)
    cfg = WriterConfig(url=url, model=model, max_rounds=max(0, int(rounds)), timeout_s=timeout_s,
                       max_tokens=max_tokens, run_timeout_s=run_timeout_s, run_memory_mb=run_memory_mb, cache_dir="",
                       target=target, use_cache=False, record_experience=bool(experience_dir),
                       experience_dir=experience_dir, origin=f"llm-eval v{EVALSET_VERSION}")
    t0 = time.perf_counter()
    results = []
    for p in chosen:
        task = p.task()
        pcfg = replace(cfg, benchmark={"evalset_version": EVALSET_VERSION, "problem": p.name})
        res = score(p, task, write_with_config(task, pcfg), target)
        log.info("llm-eval %s: %s (%s)", p.name, "correct" if res.correct else res.stage, res.reason)
        results.append(res)
        if progress is not None:
            progress(res)
    return EvalReport(model=model, url=url, rounds=cfg.max_rounds, target=target, results=results,
                      seconds=time.perf_counter() - t0)
