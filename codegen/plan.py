"""Static planning before emission: a layout per activation and the SBUF/PSUM budget check per target.

Layouts are solved as equivalence classes: each instruction declares its constraints (``constrain(c)``): ops
that combine values elementwise (residual add, gated activation, norm input/output) need one layout for all their
operands (``c.same``); per-head ops need the head size on partitions (``c.heads``). A class containing a kernel
output prefers the partition-major layout (``c.prefer_pmajor``: contiguous stores).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import ir
from .errors import BudgetError, CodegenError
from .layout import Layout, choose

KIB = 1024

#: SBUF bytes per partition (NKI architecture guides) and what fusegraph leaves for the compiler by default
SBUF_BYTES = {"trn2": 224 * KIB, "trn3": 256 * KIB}
SBUF_RESERVE = 16 * KIB
PSUM_BANK_BYTES = 2 * KIB
PSUM_BANKS = 8


def sbuf_budget(target: str, override: int = 0) -> int:
    if target not in SBUF_BYTES:
        raise CodegenError(f"unknown target {target!r}")
    return override or SBUF_BYTES[target] - SBUF_RESERVE


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, a: str) -> str:
        self.parent.setdefault(a, a)
        while self.parent[a] != a:
            self.parent[a] = self.parent[self.parent[a]]
            a = self.parent[a]
        return a

    def union(self, a: str, b: str) -> None:
        self.parent[self.find(a)] = self.find(b)


class _Constraints(ir.Constraints):
    """The layout constraints instructions declare (:meth:`~.ir.Instruction.constrain`), as equivalence classes."""

    def __init__(self) -> None:
        self.uf = _UnionFind()
        self.values: dict[str, ir.Value] = {}
        self.head: dict[str, int] = {}
        self.pmajor: set[str] = set()

    def act(self, v: ir.Value | None) -> None:
        if v is not None and v.kind == ir.ValueKind.ACT:
            self.values[v.name] = v
            self.uf.find(v.name)

    def same(self, *vs: ir.Value | None) -> None:
        vs2 = [v for v in vs if v is not None and v.kind == ir.ValueKind.ACT]
        for v in vs2:
            self.act(v)
        for a, b in zip(vs2, vs2[1:]):
            self.uf.union(a.name, b.name)

    def heads(self, v: ir.Value, size: int) -> None:
        self.act(v)
        self.head[v.name] = size

    def prefer_pmajor(self, v: ir.Value) -> None:
        self.pmajor.add(v.name)


def plan_layouts(program: ir.KernelProgram) -> dict[str, Layout]:
    c = _Constraints()
    for ins in program.instructions:
        for v in ins.reads() + ins.writes():
            c.act(v)
        ins.constrain(c)
    uf, values, head, prefer_pmajor = c.uf, c.values, c.head, c.pmajor

    classes: dict[str, list[str]] = {}
    for name in values:
        classes.setdefault(uf.find(name), []).append(name)
    layouts: dict[str, Layout] = {}
    for members in classes.values():
        feats = {values[m].features for m in members}
        if len(feats) != 1:
            raise CodegenError(f"values {members} are combined elementwise but have different sizes {sorted(feats)}")
        sizes = {head[m] for m in members if m in head}
        if len(sizes) > 1:
            raise CodegenError(f"values {members} need different head sizes {sorted(sizes)} on partitions")
        F = feats.pop()
        size = sizes.pop() if sizes else None
        lay = choose(F, head_size=size, pmajor=size is None and any(m in prefer_pmajor for m in members))
        for m in members:
            layouts[m] = lay
    return layouts


@dataclass
class Budget:
    target: str
    sbuf_budget: int
    sbuf_peak: int = 0
    psum_peak_banks: int = 0
    items: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"target": self.target, "sbuf_budget_bytes": self.sbuf_budget, "sbuf_peak_bytes": self.sbuf_peak,
                "psum_peak_banks": self.psum_peak_banks, "psum_banks": PSUM_BANKS, "items": dict(self.items)}

    def check(self) -> None:
        if self.sbuf_peak > self.sbuf_budget:
            top = sorted(self.items.items(), key=lambda kv: -kv[1])[:4]
            raise BudgetError(
                f"the kernel needs {self.sbuf_peak / KIB:.1f} KiB of SBUF per partition but {self.target} has "
                f"{self.sbuf_budget / KIB:.1f} KiB usable (largest: "
                + ", ".join(f"{k} {v / KIB:.1f} KiB" for k, v in top) + ")"
            )
        if self.psum_peak_banks > PSUM_BANKS:
            raise BudgetError(f"the kernel needs {self.psum_peak_banks} PSUM banks at once; {self.target} has {PSUM_BANKS}")


def live_activation_peak(program: ir.KernelProgram, act_bytes: dict[str, int],
                         scratch: dict[int, int]) -> tuple[int, int, int]:
    """``(activations, scratch, index)`` at the instruction where live activations plus its own scratch peak.

    Why liveness and not "one layer's activations": with a batch every activation is ``T`` times larger (Llama-3-8B
    at 64 tokens: 133 KiB for one layer's values, which are never all alive at once), and the compiler (and the
    interpreter, docs/interpreter.md) frees a tile after its last use. A value is live from the first instruction
    writing it to the last one reading it; an instruction's scratch (``Emitted.sbuf``) is live during it."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, ins in enumerate(program.instructions):
        for v in ins.writes():
            if v.name in act_bytes:
                first.setdefault(v.name, i)
                last[v.name] = max(last.get(v.name, i), i)
        for v in ins.reads():
            if v.name in act_bytes and v.name in first:
                last[v.name] = i
    n = len(program.instructions)
    delta = [0] * (n + 1)
    for name, a in first.items():
        delta[a] += act_bytes[name]
        delta[last[name] + 1] -= act_bytes[name]
    best = (0, 0, 0)
    live = 0
    for i in range(n):
        live += delta[i]
        if live + scratch.get(i, 0) > best[0] + best[1]:
            best = (live, scratch.get(i, 0), i)
    return best
