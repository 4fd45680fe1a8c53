"""fusegraph's program IR: one networkx DiGraph for a whole decode step, possibly spanning dynamo graph breaks.

Why networkx and not FX: the matcher (VF2 subgraph search), region formation and reports are graph algorithms
over a step that may consist of several FX graphs linked by tensor flow. FX graphs stay the source of truth for
each piece (kept on :class:`CapturedGraph`), the program is the analysis view that also executors walk.

Node ids are ``"g<graph>.<fx name>"``. Node attributes (all nodes):

``kind``      ``"input"`` (a graph placeholder), ``"op"`` (an ATen call) or ``"output"`` (the graph's outputs)
``graph``     index of the dynamo graph the node came from
``order``     position in a global topological order (ties broken by FX order)
``shape``     tuple of ints (tuple of tuples for multi-output ops), ``None`` for non-tensors
``dtype``     dtype name such as ``"float32"`` (tuple for multi-output ops)

``op`` nodes also carry ``op`` (``"aten.mm.default"``), ``target`` (the callable), ``args``/``kwargs`` (with
:class:`Ref` in place of node references), ``consts`` (the non-tensor arguments, for reports and pattern
checks), ``module`` (source module path like ``model.layers.3.self_attn.q_proj``), ``module_type``, ``layer``
(decoder layer index or ``None``) and ``source_line``. An op that writes state in place has ``writes_state``
(the input node id it updates).

``input`` nodes carry ``input_kind`` (:class:`InputKind`), ``source`` (dynamo's name for it, e.g.
``G['cache'].layers[0].keys``), ``module`` (the parameter path, e.g. ``model.layers.0.mlp.gate.weight``), and
``position`` (placeholder index); a complex input has ``pairs_of`` (its complex dtype: the node is its real pairs,
see :mod:`.complex_pairs`, and an op node that computes part of a complex op has ``complex_op``, that op's name).
Edges point from producer to consumer; ``arg`` on an edge names the argument
positions. Extra edges with ``hazard=True`` order readers of a state value before the in-place write of it.

Tensor parallelism (:mod:`.distributed`, ``docs/tp.md``): an input that was a DTensor has ``sharding`` (a
:class:`~.distributed.Sharding`: mesh, placements, global and local shape; ``shape`` is the local shard's), a
device-mesh input has ``device_mesh`` (a :class:`~.distributed.MeshInfo`); a functional collective op has
``collective`` (a :class:`~.distributed.Collective`: op, reduce op, group, communicated values, its wait) and its
``wait_tensor`` has ``collective_wait`` (the collective's node id). Collectives have side effects across ranks:
hazard edges (``hazard=True, collective=True``) chain the collectives of one process group in program order, so
no scheduler reorders them (every rank must issue a group's collectives in the same order).
"""
from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import networkx as nx

from .execution import ExecutionRecord


def value_nbytes(shape: Any, dtype: Any) -> int:
    """Bytes of a node value from its metadata (0 for non-tensors and symbolic shapes)."""
    import torch

    if not isinstance(shape, tuple) or not all(isinstance(s, int) for s in shape) or not isinstance(dtype, str):
        return 0
    t = getattr(torch, dtype, None)
    if not isinstance(t, torch.dtype):
        return 0
    n = 1
    for s in shape:
        n *= s
    return n * t.itemsize


class InputKind(str, enum.Enum):
    """What a graph input is, which decides how codegen treats it."""

    WEIGHT = "weight"  #: nn.Parameter: read-only, streamed from HBM every step
    BUFFER = "buffer"  #: registered module buffer (inv_freq...): read-only constant
    STATE = "state"  #: written in place by the step (KV cache, cache length counters)
    STEP = "step"  #: changes every step (token ids, positions) or other per-call tensors
    LINKED = "linked"  #: produced by an earlier graph of the same step (crosses a graph break)
    SCALAR = "scalar"  #: a non-tensor input (SymInt or Python number)


@dataclass(frozen=True)
class Ref:
    """Reference to another program node inside an op's ``args``/``kwargs``."""

    node: str
    index: int | None = None  # for a multi-output producer read through getitem semantics

    def __repr__(self) -> str:
        return f"%{self.node}" if self.index is None else f"%{self.node}[{self.index}]"


@dataclass
class ProgramInput:
    node: str
    position: int
    kind: InputKind
    source: str
    module: str | None
    shape: tuple[int, ...] | None
    dtype: str | None
    #: a DTensor input: how it is sharded (``shape`` is the local shard's); see :mod:`.distributed`
    sharding: Any = None
    #: a complex input: its dtype (``"complex64"``). The caller passes the complex tensor; the program takes its real
    #: pairs, ``torch.view_as_real`` of it (``shape`` and ``dtype`` are the pairs'); see :mod:`.complex_pairs`
    pairs_of: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {
            "node": self.node,
            "position": self.position,
            "kind": self.kind.value,
            "source": self.source,
            "module": self.module,
            "shape": list(self.shape) if self.shape is not None else None,
            "dtype": self.dtype,
        }
        if self.sharding is not None:
            d["sharding"] = self.sharding.to_dict()
        if self.pairs_of is not None:
            d["pairs_of"] = self.pairs_of
        return d


