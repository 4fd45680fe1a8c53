"""Build program nodes from one ATen FX graph (as aot_autograd hands it over) and add them to a Program."""
from __future__ import annotations

import functools
import logging
import operator
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
import torch.fx as fx

from .complex_pairs import rewrite_complex_pairs
from .distributed import Collective, collective_arguments, is_functional_collective, is_wait, mesh_info, resolve_group
from .ir import CapturedGraph, InputKind, Program, ProgramInput, Ref
from .sources import layer_index, parse_source, relative_path, stack_path
from .state import convert_state_writes, order_collectives

log = logging.getLogger(__name__)


@dataclass
class DynamoInput:
    """What dynamo knows about one graph input (aligned with the ATen placeholders)."""

    source: str
    is_tensor: bool
    is_parameter: bool


def node_id(graph_index: int, name: str) -> str:
    return f"g{graph_index}.{name}"


def op_name(target: Any) -> str:
    """Stable string name of an FX call target (``aten.mm.default``, ``getitem``, ``mylib.myop``)."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target)
    mod = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    return f"{mod}.{name}" if mod else name


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def value_meta(val: Any) -> tuple[Any, Any]:
    """(shape, dtype) of an FX node value; nested tuples for multi-output ops."""
    if isinstance(val, torch.Tensor):
        return tuple(int(s) if not isinstance(s, torch.SymInt) else s for s in val.shape), dtype_name(val.dtype)
    if isinstance(val, (list, tuple)):
        metas = [value_meta(v) for v in val]
        return tuple(m[0] for m in metas), tuple(m[1] for m in metas)
    return None, None


def _convert_arg(arg: Any, graph_index: int) -> tuple[Any, list]:
    """Replace fx.Node references by Ref; also return the constant (non-node) leaves."""
    consts: list = []

    def conv(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return Ref(node_id(graph_index, a.name))
        if isinstance(a, (list, tuple)):
            return type(a)(conv(x) for x in a)
        if isinstance(a, dict):
            return {k: conv(v) for k, v in a.items()}
        consts.append(a)
        return a

    return conv(arg), consts


def _last_stack_line(node: fx.Node) -> str | None:
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    # the stack trace ends with the code line (possibly followed by a ^^^^ marker line)
    code = [ln for ln in lines if not set(ln) <= set("^~ ")]
    return code[-1] if code else None


def _module_of(node: fx.Node) -> tuple[str | None, str | None]:
    """(frame-relative dotted module path, module class name) of the innermost module an op ran in."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None, None
    path, cls = list(stack.values())[-1]
    cls_name = getattr(cls, "__name__", None) or str(cls).rsplit(".", 1)[-1].strip("'>")
    return stack_path(path), cls_name


def outermost_module(gm: fx.GraphModule) -> str | None:
    """The path of the outermost nn.Module the step runs (what module paths are made relative to)."""
    from collections import Counter

    roots: Counter = Counter()
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack")
        if stack:
            roots[stack_path(list(stack.values())[0][0])] += 1
    return roots.most_common(1)[0][0] if roots else None


def classify_input(src: DynamoInput | None, val: Any) -> InputKind:
    if not isinstance(val, torch.Tensor):
        return InputKind.SCALAR
    if src is None:
        return InputKind.STEP
    if src.is_parameter:
        return InputKind.WEIGHT
    if parse_source(src.source).is_buffer:
        return InputKind.BUFFER
    return InputKind.STEP


def add_graph(
    program: Program,
    gm: fx.GraphModule,
    graph_index: int,
    dynamo_inputs: Sequence[DynamoInput] | None,
    dynamo_node_count: int = 0,
    break_reason: str | None = None,
) -> CapturedGraph:
    """Add one ATen graph to ``program``; complex values become real pairs (see :mod:`.complex_pairs`), then state
    writes become in-place ops (see :mod:`.state`)."""
    builder = _GraphBuilder(program, gm, graph_index, _aligned_inputs(gm, graph_index, dynamo_inputs))
    for pos, n in enumerate(gm.graph.nodes):
        builder.add(pos, n)
    captured = CapturedGraph(
        index=graph_index,
        inputs=builder.inputs,
        outputs=builder.outputs,
        state_writes={},
        dynamo_node_count=dynamo_node_count,
        aten_node_count=sum(1 for n in gm.graph.nodes if n.op == "call_function"),
        break_reason=break_reason,
        gm=gm,
    )
    rewrite_complex_pairs(program, captured)
    captured.state_writes = convert_state_writes(program, captured)
    order_collectives(program, captured)
    program.graphs.append(captured)
    renumber(program)
    return captured


