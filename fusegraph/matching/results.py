"""What matching and region formation produce: matches, regions, decisions, unmatched ops.

These are the objects codegen consumes (``Match`` and ``Region``) and the report renders. They name *original*
program node ids (``g0.mm_3``), never ids of the canonical analysis view, so consumers can look everything up in
:attr:`fusegraph.program.Program.graph` directly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .pattern import Pattern


def jsonable(v: Any) -> Any:
    """Constants captured from graphs (floats, ints, dtypes, strings) in a JSON-friendly form."""
    if isinstance(v, (bool, int, str)) or v is None:
        return v
    if isinstance(v, float):
        return v if v == v and abs(v) != float("inf") else str(v)
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    return str(v)


@dataclass
class Match:
    """One accepted occurrence of a pattern in the program.

    ``inputs`` maps each pattern input to the program node whose value it reads. When canonicalization folded
    no-op/view nodes between that provider and the match (an ``alias``, an identity ``view``...), they are listed
    in ``input_views[name]`` (original node ids, provider side first) and ``input_layout_preserving[name]`` says
    whether that chain keeps the memory order (for decode it always should; codegen may assert it).
    ``mapping`` maps each traced pattern node (its FX name in the traced pattern) to the program node it matched,
    for consumers that need more than inputs/outputs.
    """

    pattern: "Pattern"
    variant: str
    nodes: frozenset[str]
    inputs: dict[str, str]
    outputs: dict[str, str]
    params: dict[str, Any]
    layer: int | None
    module: str | None
    input_views: dict[str, tuple[str, ...]] = field(default_factory=dict)
    input_layout_preserving: dict[str, bool] = field(default_factory=dict)
    mapping: dict[str, str] = field(default_factory=dict)
    exports: dict[str, tuple[str, ...]] = field(default_factory=dict)
    graphs: tuple[int, ...] = ()
    order: int = 0  # topological position of the match's first node (matches are sorted by it)
    id: int = -1

    @property
    def name(self) -> str:
        return self.pattern.name

    @property
    def template(self) -> str:
        return self.pattern.template

    def label(self) -> str:
        where = self.module if self.module else "step"
        return f"{self.pattern.name}@{where}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "pattern": self.pattern.name,
            "template": self.pattern.template,
            "variant": self.variant,
            "layer": self.layer,
            "module": self.module,
            "nodes": sorted(self.nodes),
            "inputs": dict(self.inputs),
            "outputs": dict(self.outputs),
            "params": jsonable(self.params),
            "input_views": {k: list(v) for k, v in self.input_views.items() if v},
            "exports": {k: list(v) for k, v in self.exports.items()},
            "graphs": list(self.graphs),
        }


@dataclass
class Boundary:
    """A value crossing a region boundary (an HBM read or write per step)."""

    node: str  # program node id producing the value (an input node for weights/state/step inputs)
    shape: tuple | None
    dtype: str | None
    bytes: int
    role: str  # "weight" | "buffer" | "state" | "step" | "activation"
    source: str | None = None  # parameter path / dynamo source for graph inputs, module for activations
    crosses_break: bool = False  # the value is also a dynamo graph output feeding a later graph

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "shape": list(self.shape) if isinstance(self.shape, tuple) else self.shape,
            "dtype": self.dtype,
            "bytes": self.bytes,
            "role": self.role,
            "source": self.source,
            "crosses_break": self.crosses_break,
        }


@dataclass
class Block:
    """A semantic sub-part of a region (one layer's attention, its MLP/MoE, the embedding, the head...)."""

    kind: str
    layer: int | None
    matches: list[int]  # Match ids

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "layer": self.layer, "matches": list(self.matches)}


@dataclass
class Region:
    """A convex set of program nodes that becomes one fused kernel (or one part of the step's megakernel)."""

    id: int
    kind: str
    matches: list[Match]
    nodes: frozenset[str]
    inputs: list[Boundary]
    outputs: list[Boundary]
    state_writes: list[str]  # state input nodes the region updates in place
    layers: list[int]
    graphs: list[int]
    blocks: list[Block] = field(default_factory=list)
    glue: dict[str, int] = field(default_factory=dict)  # absorbed layout/no-op ops by op name
    glue_nodes: tuple[str, ...] = ()
    glue_not_layout_preserving: tuple[str, ...] = ()  # absorbed glue that reorders memory (empty for decode)
    op_count: int = 0

    @property
    def bytes_in(self) -> int:
        return sum(b.bytes for b in self.inputs)

    @property
    def bytes_out(self) -> int:
        return sum(b.bytes for b in self.outputs)

    def bytes_by_role(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for b in self.inputs:
            out[b.role] = out.get(b.role, 0) + b.bytes
        return out

    def pattern_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for m in self.matches:
            counts[m.pattern.name] = counts.get(m.pattern.name, 0) + 1
        return dict(sorted(counts.items()))

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "layers": list(self.layers),
            "graphs": list(self.graphs),
            "op_count": self.op_count,
            "patterns": self.pattern_counts(),
            "matches": [m.id for m in self.matches],
            "blocks": [b.to_dict() for b in self.blocks],
            "inputs": [b.to_dict() for b in self.inputs],
            "outputs": [b.to_dict() for b in self.outputs],
            "state_writes": list(self.state_writes),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "bytes_in_by_role": self.bytes_by_role(),
            "glue": dict(sorted(self.glue.items())),
            "glue_not_layout_preserving": list(self.glue_not_layout_preserving),
        }


@dataclass
class Decision:
    """One entry of the decision log: a merge, or a refusal with the reason (like XLA's fusion decisions)."""

    action: str  # match | refuse_match | merge | refuse_merge | dissolve | fallback | span_break | refuse_break | require_full
    subject: str
    reason: str
    other: str | None = None
    nodes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"action": self.action, "subject": self.subject, "reason": self.reason}
        if self.other is not None:
            d["other"] = self.other
        if self.nodes:
            d["nodes"] = list(self.nodes)
        return d


@dataclass
class Unmatched:
    """Ops outside every region, grouped by op, source module (layer index as ``*``) and reason."""

    op: str
    count: int
    module: str | None
    reason: str
    nodes: tuple[str, ...] = ()
    layers: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "count": self.count, "module": self.module, "reason": self.reason,
                "layers": list(self.layers), "nodes": list(self.nodes[:8])}
