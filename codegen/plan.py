"""Static planning before emission: a layout per activation and the SBUF/PSUM budget check per target.

Layouts are solved as equivalence classes: ops that combine values elementwise (residual add, gated activation,
norm input/output) need one layout for all their operands; per-head ops need the head size on partitions. A
class containing a kernel output prefers the partition-major layout (contiguous stores).
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


def plan_layouts(program: ir.KernelProgram) -> dict[str, Layout]:
    uf = _UnionFind()
    values: dict[str, ir.Value] = {}
    head: dict[str, int] = {}
    prefer_pmajor: set[str] = set()

    def act(v: ir.Value | None) -> None:
        if v is not None and v.kind == ir.ValueKind.ACT:
            values[v.name] = v
            uf.find(v.name)

    def same(*vs: ir.Value | None) -> None:
        vs2 = [v for v in vs if v is not None and v.kind == ir.ValueKind.ACT]
        for v in vs2:
            act(v)
        for a, b in zip(vs2, vs2[1:]):
            uf.union(a.name, b.name)

    def heads(v: ir.Value, size: int) -> None:
        act(v)
        head[v.name] = size

    for ins in program.instructions:
        for v in ins.reads() + ins.writes():
            act(v)
        if isinstance(ins, ir.RMSNorm):
            same(ins.x, ins.out)
            if ins.group != ins.x.features:
                heads(ins.x, ins.group)
        elif isinstance(ins, ir.Rope):
            same(ins.x, ins.out)
            heads(ins.x, ins.head_dim)
        elif isinstance(ins, ir.Attention):
            heads(ins.q, ins.k_cache.shape[-1])
            heads(ins.out, ins.k_cache.shape[-1])
        elif isinstance(ins, ir.KVWrite):
            heads(ins.value, ins.cache.shape[-1])
        elif isinstance(ins, (ir.Add,)):
            same(ins.a, ins.b, ins.out)
        elif isinstance(ins, ir.GatedAct):
            same(ins.gate, ins.up, ins.out)
        elif isinstance(ins, ir.Experts):
            same(ins.x, ins.out)
        elif isinstance(ins, ir.ScalarGate):
            same(ins.x, ins.out)
        elif isinstance(ins, ir.Store):
            prefer_pmajor.add(ins.x.name)
        elif isinstance(ins, ir.Elementwise):
            same(*[v for v, c in zip(ins.inputs, ins.input_classes) if c == "full"], *ins.outputs)

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
