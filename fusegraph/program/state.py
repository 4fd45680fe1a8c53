"""Represent the step's writes of state (KV cache, cache-length counters) as in-place ops.

aot_autograd functionalizes ``cache.index_copy_(...)`` into a functional ``index_copy`` and, with
``keep_inference_input_mutations=True``, a trailing ``copy_(cache, new_value)``. Read literally that is "build a
whole new cache, then copy it over the old one": fine for a CPU, wasteful for codegen, which must write the new
rows into the cache in HBM directly. So the functional producer becomes its in-place variant
(``index_copy_``), the ``copy_`` disappears, and every reader of the *old* value gets a hazard edge that orders it
before the write. Where that is impossible (a reader of the old value depends on the write) the ``copy_`` stays
as an explicit state-write node.

Collectives are the other side effect of a step (tensor parallelism, ``docs/tp.md``): :func:`order_collectives`
chains those of one process group with hazard edges, so they keep their program order wherever ops are moved.
"""
from __future__ import annotations

import logging

import networkx as nx
import torch

from .ir import CapturedGraph, InputKind, Program, Ref

log = logging.getLogger(__name__)

_COPY = "aten.copy_.default"


def _inplace_variant(target: object) -> object | None:
    if not isinstance(target, torch._ops.OpOverload):
        return None
    packet = target.overloadpacket.__name__
    if packet.endswith("_"):
        return None
    inplace = getattr(torch.ops.aten, packet + "_", None)
    if inplace is None:
        return None
    return getattr(inplace, target._overloadname, None)


def _swap(template: object, old: str, new: str) -> object:
    """``template`` with every Ref to ``old`` pointing at ``new`` (copy_ returns its destination, so readers of
    a removed copy_ read the in-place producer's value)."""
    if isinstance(template, Ref):
        return Ref(new, template.index) if template.node == old else template
    if isinstance(template, (list, tuple)):
        return type(template)(_swap(t, old, new) for t in template)
    if isinstance(template, dict):
        return {k: _swap(v, old, new) for k, v in template.items()}
    return template


def _replace_refs(d: dict, old: str, new: str) -> None:
    for key in ("args", "kwargs"):
        if key in d:
            d[key] = _swap(d[key], old, new)


def _readers(G: nx.DiGraph, node: str) -> list[str]:
    return [s for s in G.successors(node) if G.nodes[s]["kind"] == "op"]


def convert_state_writes(program: Program, captured: CapturedGraph) -> dict[str, str]:
    """Rewrite ``copy_(input, value)`` pairs of one graph; return {state input node: node leaving final value}."""
    G = program.graph
    gi = captured.index
    writes: dict[str, str] = {}
    copies = [n for n, d in G.nodes(data=True) if d["graph"] == gi and d["kind"] == "op" and d["op"] == _COPY]
    for cp in copies:
        d = G.nodes[cp]
        dst, src = d["args"][0], d["args"][1]
        if not (isinstance(dst, Ref) and isinstance(src, Ref)) or G.nodes[dst.node]["kind"] != "input":
            continue  # a copy_ into an intermediate: an ordinary op
        state = dst.node
        G.nodes[state]["input_kind"] = InputKind.STATE
        for pin in captured.inputs:
            if pin.node == state:
                pin.kind = InputKind.STATE
        producer = src.node
        pd = G.nodes[producer]
        inplace = _inplace_variant(pd.get("target"))
        first = pd.get("args", (None,))[0] if pd["kind"] == "op" and pd.get("args") else None
        same_meta = pd.get("shape") == G.nodes[state].get("shape") and pd.get("dtype") == G.nodes[state].get("dtype")
        old_readers = [r for r in _readers(G, state) if r not in (producer, cp)]
        if (
            inplace is not None
            and isinstance(first, Ref)
            and first.node == state
            and same_meta
            and not any(nx.has_path(G, producer, r) for r in old_readers)
        ):
            # in place: producer writes the state; old-value readers must run first
            pd["op"] = str(inplace)
            pd["target"] = inplace
            pd["writes_state"] = state
            for r in old_readers:
                G.add_edge(r, producer, hazard=True)
            for s in list(G.successors(cp)):
                G.add_edge(producer, s)
                _replace_refs(G.nodes[s], cp, producer)
            captured.outputs = [_swap(o, cp, producer) for o in captured.outputs]
            G.remove_node(cp)
            writes[state] = producer
            log.debug("graph %d: %s writes state %s in place", gi, pd["op"], state)
        else:
            d["writes_state"] = state
            for r in old_readers:
                if r != cp and not nx.has_path(G, cp, r):
                    G.add_edge(r, cp, hazard=True)
            writes[state] = cp
    return writes


def order_collectives(program: Program, captured: CapturedGraph) -> list[tuple[str, str]]:
    """Chain the functional collectives of each process group in program order with hazard edges.

    A collective is a side effect shared by every rank of its group: all of them must issue the group's
    collectives in the same order, or the job deadlocks or mixes up tensors. The ATen graph only orders them by
    data flow (two independent all-reduces could legally swap places in a topological order, differently on two
    ranks whose kernels cover different ops), so, like state writes, each collective gets a hazard edge from the
    previous one of its group. Returns the edges added."""
    G = program.graph
    gi = captured.index
    last: dict[str, str] = {}
    added: list[tuple[str, str]] = []
    nodes = sorted((n for n, d in G.nodes(data=True) if d["graph"] == gi and d.get("collective") is not None),
                   key=lambda n: G.nodes[n]["fx_pos"])
    for n in nodes:
        group = G.nodes[n]["collective"].group.name
        prev = last.get(group)
        if prev is not None and not G.has_edge(prev, n):
            G.add_edge(prev, n, hazard=True, collective=True)
            added.append((prev, n))
        last[group] = n
    if nodes:
        log.debug("graph %d: %d collectives over %d group(s), %d ordering edges", gi, len(nodes), len(last), len(added))
    return added
