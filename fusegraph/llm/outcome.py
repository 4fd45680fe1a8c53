"""What a harness verdict means for scoring: the level an answer reached, validity, correctness, a reward.

One definition shared by ``fusegraph llm-eval`` (its valid/correct counts) and the reward records of
``fusegraph export-sft`` (so a training signal and the benchmark can never disagree about what "valid" is).
The harness stops at the first failing stage; the level is the last check the answer *passed*, except that an
answer which tried to pass without computing is a ``cheat`` whatever stage caught it. Levels are ordered by how
close a kernel came, worst first, and so are the rewards:

===============  ==============================  ======  ==================================================
level            reached when                    reward  meaning
===============  ==============================  ======  ==================================================
``cheat``        a verdict with ``cheat``        0.0     returns an input or a view of one, or computes
                 (stage contract or computes)            nothing: it would pass without doing the work
``none``         endpoint, extract               0.0     no kernel (no code block)
``code``         parse                           0.1     a code block that is not Python
``parse``        safety                          0.2     parses, but uses something outside the allow-list
``allow-list``   conformance                     0.3     allow-listed, but calls an API that does not exist
``conformance``  contract                        0.4     conformant, but breaks the kernel contract (arity,
                                                         several kernels, no return)
``contract``     run, computes (not a cheat)     0.5     fails in the interpreter (an NKI rule, a crash, the
                                                         time limit) or breaks the run-time contract (an
                                                         in-place output returned as a new tensor)
``computes``     compare                         0.6     **valid NKI**: runs and computes; numbers wrong
``close``        compare with ``close``          0.75    valid, wrong, but within 10x the tolerance everywhere
``correct``      accepted                        0.9-1   matches the reference on every case; more when faster
===============  ==============================  ======  ==================================================

A correct answer's reward is ``0.9 + 0.1 * s / (1 + s)`` for a modeled speedup ``s`` (0.95 at parity; 0.9
when no speedup could be modeled), so a faster correct kernel always outranks a slower one and every correct
kernel outranks every wrong one. A ``reference`` verdict is the task's fault, not the answer's: it has no level
(``None``).
"""
from __future__ import annotations

LEVELS: tuple[str, ...] = ("cheat", "none", "code", "parse", "allow-list", "conformance", "contract", "computes",
                           "close", "correct")
REWARDS: dict[str, float] = {"cheat": 0.0, "none": 0.0, "code": 0.1, "parse": 0.2, "allow-list": 0.3,
                             "conformance": 0.4, "contract": 0.5, "computes": 0.6, "close": 0.75, "correct": 0.9}
VALID_LEVELS = frozenset({"computes", "close", "correct"})
_STAGE_LEVEL = {
    "endpoint": "none", "extract": "none",
    "parse": "code",
    "safety": "parse",
    "conformance": "allow-list",
    "contract": "conformance",
    "run": "contract", "computes": "contract",
    "compare": "computes",
    "accepted": "correct",
}


def reached(stage: str, cheat: bool = False, close: bool = False) -> str | None:
    """The level of an answer rejected (or accepted) at ``stage``; None for the task's own failures.

    ``cheat`` and ``close`` are the verdict's flags (:class:`fusegraph.llm.harness.Verdict`).
    """
    level = _STAGE_LEVEL.get(stage)
    if level is None or stage == "endpoint":
        return level
    if cheat and stage != "accepted":
        return "cheat"
    if close and stage == "compare":
        return "close"
    return level


def level_of(attempt: dict) -> str | None:
    """The level recorded with an attempt (report or experience dict); older records: from the stage alone."""
    lv = attempt.get("level")
    return lv if lv in LEVELS else reached(str(attempt.get("stage", "")))


def is_valid(stage: str) -> bool:
    """Valid NKI: parses, is allow-listed and conformant, runs and computes with NKI instructions."""
    return reached(stage) in VALID_LEVELS


def is_valid_level(level: str | None) -> bool:
    return level in VALID_LEVELS


def is_correct(stage: str) -> bool:
    return stage == "accepted"


def reward(level: str | None, speedup: float | None = None) -> float | None:
    """A scalar in [0, 1] ordered like :data:`LEVELS`; a correct kernel earns more the faster it models."""
    if level is None or level not in REWARDS:
        return None
    r = REWARDS[level]
    if level == "correct" and speedup is not None and speedup > 0:
        r += 0.1 * speedup / (1.0 + speedup)
    return round(r, 4)
