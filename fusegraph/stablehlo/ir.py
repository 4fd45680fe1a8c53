"""A small, plain-Python view of a StableHLO module: what the importer reads, independent of the MLIR bindings.

Why a copy and not the MLIR objects: the translation walks values back to their producers (to recognize idioms
such as ``mean`` or ``softmax``), looks at attributes many times, and must outlive the MLIR context. Everything
here is immutable after parsing and carries only Python/numpy values.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any


_INDEXED = re.compile(r"^(?P<name>.*[A-Za-z])_(?P<index>\d+)$")


def module_path(scope: str) -> str:
    """A JAX name scope (``transformer_layer_0/self_attention``, ``layers.0/mlp``) as a dotted module path in
    which layer numbers are components of their own (``transformer_layer.0.self_attention``): how fusegraph's
    reports find the decoder layer of an op or a weight (the first integer component)."""
    parts = []
    for part in re.split(r"[/.]", scope):
        if not part:
            continue
        m = _INDEXED.match(part)
        parts += [m.group("name"), m.group("index")] if m else [part]
    return ".".join(parts)


class UnsupportedOp(Exception):
    """The module has an op (or an op form) the importer does not translate; ``op`` names it."""

    def __init__(self, op: str, detail: str = "") -> None:
        super().__init__(f"{op}{': ' + detail if detail else ''}")
        self.op = op
        self.detail = detail


@dataclass(frozen=True)
class TensorType:
    """``tensor<2x3xf32>``: static shape and the StableHLO element type name (``f32``, ``bf16``, ``i32``, ``i1``)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def __str__(self) -> str:
        return "tensor<" + "".join(f"{d}x" for d in self.shape) + self.dtype + ">"


@dataclass(eq=False)
class Value:
    """One SSA value. ``producer`` is ``None`` for block arguments (``arg`` is then their position)."""

    name: str
    type: TensorType
    producer: "Op | None" = None
    index: int = 0
    arg: int | None = None
    users: list = field(default_factory=list)

    def __repr__(self) -> str:
        return f"{self.name}: {self.type}"


@dataclass(eq=False)
class Block:
    args: list[Value]
    ops: list["Op"]
    returns: list[Value]


@dataclass(eq=False)
class Op:
    """One operation: its name (``stablehlo.add``), operands, results, decoded attributes, nested regions and
    where it came from (``scope``: the JAX name stack such as ``layers.0/self_attn``; ``source``: file:line)."""

    name: str
    operands: list[Value]
    results: list[Value]
    attrs: dict[str, Any]
    regions: list[Block] = field(default_factory=list)
    scope: str = ""
    source: str | None = None

    @property
    def result(self) -> Value:
        return self.results[0]

    def __repr__(self) -> str:
        return f"{self.name}({', '.join(v.name for v in self.operands)})"


@dataclass(eq=False)
class Function:
    name: str
    body: Block
    arg_attrs: list[dict[str, Any]]
    result_attrs: list[dict[str, Any]]
    public: bool = True


@dataclass(eq=False)
class Module:
    functions: dict[str, Function]
    main: str = "main"

    @property
    def entry(self) -> Function:
        return self.functions[self.main]

    def op_names(self) -> list[str]:
        """Every op name in the module (nested regions included), for reports and support checks."""
        out: list[str] = []

        def walk(block: Block) -> None:
            for op in block.ops:
                out.append(op.name)
                for r in op.regions:
                    walk(r)

        for f in self.functions.values():
            walk(f.body)
        return out
