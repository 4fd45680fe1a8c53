"""Instruction order inside a decoder layer: the KV-cache writes, and what they need, first.

Why: attention reads the cache through HBM after this step's KV write, so on the device the write and then the
cache reads are two dependent DMA round trips (each with its fixed latency) on the attention's critical path. The
query projection and its norm and RoPE -- the layer's largest attention matmuls -- do not feed the write. With the
keys and values computed first, the write and the cache reads are in flight while the Tensor engine works on q.

Only the order changes (every instruction still runs after everything it reads, and the streamed weights follow
the new order), so numerics are those of the original order. A layer is left as it is when the move would cross
an instruction that touches the same cache, or reorder two collectives (every rank must issue them in one order;
this pass is deterministic, but it never needs to move one collective past another, so it does not).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from . import ir

#: opcodes of collectives: their relative order is part of the rank protocol and is never changed
COLLECTIVES = frozenset({"all_reduce", "all_gather"})


def writes_state(ins: ir.Instruction) -> bool:
    """A KV-cache write: reads a STATE value (the cache it updates in place) and produces no kernel value."""
    return not ins.writes() and any(v.kind == ir.ValueKind.STATE for v in ins.reads())


def kv_first(instructions: Sequence[ir.Instruction]) -> list[ir.Instruction]:
    """``instructions`` with, inside each run of one decoder layer, the cache writes' producer cone moved ahead of
    the layer's other instructions (both groups keep their relative order)."""
    out: list[ir.Instruction] = []
    for _, run in itertools.groupby(instructions, key=lambda ins: ins.layer):
        run = list(run)
        out.extend(_hoist(run) if run[0].layer is not None else run)
    return out


def _hoist(run: list[ir.Instruction]) -> list[ir.Instruction]:
    writers = [k for k, ins in enumerate(run) if writes_state(ins)]
    if not writers:
        return run
    producer: dict[str, int] = {}
    for k, ins in enumerate(run):
        for v in ins.writes():
            producer.setdefault(v.name, k)
    cone: set[int] = set()
    stack = list(writers)
    while stack:
        k = stack.pop()
        if k in cone:
            continue
        cone.add(k)
        stack.extend(p for v in run[k].reads() if (p := producer.get(v.name)) is not None and p < k)
    state = {v.name for k in cone for v in run[k].reads() if v.kind == ir.ValueKind.STATE}
    last = max(cone)
    for k in range(last):
        if k in cone:
            continue
        ins = run[k]
        if any(v.name in state for v in (*ins.reads(), *ins.writes())):
            return run
        if ins.opcode in COLLECTIVES and any(run[c].opcode in COLLECTIVES for c in cone if c > k):
            return run
    return [run[k] for k in sorted(cone)] + [run[k] for k in range(len(run)) if k not in cone]
