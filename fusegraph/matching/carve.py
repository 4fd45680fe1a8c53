"""Carve a region into the convex parts left when some of its matches run eagerly instead.

Codegen may fail on one match of a region at build time (a shape no template handles, say). Dropping the whole
region would send every other op to the eager path too; instead the executor rebuilds the region without that
match. The rest need not be convex any more (the match sat between two of its ops), so it is split by *depth*:
the number of dropped matches on the longest path into a node. Depth never decreases along an edge and grows
when the path leaves a dropped match, so every set of equal depth is convex: a path that leaves it and comes back
would cross a dropped match (depth grows) or stay inside the region at the same depth (so inside the set).
Each part keeps the region's id; its boundary is recomputed on the program graph.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from ..program.ir import value_nbytes as _nbytes
from .results import Boundary, Match, Region


def carve(program: Any, region: Region, without: Iterable[Match]) -> list[Region]:
    """The parts of ``region`` without the matches ``without`` (their ops left out), in execution order."""
    G = program.graph
    dropped = list(without)
    owner = {n: i for i, m in enumerate(dropped) for n in m.nodes}
    nodes = sorted(region.nodes, key=lambda n: G.nodes[n]["order"])
    inside = set(nodes)
    depth: dict[str, int] = {}
    for n in nodes:
        d = 0
        for p in G.predecessors(n):
            if p in inside:
                crossed = p in owner and owner.get(n) != owner[p]
                d = max(d, depth[p] + crossed)
        depth[n] = d
    kept = [m for m in region.matches if all(m is not x for x in dropped)]
    part_of_match = {id(m): max(depth[n] for n in m.nodes if n in depth) for m in kept if m.nodes & inside}
    levels = sorted(set(part_of_match.values()))
    parts: list[Region] = []
    for level in levels:
        matches = [m for m in kept if part_of_match.get(id(m)) == level]
        match_nodes = set().union(*(m.nodes for m in matches))
        glue = {n for n in nodes if n not in owner and depth[n] == level and n not in match_nodes
                and not any(n in m.nodes for m in kept)}
        part_nodes = match_nodes | glue
        parts.append(_part(program, region, matches, part_nodes))
    return parts


def in_graph(program: Any, region: Region, graph: int) -> list[Region]:
    """The parts of ``region`` that run in captured graph ``graph`` when the region spans a dynamo graph break.

    Why: fusegraph runs each graph of a step by itself, so a region across a break cannot be one kernel; cut at the
    break, each graph's part is a kernel of its own and the tensors crossing the break go through HBM, as they must
    (issue 31, "split, don't drop"). The part is convex in its graph: a path that leaves it and returns stays in
    the graph (graphs run in order; data only flows forward between them), so it would have left the region. A
    match with ops on both sides of the break is left out (its ops in this graph run eagerly), and what remains is
    carved into convex parts around it (:func:`carve`). Each part's ``graphs`` is ``[graph]``."""
    G = program.graph
    mine = frozenset(n for n in region.nodes if G.nodes[n].get("graph") == graph)
    if not mine:
        return []
    mine |= _between(program, graph, mine)
    kept = [m for m in region.matches if m.nodes & mine and m.nodes <= mine]
    straddling = [m for m in region.matches if m.nodes & mine and not m.nodes <= mine]
    part = dataclasses.replace(_part(program, region, kept + straddling, mine), graphs=[graph])
    parts = carve(program, part, straddling) if straddling else [part]
    return [dataclasses.replace(p, graphs=[graph]) for p in parts]


def _between(program: Any, graph: int, nodes: frozenset[str]) -> frozenset[str]:
    """Ops of ``graph`` outside ``nodes`` on a path from ``nodes`` back into them. Why there are any: a no-op a
    match folds (the dropout ``clone`` between an attention's softmax and its value matmul) stays outside the
    region when its value also crosses the break (it is an output of the graph); within one graph the part needs it
    as glue to stay convex (the tensor path lowers it; the kernel outputs its value)."""
    import networkx as nx

    G = program.graph
    ops = [n for n in program.topo_order(graph) if G.nodes[n]["kind"] == "op"]
    H = G.subgraph(ops)
    down = set().union(*(nx.descendants(H, n) for n in nodes if n in H)) - nodes
    if not down:
        return frozenset()
    up = set().union(*(nx.ancestors(H, n) for n in nodes if n in H)) - nodes
    return frozenset(down & up)


def _part(program: Any, region: Region, matches: list[Match], nodes: set[str]) -> Region:
    G = program.graph
    ordered = sorted(nodes, key=lambda n: G.nodes[n]["order"])
    inputs: dict[str, Boundary] = {}
    outputs: dict[str, Boundary] = {}
    for n in ordered:
        for p in G.predecessors(n):
            if p in nodes or G.edges[p, n].get("hazard") or p in inputs:
                continue
            d = G.nodes[p]
            inputs[p] = Boundary(p, d.get("shape"), d.get("dtype"), _nbytes(d.get("shape"), d.get("dtype")),
                                 "activation", d.get("module"))
        if any(s not in nodes and not G.edges[n, s].get("hazard") for s in G.successors(n)):
            d = G.nodes[n]
            outputs[n] = Boundary(n, d.get("shape"), d.get("dtype"), _nbytes(d.get("shape"), d.get("dtype")),
                                  "activation", d.get("module"))
    match_nodes = set().union(*(m.nodes for m in matches)) if matches else set()
    glue_nodes = tuple(n for n in ordered if n not in match_nodes and G.nodes[n]["kind"] == "op")
    return dataclasses.replace(
        region, matches=sorted(matches, key=lambda m: m.order), nodes=frozenset(nodes), inputs=list(inputs.values()),
        outputs=list(outputs.values()), glue_nodes=glue_nodes,
        layers=sorted({m.layer for m in matches if m.layer is not None}),
        state_writes=sorted({G.nodes[n]["writes_state"] for n in nodes if G.nodes[n].get("writes_state")}),
        glue={}, op_count=sum(1 for n in nodes if G.nodes[n]["kind"] == "op"))


__all__ = ["carve", "in_graph"]
