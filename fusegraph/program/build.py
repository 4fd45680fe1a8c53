"""Build program nodes from one ATen FX graph (as aot_autograd hands it over) and add them to a Program."""
from __future__ import annotations

import functools
import logging
import operator
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
import torch.fx as fx

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
    """Add one ATen graph to ``program``; state writes become in-place ops (see :mod:`.state`)."""
    G = program.graph
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if dynamo_inputs is not None and len(dynamo_inputs) != len(placeholders):
        log.debug("graph %d: %d dynamo inputs for %d ATen placeholders", graph_index, len(dynamo_inputs), len(placeholders))
        dynamo_inputs = None
    inputs: list[ProgramInput] = []
    outputs: list = []
    root = outermost_module(gm)
    shards = gm.meta.get("fusegraph_local_shards")  # DTensor inputs lowered over their local shard
    shard_inputs = shards.inputs if shards is not None else {}
    for pos, n in enumerate(gm.graph.nodes):
        nid = node_id(graph_index, n.name)
        shape, dtype = value_meta(n.meta.get("val"))
        if n.op == "placeholder":
            src = dynamo_inputs[len(inputs)] if dynamo_inputs is not None else None
            kind = classify_input(src, n.meta.get("val"))
            info = parse_source(src.source) if src else None
            pin = ProgramInput(
                node=nid,
                position=len(inputs),
                kind=kind,
                source=src.source if src else n.name,
                module=relative_path(info.path, root) if info else None,
                shape=shape,
                dtype=dtype,
                sharding=shard_inputs[len(inputs)].sharding if len(inputs) in shard_inputs else None,
            )
            inputs.append(pin)
            G.add_node(
                nid, kind="input", graph=graph_index, fx_pos=pos, shape=shape, dtype=dtype,
                input_kind=kind, source=pin.source, module=pin.module, position=pin.position,
                layer=layer_index(pin.module), frame_path=info.path if info else None,
            )
            if pin.sharding is not None:
                G.nodes[nid]["sharding"] = pin.sharding
            mesh = _device_mesh(n.meta.get("val"))
            if mesh is not None:
                G.nodes[nid]["device_mesh"] = mesh
        elif n.op == "call_function":
            args, c1 = _convert_arg(n.args, graph_index)
            kwargs, c2 = _convert_arg(dict(n.kwargs), graph_index)
            frame_path, mod_type = _module_of(n)
            mod = relative_path(frame_path, root) if frame_path else None
            G.add_node(
                nid, kind="op", graph=graph_index, fx_pos=pos, shape=shape, dtype=dtype,
                op=op_name(n.target), target=n.target, args=args, kwargs=kwargs, consts=tuple(c1 + c2),
                module=mod or None, module_type=mod_type, layer=layer_index(mod), source_line=_last_stack_line(n),
                name=n.name, frame_path=frame_path or "self",
            )
            for i, a in enumerate(n.all_input_nodes):
                G.add_edge(node_id(graph_index, a.name), nid)
            if is_functional_collective(n.target):
                G.nodes[nid]["collective"] = _collective(n, graph_index)
            elif is_wait(n.target) and n.args and isinstance(n.args[0], fx.Node):
                src = node_id(graph_index, n.args[0].name)
                G.nodes[nid]["collective_wait"] = src
                c = G.nodes[src].get("collective")
                if c is not None and c.wait is None:
                    G.nodes[src]["collective"] = replace(c, wait=nid)
        elif n.op == "output":
            outs, _ = _convert_arg(n.args[0], graph_index)
            flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
            outputs = flat
            G.add_node(nid, kind="output", graph=graph_index, fx_pos=pos, shape=None, dtype=None, args=(flat,))
            for a in n.all_input_nodes:
                G.add_edge(node_id(graph_index, a.name), nid)
        else:  # get_attr: a constant the step created (torch.tensor([1])...); an op that returns it
            value = getattr(gm, n.target)
            G.add_node(nid, kind="op", graph=graph_index, fx_pos=pos, shape=shape, dtype=dtype, op="get_attr",
                       target=functools.partial(_constant, value), args=(), kwargs={}, consts=(), module=None,
                       module_type=None, layer=None, source_line=None, name=n.name, frame_path="self")
    captured = CapturedGraph(
        index=graph_index,
        inputs=inputs,
        outputs=outputs,
        state_writes={},
        dynamo_node_count=dynamo_node_count,
        aten_node_count=sum(1 for n in gm.graph.nodes if n.op == "call_function"),
        break_reason=break_reason,
        gm=gm,
    )
    captured.state_writes = convert_state_writes(program, captured)
    order_collectives(program, captured)
    program.graphs.append(captured)
    renumber(program)
    return captured


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
