"""Order a graph's work when some regions run as kernels: each kernel is one step, other ops run eagerly.

Kernel regions are contracted to single nodes of the graph's DAG; a topological order of the contracted DAG is
the schedule. A region that is not convex (an outside op both consumes a kernel value and feeds the kernel)
would make a cycle: that kernel is dropped and its ops run eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import networkx as nx

from ..program import Program


@dataclass
class KernelSlot:
    """A placeholder in the schedule for kernel ``index`` of the plan list."""

    index: int


def build_schedule(program: Program, graph_index: int, kernel_nodes: Sequence[frozenset[str]]) -> tuple[list, list[int]]:
    """Return (schedule, dropped): schedule items are op node ids or :class:`KernelSlot`; ``dropped`` lists the
    kernels that could not be scheduled (non-convex)."""
    G = program.graph
    ops = [n for n in program.topo_order(graph_index) if G.nodes[n]["kind"] == "op"]
    active = list(range(len(kernel_nodes)))
    dropped: list[int] = []
    while True:
        owner: dict[str, Any] = {}
        for k in active:
            for n in kernel_nodes[k]:
                owner[n] = ("k", k)
        H = nx.DiGraph()
        order: dict[Any, int] = {}
        for n in ops:
            g = owner.get(n, n)
            H.add_node(g)
            order[g] = min(order.get(g, 1 << 60), G.nodes[n]["order"])
        for n in ops:
            a = owner.get(n, n)
            for s in G.successors(n):
                if s in H or s in owner:
                    b = owner.get(s, s)
                    if a != b and b in H:
                        H.add_edge(a, b)
        try:
            seq = list(nx.lexicographical_topological_sort(H, key=lambda g: order[g]))
        except nx.NetworkXUnfeasible:
            cycle = nx.find_cycle(H)
            bad = next(g for e in cycle for g in e if isinstance(g, tuple))
            active.remove(bad[1])
            dropped.append(bad[1])
            continue
        schedule = [KernelSlot(g[1]) if isinstance(g, tuple) else g for g in seq]
        return schedule, dropped