def _aligned_inputs(gm: fx.GraphModule, graph_index: int,
                    dynamo_inputs: Sequence[DynamoInput] | None) -> Sequence[DynamoInput] | None:
    """``dynamo_inputs`` when they line up one to one with the ATen placeholders, else None (inputs are then
    classified from their values alone rather than from the wrong dynamo source)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if dynamo_inputs is not None and len(dynamo_inputs) != len(placeholders):
        log.debug("graph %d: %d dynamo inputs for %d ATen placeholders", graph_index, len(dynamo_inputs), len(placeholders))
        return None
    return dynamo_inputs


class _GraphBuilder:
    """Adds the nodes of one ATen graph to a program's graph, one FX node at a time, in FX order (edges point at
    nodes already added); collects the graph's inputs and outputs for its :class:`CapturedGraph`."""

    def __init__(self, program: Program, gm: fx.GraphModule, graph_index: int,
                 dynamo_inputs: Sequence[DynamoInput] | None) -> None:
        self.G = program.graph
        self.gm = gm
        self.graph_index = graph_index
        self.dynamo_inputs = dynamo_inputs
        self.root = outermost_module(gm)  # module paths are made relative to it
        shards = gm.meta.get("fusegraph_local_shards")  # DTensor inputs lowered over their local shard
        self.shard_inputs = shards.inputs if shards is not None else {}
        self.inputs: list[ProgramInput] = []
        self.outputs: list = []

    def add(self, pos: int, n: fx.Node) -> None:
        """Add FX node ``n`` (at position ``pos`` in its graph) by its kind."""
        nid = node_id(self.graph_index, n.name)
        shape, dtype = value_meta(n.meta.get("val"))
        if n.op == "placeholder":
            self.add_input(pos, n, nid, shape, dtype)
        elif n.op == "call_function":
            self.add_op(pos, n, nid, shape, dtype)
        elif n.op == "output":
            self.add_output(pos, n, nid)
        else:  # get_attr: a constant the step created (torch.tensor([1])...); an op that returns it
            value = getattr(self.gm, n.target)
            self.G.add_node(nid, kind="op", graph=self.graph_index, fx_pos=pos, shape=shape, dtype=dtype,
                            op="get_attr", target=functools.partial(_constant, value), args=(), kwargs={}, consts=(),
                            module=None, module_type=None, layer=None, source_line=None, name=n.name,
                            frame_path="self")

    def add_input(self, pos: int, n: fx.Node, nid: str, shape: Any, dtype: Any) -> None:
        """A placeholder: a :class:`ProgramInput` classified (weight, buffer, step, scalar) and placed in the model
        by its dynamo source, with its tensor-parallel sharding and device mesh when it has them."""
        G, position = self.G, len(self.inputs)
        src = self.dynamo_inputs[position] if self.dynamo_inputs is not None else None
        kind = classify_input(src, n.meta.get("val"))
        info = parse_source(src.source) if src else None
        pin = ProgramInput(
            node=nid,
            position=position,
            kind=kind,
            source=src.source if src else n.name,
            module=relative_path(info.path, self.root) if info else None,
            shape=shape,
            dtype=dtype,
            sharding=self.shard_inputs[position].sharding if position in self.shard_inputs else None,
        )
        self.inputs.append(pin)
        G.add_node(
            nid, kind="input", graph=self.graph_index, fx_pos=pos, shape=shape, dtype=dtype,
            input_kind=kind, source=pin.source, module=pin.module, position=pin.position,
            layer=layer_index(pin.module), frame_path=info.path if info else None,
        )
        if pin.sharding is not None:
            G.nodes[nid]["sharding"] = pin.sharding
        mesh = _device_mesh(n.meta.get("val"))
        if mesh is not None:
            G.nodes[nid]["device_mesh"] = mesh

    def add_op(self, pos: int, n: fx.Node, nid: str, shape: Any, dtype: Any) -> None:
        """An ATen call: its arguments with node references as :class:`Ref`, its constants, the module and layer
        it ran in, an edge from each input node; collectives and their waits are linked."""
        G, gi = self.G, self.graph_index
        args, c1 = _convert_arg(n.args, gi)
        kwargs, c2 = _convert_arg(dict(n.kwargs), gi)
        frame_path, mod_type = _module_of(n)
        mod = relative_path(frame_path, self.root) if frame_path else None
        G.add_node(
            nid, kind="op", graph=gi, fx_pos=pos, shape=shape, dtype=dtype,
            op=op_name(n.target), target=n.target, args=args, kwargs=kwargs, consts=tuple(c1 + c2),
            module=mod or None, module_type=mod_type, layer=layer_index(mod), source_line=_last_stack_line(n),
            name=n.name, frame_path=frame_path or "self",
        )
        for a in n.all_input_nodes:
            G.add_edge(node_id(gi, a.name), nid)
        self.link_collective(n, nid)

    def link_collective(self, n: fx.Node, nid: str) -> None:
        """A functional collective records its :class:`Collective`; a wait records the collective it waits on, and
        that collective its (first) wait, so collectives can be ordered and lowered with their waits."""
        G = self.G
        if is_functional_collective(n.target):
            G.nodes[nid]["collective"] = _collective(n, self.graph_index)
        elif is_wait(n.target) and n.args and isinstance(n.args[0], fx.Node):
            src = node_id(self.graph_index, n.args[0].name)
            G.nodes[nid]["collective_wait"] = src
            c = G.nodes[src].get("collective")
            if c is not None and c.wait is None:
                G.nodes[src]["collective"] = replace(c, wait=nid)

    def add_output(self, pos: int, n: fx.Node, nid: str) -> None:
        """The output node: the graph's outputs (flattened :class:`Ref` list) and an edge from each producer."""
        outs, _ = _convert_arg(n.args[0], self.graph_index)
        flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        self.outputs = flat
        self.G.add_node(nid, kind="output", graph=self.graph_index, fx_pos=pos, shape=None, dtype=None, args=(flat,))
        for a in n.all_input_nodes:
            self.G.add_edge(node_id(self.graph_index, a.name), nid)