@dataclass
class GraphBreak:
    """Why dynamo ended graph ``after_graph`` and resumed in a later graph."""

    after_graph: int
    reason: str
    user_frame: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"after_graph": self.after_graph, "reason": self.reason, "user_frame": self.user_frame}


@dataclass
class Link:
    """A tensor produced by graph ``src_graph`` (output ``src_output``) consumed by ``dst_graph``'s input.

    ``glue_free`` is true when the very same tensor object reached the consumer unmodified (same object,
    same version counter), i.e. no Python code between the graphs computed on it: a fused region may span
    such a link.
    """

    src_graph: int
    src_output: int
    src_node: str
    dst_graph: int
    dst_input: int
    dst_node: str
    glue_free: bool

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class CapturedGraph:
    """One dynamo graph, lowered to ATen, as it sits inside the program."""

    index: int
    inputs: list[ProgramInput]
    outputs: list[Any]  # output templates in order: Ref for node values, constants as-is
    state_writes: dict[str, str]  # state input node -> node that leaves its final value
    dynamo_node_count: int
    aten_node_count: int
    break_reason: str | None = None
    gm: Any = None  # the ATen torch.fx.GraphModule (not serialized)
    #: output position -> complex dtype: the program computes that output as real pairs, the caller gets it back as
    #: a complex tensor (``torch.view_as_complex``); see :mod:`.complex_pairs`
    output_pairs: dict[int, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "inputs": len(self.inputs),
            "outputs": len(self.outputs),
            "state_writes": dict(self.state_writes),
            "dynamo_nodes": self.dynamo_node_count,
            "aten_nodes": self.aten_node_count,
            "break_reason": self.break_reason,
            **({"output_pairs": dict(self.output_pairs)} if self.output_pairs else {}),
        }


@dataclass
class Program:
    """A whole decode step: every captured graph, linked into one DiGraph."""

    graph: nx.DiGraph = field(default_factory=nx.DiGraph)
    graphs: list[CapturedGraph] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    breaks: list[GraphBreak] = field(default_factory=list)
    #: per graph index, what the executor did (kernel launches, who ran each region), kept current while the step
    #: runs by executors that run kernels; the fused-region report reads it
    execution: dict[int, ExecutionRecord] = field(default_factory=dict)

    # ---- queries ------------------------------------------------------------------------------------------
    def newest_execution(self) -> ExecutionRecord:
        """The record of the newest graph that ran: graph indices count every graph of the session (a step whose
        code dynamo compiled before, in this process, starts past 0), so "the step's record" is the last one."""
        if not self.execution:
            raise KeyError("no graph of this program has run")
        return self.execution[max(self.execution)]

    def find(self, graph_index: int) -> CapturedGraph | None:
        """The captured graph with this index, if this program has it (indices count every graph of the session,
        also refused ones and those of earlier versions of the step, so they are not list positions)."""
        return next((g for g in self.graphs if g.index == graph_index), None)

    def captured(self, graph_index: int) -> CapturedGraph:
        g = self.find(graph_index)
        if g is None:
            raise KeyError(f"graph {graph_index} is not in this program")
        return g

    def op_nodes(self, graph_index: int | None = None) -> Iterator[str]:
        for n, d in self.graph.nodes(data=True):
            if d["kind"] == "op" and (graph_index is None or d["graph"] == graph_index):
                yield n

    def inputs(self, kind: InputKind | None = None) -> list[ProgramInput]:
        return [i for g in self.graphs for i in g.inputs if kind is None or i.kind == kind]

    def topo_order(self, graph_index: int | None = None) -> list[str]:
        nodes = [n for n, d in self.graph.nodes(data=True) if graph_index is None or d["graph"] == graph_index]
        return sorted(nodes, key=lambda n: self.graph.nodes[n]["order"])

    def collectives(self, graph_index: int | None = None) -> list[str]:
        """The functional collective ops (not their waits), in program order (see :mod:`.distributed`)."""
        return [n for n in self.topo_order(graph_index) if self.graph.nodes[n].get("collective") is not None]

    def op_counts(self) -> Counter:
        return Counter(self.graph.nodes[n]["op"] for n in self.op_nodes())

    def layers(self) -> list[int]:
        return sorted({d["layer"] for _, d in self.graph.nodes(data=True) if d.get("layer") is not None})

    def node(self, node_id: str) -> dict[str, Any]:
        return self.graph.nodes[node_id]
