"""What a harness verdict means for scoring: the level an answer reached, validity, correctness, a reward.

One definition shared by ``fusegraph llm-eval`` (its valid/correct counts) and the reward records of
``fusegraph export-sft`` (so a training signal and the benchmark can never disagree about what "valid" is).
The harness stops at the first failing stage; the level is the last check the answer *passed*:

=============  ===========================  ==========================================================
level          reached when the stage is    meaning
=============  ===========================  ==========================================================
``none``       endpoint, extract, parse     no usable Python (no code block, a syntax error)
``parse``      safety                       parses, but uses something outside the allow-list
``allow-list`` conformance                  allow-listed, but calls an API that does not exist as written
``conformance`` contract, run, computes     conformant, but breaks the kernel contract, fails in the
                                            interpreter or does not compute with NKI instructions
``computes``   compare                      **valid NKI**: runs and computes with NKI; the numbers are wrong
``correct``    accepted                     matches the reference on every case
=============  ===========================  ==========================================================

A ``reference`` verdict is the task's fault, not the answer's: it has no level (``None``).
"""
from __future__ import annotations

LEVELS: tuple[str, ...] = ("none", "parse", "allow-list", "conformance", "computes", "correct")
_STAGE_LEVEL = {
    "endpoint": "none", "extract": "none", "parse": "none",
    "safety": "parse",
    "conformance": "allow-list",
    "contract": "conformance", "run": "conformance", "computes": "conformance",
    "compare": "computes",
    "accepted": "correct",
}


def reached(stage: str) -> str | None:
    """The level an answer rejected (or accepted) at ``stage`` reached; None for the task's own failures."""
    return _STAGE_LEVEL.get(stage)


def is_valid(stage: str) -> bool:
    """Valid NKI: parses, is allow-listed and conformant, runs and computes with NKI instructions."""
    return reached(stage) in ("computes", "correct")


def is_correct(stage: str) -> bool:
    return stage == "accepted"


def reward(stage: str) -> float | None:
    """A scalar in [0, 1]: the reached level's index over the number of levels above ``none``."""
    level = reached(stage)
    return None if level is None else LEVELS.index(level) / (len(LEVELS) - 1)
