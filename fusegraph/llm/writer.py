"""The writer loop: prompt -> answer -> extract -> verify -> (repair) -> accept and cache, or give up cleanly.

:func:`write_kernel` is what the compile pipeline calls for a region nothing else lowers. It never raises: every
outcome, including a disabled option, an unreachable endpoint or a bug in the caller's reference, comes back
as a :class:`WriterResult` with a one-line ``reason`` and one :class:`Attempt` per model answer (accepted or
why rejected, tokens from the endpoint's ``usage``, seconds), which is what the fused-region report records.

Repair rounds keep the conversation short: system, few-shot examples, the task, the *last* rejected answer
and its concrete error (not every earlier round), so the prompt does not grow with the number of rounds.

Every call that asked the model anything is also kept as an experience record (:mod:`.experience`): each
answer, the error sent back and the corrected kernel, for ``fusegraph export-sft --experience``.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from . import outcome
from .cache import KernelCache, cache_key
from .client import ChatClient
from .experience import default_dir, record
from .extract import extract_code
from .harness import Limits, static_checks, verify
from .prompt import NO_CODE_DETAIL, PROMPT_VERSION, build_messages, repair_message
from .task import KernelTask

log = logging.getLogger(__name__)

API_KEY_ENV = "FUSEGRAPH_LLM_API_KEY"
"""Bearer token for endpoints that need one. Read from the environment only, so it never lands in settings,
reports or logs."""


@dataclass
class Attempt:
    """One model answer and what became of it."""

    round: int  # 1 = first answer, 2.. = repair rounds
    accepted: bool
    reason: str  # one line: why rejected, or how it was verified
    stage: str = ""  # endpoint | extract | parse | safety | conformance | contract | reference | run | computes | compare | accepted
    tokens: int = 0  # total tokens of the request (usage.total_tokens)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0  # request + verification
    max_abs_diff: float | None = None
    level: str = ""  # how close the answer came (fusegraph.llm.outcome.LEVELS; "" for endpoint/reference failures)
    # what the experience record keeps (not the report: sources stay out of it)
    answer: str = ""  # the model's full reply
    code: str | None = None  # the kernel extracted from it (None: no code block)
    detail: str = ""  # the concrete error of the verdict
    feedback: str = ""  # the repair message sent back after this answer ("" when none was sent)

    REPORT_FIELDS = ("round", "accepted", "reason", "stage", "tokens", "prompt_tokens", "completion_tokens",
                     "seconds", "max_abs_diff", "level")

    def to_dict(self) -> dict[str, Any]:
        """For the fused-region report (the answer texts are in the experience record, not here)."""
        d = asdict(self)
        return {k: d[k] for k in self.REPORT_FIELDS}

    def experience(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class WriterResult:
    kernel_source: str | None
    accepted: bool
    attempts: list[Attempt] = field(default_factory=list)
    from_cache: bool = False
    reason: str = ""
    kernel_name: str = ""  # the @nki.jit function in kernel_source
    cache_key: str = ""
    profile: dict[str, Any] | None = field(default=None, repr=False)  # cost profile of the accepted kernel's run
    experience_path: str = ""  # the experience record written for this call ("" when none)
    #: SHA-256 of ``kernel_source`` at the moment it passed verification (or the cache's static checks): what
    #: inlining it into a megakernel re-hashes against (``patterns/llm_island/lowering.py``)
    sha256: str = ""

    @property
    def rounds(self) -> int:
        return len(self.attempts)

    @property
    def tokens(self) -> int:
        return sum(a.tokens for a in self.attempts)

    def to_dict(self) -> dict[str, Any]:
        """For the fused-region report (the kernel source itself is left out; it is in the cache)."""
        return {"accepted": self.accepted, "from_cache": self.from_cache, "reason": self.reason,
                "rounds": self.rounds, "tokens": self.tokens, "kernel_name": self.kernel_name,
                "cache_key": self.cache_key, "attempts": [a.to_dict() for a in self.attempts]}


@dataclass(frozen=True)
class WriterConfig:
    url: str
    model: str
    max_rounds: int
    timeout_s: float
    max_tokens: int
    run_timeout_s: float
    run_memory_mb: int
    cache_dir: str
    target: str
    use_cache: bool = True  # False: neither read nor write accepted kernels (an evaluation must not reuse them)
    record_experience: bool = True
    experience_dir: str = ""  # "" -> <cache dir>/experience
    origin: str = "compile"  # who asked (recorded with the experience)
    #: set by ``llm-eval``: the benchmark problem this call answers ({"evalset_version", "problem"}); recorded as
    #: provenance so ``export-sft`` keeps benchmark conversations out of training data by default
    benchmark: dict[str, str] | None = None

    @classmethod
    def from_settings(cls, settings: Any) -> "WriterConfig":
        return cls(url=settings.llm_url, model=settings.llm_model, max_rounds=max(0, int(settings.llm_max_rounds)),
                   timeout_s=float(settings.llm_timeout_s), max_tokens=int(settings.llm_max_tokens),
                   run_timeout_s=float(settings.llm_run_timeout_s), run_memory_mb=int(settings.llm_run_memory_mb),
                   cache_dir=settings.llm_cache_dir, target=settings.target,
                   record_experience=bool(settings.llm_experience))

    def problem(self) -> str:
        if not self.url and not self.model:
            return "the LLM kernel writer is off (set llm_url and llm_model, or FUSEGRAPH_LLM_URL/FUSEGRAPH_LLM_MODEL)"
        if not self.url:
            return "llm_model is set but llm_url is not"
        if not self.model:
            return "llm_url is set but llm_model is not"
        return ""


def source_sha256(source: str) -> str:
    """The hash a verified kernel text is recorded under (and re-checked against before it is inlined)."""
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def enabled(settings: Any) -> bool:
    """Whether the settings turn the writer on (both an endpoint and a model)."""
    return not WriterConfig.from_settings(settings).problem()


def write_kernel(task: KernelTask, settings: Any) -> WriterResult:
    """Ask the configured model for a kernel for ``task``; return it only if it passes verification. Never raises."""
    return write_with_config(task, WriterConfig.from_settings(settings))


def write_with_config(task: KernelTask, cfg: WriterConfig) -> WriterResult:
    """:func:`write_kernel` with an explicit configuration (``llm-eval``: no cache, its own rounds). Never raises."""
    try:
        return _write(task, cfg)
    except Exception as e:  # noqa: BLE001 - a writer bug must not break a compile; it is reported instead
        log.exception("LLM kernel writer failed on %s", getattr(task, "name", "?"))
        return WriterResult(None, False, reason=f"internal error in the LLM kernel writer: {type(e).__name__}: {e}")


def _write(task: KernelTask, cfg: WriterConfig) -> WriterResult:
    """The writer loop behind :func:`write_with_config` (which turns any exception into a result): refuse a
    disabled writer or an invalid task, reuse a cached kernel that still passes the static checks, else ask."""
    off = cfg.problem()
    if off:
        return WriterResult(None, False, reason=off)
    problems = task.problems()
    if problems:
        return WriterResult(None, False, reason="invalid kernel task: " + "; ".join(problems))
    cache = KernelCache(cfg.cache_dir or None)
    key = cache_key(task, cfg.model, PROMPT_VERSION, cfg.target)
    cached = _from_cache(task, cfg, cache, key) if cfg.use_cache else None
    if cached is not None:
        return cached
    return _Conversation(task, cfg, cache, key).run()


def _from_cache(task: KernelTask, cfg: WriterConfig, cache: KernelCache, key: str) -> WriterResult | None:
    """The cached kernel for ``key`` when there is one and it still passes the static checks (the allow-list or
    contract may have tightened since it was stored); a failing entry is discarded so the model is asked again."""
    entry = cache.load(key)
    if entry is None:
        return None
    info, bad = static_checks(entry.source, task)
    if bad is None and info is not None:
        log.info("LLM kernel for %s reused from cache %s", task.name, key[:12])
        return WriterResult(entry.source, True, from_cache=True, kernel_name=info.name, cache_key=key,
                            reason=f"reused cached kernel {key[:12]} (written by {cfg.model})",
                            sha256=source_sha256(entry.source))
    log.warning("cached LLM kernel %s for %s fails the static checks (%s); asking again", key[:12], task.name,
                bad.reason if bad else "?")
    cache.discard(key)
    return None


class _Conversation:
    """The rounds with the model for one task: ask, verify the answer, and either accept it (cached) or send
    the concrete error back, until the rounds run out or asking again cannot help; every answer is an
    :class:`Attempt`, and the whole exchange is recorded as experience."""

    def __init__(self, task: KernelTask, cfg: WriterConfig, cache: KernelCache, key: str) -> None:
        self.task = task
        self.cfg = cfg
        self.cache = cache
        self.key = key
        self.client = ChatClient(cfg.url, cfg.model, timeout_s=cfg.timeout_s, max_tokens=cfg.max_tokens,
                                 api_key=os.environ.get(API_KEY_ENV, ""))
        self.limits = Limits(timeout_s=cfg.run_timeout_s, memory_mb=cfg.run_memory_mb)
        self.base = build_messages(task)
        self.messages = list(self.base)
        self.attempts: list[Attempt] = []

    def run(self) -> WriterResult:
        """Up to ``max_rounds + 1`` answers. An endpoint error or a broken reference ends the loop at once:
        neither is something the model can repair."""
        cfg, task = self.cfg, self.task
        for rnd in range(1, cfg.max_rounds + 2):
            t0 = time.perf_counter()
            reply = self.client.chat(self.messages)
            usage = reply.usage
            common = dict(round=rnd, tokens=usage.total_tokens, prompt_tokens=usage.prompt_tokens,
                          completion_tokens=usage.completion_tokens)
            if not reply.ok:
                self.attempts.append(Attempt(accepted=False, stage="endpoint", reason=reply.error,
                                             seconds=round(time.perf_counter() - t0, 3), **common))
                log.warning("LLM endpoint error for %s: %s", task.name, reply.error)
                break  # an endpoint problem is not something the model can repair
            att, verdict = self.judge(reply.text, t0, common)
            self.attempts.append(att)
            log.info("LLM kernel %s round %d: %s (%s)", task.name, rnd, "accepted" if att.accepted else "rejected",
                     att.reason)
            if att.accepted and att.code is not None:
                return self.finish(self.accept(att.code, rnd, verdict))
            if att.stage == "reference":
                break  # the caller's reference is broken: asking the model again cannot help
            if rnd == cfg.max_rounds + 1:
                break
            att.feedback = repair_message(att.stage, att.detail)
            self.messages = self.base + [{"role": "assistant", "content": reply.text},
                                         {"role": "user", "content": att.feedback}]
        return self.finish(self.give_up())

    def judge(self, text: str, t0: float, common: dict[str, Any]) -> tuple[Attempt, Any]:
        """The attempt for one answer ``text`` (started at ``t0``): its kernel extracted and verified, the stage
        it reached, how close it came; also the harness verdict (None when the answer holds no code)."""
        code = extract_code(text)
        if code is None:
            stage, reason, detail, verdict = "extract", NO_CODE_DETAIL, NO_CODE_DETAIL, None
        else:
            verdict = verify(code, self.task, target=self.cfg.target, limits=self.limits)
            stage, reason, detail = verdict.stage, verdict.reason, verdict.detail
        level = outcome.reached(stage, verdict.cheat, verdict.close) if verdict is not None else outcome.reached(stage)
        att = Attempt(accepted=verdict is not None and verdict.ok, stage=stage, reason=reason,
                      seconds=round(time.perf_counter() - t0, 3), level=level or "",
                      max_abs_diff=verdict.max_abs_diff if verdict is not None else None,
                      answer=text, code=code, detail=detail, **common)
        return att, verdict

    def accept(self, code: str, rnd: int, verdict: Any) -> WriterResult:
        """The result for a verified kernel (stored in the cache unless caching is off), hashed as verified."""
        cfg, attempts = self.cfg, self.attempts
        info, _ = static_checks(code, self.task)
        if cfg.use_cache:
            self.cache.store(self.key, code, {"task": self.task.name, "llm_model": cfg.model,
                                              "prompt_version": PROMPT_VERSION, "target": cfg.target, "rounds": rnd,
                                              "tokens": sum(a.tokens for a in attempts)})
        return WriterResult(code, True, attempts, kernel_name=info.name if info else "", cache_key=self.key,
                            reason=f"accepted in round {rnd} of {cfg.max_rounds + 1} "
                                   f"({sum(a.tokens for a in attempts)} tokens)",
                            profile=verdict.profile if verdict is not None else None,
                            sha256=source_sha256(code))

    def give_up(self) -> WriterResult:
        """The result when no answer was accepted, saying why from the last attempt."""
        attempts = self.attempts
        last = attempts[-1] if attempts else None
        why = last.reason if last else "no attempt was made"
        if last is not None and last.stage == "endpoint":
            reason = f"LLM endpoint unavailable: {why}"
        else:
            reason = f"no verified kernel after {len(attempts)} round(s); last: {why}"
        return WriterResult(None, False, attempts, cache_key=self.key, reason=reason[:400])

    def finish(self, result: WriterResult) -> WriterResult:
        """Record the exchange as experience (when on, and when the model answered at all) and return
        ``result`` with the record's path."""
        cfg = self.cfg
        if cfg.record_experience and any(a.stage != "endpoint" for a in self.attempts):
            path = record(cfg.experience_dir or default_dir(cfg.cache_dir), self.task, self.base, self.attempts,
                          accepted=result.accepted, llm_model=cfg.model, prompt_version=PROMPT_VERSION,
                          target=cfg.target, cache_key=self.key, origin=cfg.origin, benchmark=cfg.benchmark)
            result.experience_path = str(path) if path else ""
        return result