def _constant(value: Any) -> Any:
    return value


def _collective(n: fx.Node, graph_index: int) -> Collective:
    """The :class:`~.distributed.Collective` of a functional collective op node: what it communicates, over which
    process group (resolved to its global ranks when this process knows it)."""
    named = collective_arguments(n.target, n.args, n.kwargs)
    tensors = [node_id(graph_index, a.name) for a in n.all_input_nodes]
    info = resolve_group(str(named.get("group_name")))
    size = named.get("group_size")
    extra: dict[str, Any] = {}
    for k, v in named.items():
        if k in ("input", "inputs", "self", "group_name", "reduce_op", "group_size"):
            continue
        if isinstance(v, fx.Node) or isinstance(v, (list, tuple)) and any(isinstance(x, fx.Node) for x in v):
            continue
        extra[k] = list(v) if isinstance(v, (list, tuple)) else v
    packet = getattr(n.target, "overloadpacket", n.target)
    return Collective(op=getattr(packet, "__name__", str(n.target)), group=info, inputs=tuple(tensors),
                      reduce_op=named.get("reduce_op"), group_size=int(size) if isinstance(size, int) else info.size,
                      extra=extra)


def _device_mesh(val: Any) -> Any:
    """A DeviceMesh graph input (dynamo passes the mesh an HF TP hook closes over): its plain data."""
    import sys

    cls = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", None)
    if isinstance(cls, type) and isinstance(val, cls):
        return mesh_info(val)
    return None


def renumber(program: Program) -> None:
    """Assign ``order``: a topological order of the whole program, ties broken by (graph, FX position)."""
    import networkx as nx

    G = program.graph
    key = {n: (d["graph"], d["fx_pos"]) for n, d in G.nodes(data=True)}
    for i, n in enumerate(nx.lexicographical_topological_sort(G, key=lambda n: key[n])):
        G.nodes[n]["order"] = i
