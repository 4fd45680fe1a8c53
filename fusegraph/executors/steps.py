"""The executable steps of a compiled graph: its schedule (kernel slots and eager ops in program order) turned
into what runs, checking that every eager op finds its inputs."""
from __future__ import annotations

from typing import Sequence

import torch

from ..program import Program
from .eager import build_plan
from .kernels import KernelPlan
from .schedule import KernelSlot


def build_steps(program: Program, graph_index: int, plans: Sequence[KernelPlan], active: set[int], schedule: list,
                input_ids: Sequence[str]) -> tuple[list, tuple[int, str] | None]:
    """Schedule items -> executable steps (``KernelSlot`` for an active kernel, eager op plans otherwise); or, when
    an eager op (or a graph output) needs a value an active kernel computes but does not output, ``(kernel index,
    node)`` naming it (the caller drops that kernel and builds again)."""
    G = program.graph
    available = set(input_ids)
    owner: dict[str, int] = {}
    steps: list = []
    for item in schedule:
        if isinstance(item, KernelSlot) and item.index in active:
            plan = plans[item.index]
            for src in plan.lowered.args.values():
                if src.node not in available:
                    return [], (item.index, src.node)
            steps.append(item)
            for n in plan.lowered.kernel_nodes:
                owner[n] = item.index
            available |= set(plan.lowered.outputs.values())
            available |= {n for n in plan.lowered.kernel_nodes if G.nodes[n].get("writes_state")}
            continue
        nodes = ([item] if not isinstance(item, KernelSlot) else
                 sorted(plans[item.index].lowered.kernel_nodes, key=lambda n: G.nodes[n]["order"]))
        for n in nodes:
            if n in available:  # produced by a kernel already
                continue
            for a in G.predecessors(n):
                if G.edges[a, n].get("hazard") or G.nodes[a]["graph"] != G.nodes[n]["graph"]:
                    continue
                if a not in available and a in owner:
                    if not _empty(G.nodes[a]):
                        return [], (owner[a], a)
                    steps.append(_empty_step(a, G.nodes[a]))
                    available.add(a)
            steps.extend(build_plan(program, [n]))
            available.add(n)
    for o in program.captured(graph_index).outputs:
        node = getattr(o, "node", None)
        if node is not None and node not in available and node in owner:
            if not _empty(G.nodes[node]):
                return [], (owner[node], node)
            steps.append(_empty_step(node, G.nodes[node]))
            available.add(node)
    return steps, None


def _empty(d: dict) -> bool:
    """A value with no elements (Inkling-2's ``new_zeros(..., 0, ...)`` cat operand): nothing to hand over, so a
    kernel need not output it; the eager op that reads it gets a fresh empty tensor of its shape and type."""
    shape = d.get("shape")
    return (isinstance(shape, tuple) and any(isinstance(s, int) and s == 0 for s in shape)
            and isinstance(d.get("dtype"), str))


def _empty_step(node: str, d: dict) -> tuple:
    """An eager step making ``node``'s empty value (on the device of the step's tensors)."""
    shape, dtype = tuple(d["shape"]), getattr(torch, d["dtype"])

    def kwargs(env: dict) -> dict:
        device = next((v.device for v in env.values() if isinstance(v, torch.Tensor)), None)
        return {"dtype": dtype, "device": device}
    return (node, torch.empty, lambda env: (shape,), kwargs)
