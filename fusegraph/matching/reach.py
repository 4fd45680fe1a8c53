"""Reachability bitsets over the step's ordering graph, for convexity checks of matches and regions.

A fused region must be *convex*: no path may leave it and come back (that outside node would have to run both
before and after the region). With ancestors/descendants as Python ints used as bitsets, "is the union of these
groups convex" is a couple of big-int ORs and one AND, so region formation stays linear-ish even for a 48-layer
step with 7k nodes.

The ordering graph is the canonical data graph plus everything that orders execution without carrying a value:
hazard edges (a reader of a state before its in-place write), a pseudo node per dynamo graph break standing for
the Python code between the graphs (fed by tensors that code computed on, feeding the inputs it produced), and
edges from a state's in-place writer in one graph to the same state's input in a later graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from ..program import InputKind
from .canonicalize import CanonicalView


@dataclass
class Reach:
    graph: nx.DiGraph
    index: dict[str, int]
    nodes: list[str]
    anc: list[int]
    desc: list[int]
    glue_nodes: dict[int, str] = field(default_factory=dict)  # break pseudo node -> description

    def bits(self, nodes) -> int:
        b = 0
        for n in nodes:
            b |= 1 << self.index[n]
        return b

    def ancestors(self, nodes) -> int:
        a = 0
        for n in nodes:
            a |= self.anc[self.index[n]]
        return a

    def descendants(self, nodes) -> int:
        d = 0
        for n in nodes:
            d |= self.desc[self.index[n]]
        return d

    def witness(self, bad: int) -> str:
        """The first (topologically) node of a non-empty bitset."""
        low = (bad & -bad).bit_length() - 1
        return self.nodes[low]


def build_reach(cv: CanonicalView) -> Reach:
    G = cv.program.graph
    O = nx.DiGraph()
    O.add_nodes_from(cv.data.nodes)
    O.add_edges_from(cv.data.edges)
    prog = cv.program
    # Python glue between graphs: values it mutated/computed on go in, inputs it may have produced come out
    glue_of: dict[int, str] = {}
    for link in prog.links:
        if link.glue_free:
            continue
        g = f"python-glue-after-g{link.src_graph}"
        glue_of.setdefault(link.src_graph, g)
        O.add_edge(cv.rep.get(link.src_node, link.src_node), g)
        O.add_edge(g, cv.rep.get(link.dst_node, link.dst_node))
    for cg in prog.graphs:
        if cg.index == 0:
            continue
        for pin in cg.inputs:
            if pin.kind == InputKind.SCALAR and pin.node in O:
                g = glue_of.setdefault(cg.index - 1, f"python-glue-after-g{cg.index - 1}")
                O.add_edge(g, pin.node)
    # a state written in place in one graph and read by a later graph: order the write first
    writers: dict[str, str] = {}
    for cg in prog.graphs:
        for pin in cg.inputs:
            if pin.kind == InputKind.STATE and pin.source in writers and pin.node in O:
                w = writers[pin.source]
                if w in O and w != pin.node:
                    O.add_edge(w, pin.node)
        for state, writer in cg.state_writes.items():
            src = G.nodes[state].get("source")
            if src:
                writers[src] = cv.rep.get(writer, writer)
    order = {n: d.get("order", 0) for n, d in cv.data.nodes(data=True)}
    nodes = list(nx.lexicographical_topological_sort(O, key=lambda n: (order.get(n, 1 << 30), str(n))))
    index = {n: i for i, n in enumerate(nodes)}
    anc = [0] * len(nodes)
    for i, n in enumerate(nodes):
        a = 0
        for p in O.pred[n]:
            j = index[p]
            a |= anc[j] | (1 << j)
        anc[i] = a
    desc = [0] * len(nodes)
    for i in range(len(nodes) - 1, -1, -1):
        d = 0
        for s in O.succ[nodes[i]]:
            j = index[s]
            d |= desc[j] | (1 << j)
        desc[i] = d
    glue = {index[g]: g for g in glue_of.values() if g in index}
    return Reach(graph=O, index=index, nodes=nodes, anc=anc, desc=desc, glue_nodes=glue)
