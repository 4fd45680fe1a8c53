"""Steps that dynamo compiles again at every call, and the position counters fusegraph makes dynamic instead.

A guard that fails at every call (a Python int that changes every step and that dynamo specialized) makes each
call a recompile: each kernel call is then a verified first call returning eager's values, and after
``torch._dynamo.config.recompile_limit`` versions dynamo sends the step to plain eager, silently. The usual
cause is transformers' sliding-window cache counter ``cumulative_length_int`` under ``torch.compile(...,
dynamic=False)`` (``capture_step`` compiles that way): with automatic dynamic shapes dynamo makes it symbolic at
the second call, with ``dynamic=False`` it never does.

fusegraph watches the guard failure behind every recompile of a frame. A guard on a known position counter that
fails a second time is fixed where it arises: the counter's sources join ``torch.compiler.config.dynamic_sources``
(which dynamo honours even under ``dynamic=False``; a process-wide setting, so it is changed only once automatic
dynamic shapes have shown they are off), so the next version takes it as a symbolic scalar (a ``scalar`` input of the
program, docs/capture.md) and the step stops recompiling. Any other guard that fails at
:data:`EVERY_CALL_RECOMPILES` recompiles of one frame gets one warning naming it.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch

from ..warnings import warn

log = logging.getLogger(__name__)

#: attribute names of per-step position counters kept as Python ints (transformers' StaticSlidingWindowLayer)
POSITION_COUNTERS = ("cumulative_length_int",)
#: recompiles of one frame on a position counter's guard before fusegraph makes the counter dynamic: dynamo's
#: automatic dynamic shapes make it symbolic at the first recompile, so a second one on the same guard means they
#: are off (``dynamic=False``) and the global setting is changed only where it is needed
COUNTER_RECOMPILES = 2
#: recompiles of one frame on the same guard after which the step counts as recompiling at every call
EVERY_CALL_RECOMPILES = 3

_GUARD = re.compile(r"^\s*(?:\[?[\d/]+\]?:\s*)?(?P<expr>.+?)(?:\s*(?:==|!=|<=|>=|<|>)\s*.+)?\s*$", re.S)


def guard_expression(reason: str) -> str:
    """The guarded expression of a dynamo guard-failure reason, without the compile id and the value
    (``"0/3: L['c'].layers[0].cumulative_length_int == 11"`` -> ``"L['c'].layers[0].cumulative_length_int"``)."""
    first = reason.strip().splitlines()[0] if reason.strip() else ""
    first = first.split(";")[0]
    m = _GUARD.match(first)
    return (m.group("expr") if m else first).strip()


def _counter_name(expr: str) -> str | None:
    """The position counter a guarded expression reads (``...layers[0].cumulative_length_int``), or None."""
    for name in POSITION_COUNTERS:
        if expr.endswith("." + name):
            return name
    return None


def make_dynamic(attribute: str) -> bool:
    """Make every dynamo source that ends in ``.<attribute>`` dynamic (``torch.compiler.config.dynamic_sources``:
    all layers' counters at once, whatever the root object is called); False if this torch lacks the setting."""
    cfg = getattr(torch.compiler, "config", None)
    if cfg is None or not hasattr(cfg, "dynamic_sources"):
        return False
    pattern = r".*\." + re.escape(attribute) + "$"
    current = [s for s in str(cfg.dynamic_sources or "").split(",") if s.strip()]
    if pattern not in current:
        cfg.dynamic_sources = ",".join(current + [pattern])
    return True


@dataclass
class RecompileWatch:
    """Per capture session: guard failures per (frame, guarded expression), and what was done about them."""

    counts: dict[tuple[int, str], int] = field(default_factory=dict)
    made_dynamic: list[str] = field(default_factory=list)
    fixed_at: dict[tuple[int, str], int] = field(default_factory=dict)
    warned: set[str] = field(default_factory=set)
    reasons: list[str] = field(default_factory=list)

    def note(self, frame: int, reason: str | None) -> None:
        """A recompile of ``frame`` because of ``reason`` (dynamo's guard failure text; None: unknown)."""
        if not reason:
            return
        self.reasons.append(reason)
        expr = guard_expression(reason)
        key = (frame, expr)
        self.counts[key] = self.counts.get(key, 0) + 1
        counter = _counter_name(expr)
        if (counter is not None and self.counts[key] >= COUNTER_RECOMPILES and counter not in self.made_dynamic
                and make_dynamic(counter)):
            self.made_dynamic.append(counter)
            self.fixed_at[key] = self.counts[key]
            log.info("dynamo recompiled the step on the position counter %s; every %s is a symbolic scalar from "
                     "the next version on (torch.compiler.config.dynamic_sources)", expr, counter)
            return
        # the trace that made the counter dynamic had already specialized it: one more recompile is expected
        limit = max(EVERY_CALL_RECOMPILES, self.fixed_at.get(key, -1) + 2)
        if self.counts[key] >= limit and expr not in self.warned:
            self.warned.add(expr)
            warn(f"dynamo recompiles the step at every call (guard {expr} failed {self.counts[key]} times); each "
                 "call is a new, verified first call, and after torch._dynamo.config.recompile_limit versions the "
                 "step runs in plain eager PyTorch without fusegraph: keep per-step values in tensors, or let "
                 "dynamo make the value dynamic (compile without dynamic=False, or list the source in "
                 "torch.compiler.config.dynamic_sources)")
