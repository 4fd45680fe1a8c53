"""Ops that neither a pattern nor generic lowering covers, offered to the LLM kernel writer (opt-in).

After the NKI executor has planned its kernels, the ops left on the eager path are grouped into *islands*
(connected, convex groups of uncovered ops). With the LLM option on, each island becomes a
:class:`~fusegraph.llm.KernelTask` — its torch reference is generated from the island's ATen ops — and the
writer's verified kernel replaces the island's eager ops. Accepted kernels are untrusted code: they run only in
the writer's isolated, resource-limited worker process (never in this process), and any failure at run time
falls back to the island's eager ops with a warning. Rotary tables, masks and cache positions are eager by
design and never offered.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import networkx as nx
import torch

from ..program import Program
from ..program.execution import IslandRun
from ..settings import Settings
from ..warnings import warn
from .eager import build_plan, run_plan

log = logging.getLogger(__name__)

#: ops that never form an island on their own (layout only, or Python-level plumbing)
_TRIVIAL = {"getitem", "aten.view.default", "aten._unsafe_view.default", "aten.unsqueeze.default",
            "aten.squeeze.dim", "aten.alias.default", "aten.clone.default", "aten.expand.default",
            "aten.t.default", "aten.transpose.int", "aten.permute.default", "aten.reshape.default",
            "aten._to_copy.default", "aten.slice.Tensor", "get_attr"}
MAX_ISLAND_OPS = 24


@dataclass
class Island(IslandRun):
    """An island's execution record (what the report reads) plus what running it needs: the writer's task and
    result."""

    result: Any = None  # fusegraph.llm.WriterResult (its report form is the record's ``llm``)
    task: Any = None

    def set_result(self, result: Any) -> None:
        self.result = result
        self.llm = result.to_dict()


def find_islands(program: Program, graph_index: int, covered: set[str], excluded: set[str]) -> list[Island]:
    G = program.graph
    cand = {n for n in program.op_nodes(graph_index)
            if n not in covered and n not in excluded and not G.nodes[n].get("writes_state")}
    H = G.subgraph(cand)
    islands = []
    for comp in nx.weakly_connected_components(H):
        ops = [G.nodes[n]["op"] for n in comp]
        if all(o in _TRIVIAL for o in ops) or len(comp) > MAX_ISLAND_OPS:
            continue
        if not all(isinstance(G.nodes[n].get("dtype"), str) for n in comp):
            continue  # multi-output ops (topk, split): keep them eager
        nodes = tuple(sorted(comp, key=lambda n: G.nodes[n]["order"]))
        inputs: list[str] = []
        for n in nodes:
            for p in G.predecessors(n):
                if p not in comp and p not in inputs and not G.edges[p, n].get("hazard"):
                    inputs.append(p)
        outputs = tuple(n for n in nodes if any(s not in comp for s in G.successors(n)))
        if not outputs or not _convex(G, set(comp)):
            continue
        if any(not isinstance(G.nodes[p].get("dtype"), str) or G.nodes[p].get("shape") is None for p in inputs):
            continue
        counts: dict[str, int] = {}
        for o in ops:
            counts[o] = counts.get(o, 0) + 1
        islands.append(Island(nodes=nodes, inputs=tuple(inputs), outputs=outputs, ops=counts))
    return islands


def _convex(G: nx.DiGraph, comp: set[str]) -> bool:
    """No path leaves the island and comes back (then it can run as one step)."""
    frontier = [s for n in comp for s in G.successors(n) if s not in comp]
    seen = set()
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        for s in G.successors(n):
            if s in comp:
                return False
            frontier.append(s)
    return True


def _fmt(a: Any, names: dict[str, str]) -> str:
    if hasattr(a, "node"):
        return names[a.node]
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt(x, names) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, torch.dtype):
        return str(a)
    if isinstance(a, torch.device):
        return f"torch.device({str(a)!r})"
    return repr(a)


def reference_source(program: Program, island: Island, name: str) -> tuple[str, dict[str, str]]:
    """Readable torch code for the island: one ATen call per line (what the LLM is asked to implement)."""
    G = program.graph
    names = {p: f"in{i}" for i, p in enumerate(island.inputs)}
    lines = ["import torch", "aten = torch.ops.aten", "", "",
             f"def {name}({', '.join(names[p] for p in island.inputs)}):"]
    for i, p in enumerate(island.inputs):
        d = G.nodes[p]
        lines.append(f"    # {names[p]}: {d['dtype']}{list(d['shape'])}" + (f"  ({d.get('module')})" if d.get("module") else ""))
    for n in island.nodes:
        d = G.nodes[n]
        names[n] = f"v{len(names)}"
        args = [_fmt(a, names) for a in d["args"]] + [f"{k}={_fmt(v, names)}" for k, v in d["kwargs"].items()]
        op = d["op"].replace("aten.", "aten.", 1)
        lines.append(f"    {names[n]} = {op}({', '.join(args)})  # {d['dtype']}{list(d['shape'])}")
    outs = ", ".join(names[o] for o in island.outputs)
    lines.append(f"    return {outs}{',' if len(island.outputs) == 1 else ''}")
    return "\n".join(lines) + "\n", names


def make_task(program: Program, island: Island, model: str, index: int) -> Any:
    from ..llm import KernelTask, TensorSpec

    G = program.graph
    name = f"island_{index}"
    source, _ = reference_source(program, island, name)
    plan = build_plan(program, list(island.nodes))

    def reference(*tensors: torch.Tensor) -> tuple:
        env = dict(zip(island.inputs, tensors))
        run_plan(plan, env)
        return tuple(env[o] for o in island.outputs)

    def spec(n: str, prefix: str, i: int) -> Any:
        d = G.nodes[n]
        dt = getattr(torch, d["dtype"])
        return TensorSpec(name=f"{prefix}{i}", shape=tuple(int(s) for s in d["shape"]), dtype=dt,
                          index=not dt.is_floating_point,
                          value_range=(0, 2) if not dt.is_floating_point else None,
                          description=(d.get("module") or ""))

    structure = "\n".join(f"{G.nodes[n]['op']} {G.nodes[n]['shape']} {G.nodes[n]['dtype']}" for n in island.nodes)
    return KernelTask(name=name, reference_source=source, reference=reference,
                      inputs=[spec(p, "in", i) for i, p in enumerate(island.inputs)],
                      outputs=[spec(o, "out", i) for i, o in enumerate(island.outputs)],
                      model=model, structure=structure,
                      context=f"ops a decode step of {model or 'the model'} runs that fusegraph has no template for")


def write_islands(program: Program, graph_index: int, covered: set[str], excluded: set[str], settings: Settings,
                  model: str = "") -> list[Island]:
    """Ask the LLM writer for every island; return the islands (accepted or not, for the report)."""
    from ..llm import enabled, write_kernel

    if not enabled(settings):
        return []
    islands = find_islands(program, graph_index, covered, excluded)
    for i, isl in enumerate(islands):
        isl.task = make_task(program, isl, model, i)
        isl.set_result(write_kernel(isl.task, settings))
        if not isl.result.accepted:
            warn(f"LLM kernel for {', '.join(sorted(isl.ops))} not used ({isl.result.reason}); those ops run eagerly")
    return islands


def run_island(island: Island, env: dict, program: Program, settings: Settings) -> bool:
    """Run an accepted island kernel in the isolated worker; False (and the island disabled) on any failure."""
    from ..llm.harness import Limits, run_isolated

    inputs = [env[p].detach().contiguous() for p in island.inputs]
    limits = Limits(timeout_s=settings.llm_run_timeout_s, memory_mb=settings.llm_run_memory_mb)
    try:
        out = run_isolated(island.result.kernel_source, island.result.kernel_name, island.task, [("step", inputs)],
                           target=settings.target, limits=limits)
    except Exception as e:  # noqa: BLE001
        out = None
        reason = f"{type(e).__name__}: {e}"
    else:
        reason = out.reason
    if out is None or not out.ok:
        island.disabled = True
        warn(f"LLM kernel for {', '.join(sorted(island.ops))} failed at run time ({reason}); those ops run eagerly")
        return False
    G = program.graph
    for o, t in zip(island.outputs, out.outputs[0]):
        d = G.nodes[o]
        env[o] = t.reshape(d["shape"]).to(getattr(torch, d["dtype"]))
    island.calls += 1
    return True


def island_steps(steps: Sequence[Any], islands: list[Island]) -> list[Any]:
    """Replace each accepted island's eager ops by one island step (placed at its first op)."""
    accepted = [i for i in islands if i.result is not None and i.result.accepted]
    owner = {n: isl for isl in accepted for n in isl.nodes}
    out: list[Any] = []
    placed: set[int] = set()
    for st in steps:
        node = st[0] if isinstance(st, tuple) else None
        isl = owner.get(node) if node is not None else None
        if isl is None:
            out.append(st)
        elif id(isl) not in placed:
            placed.add(id(isl))
            out.append(IslandStep(isl, [s for s in steps if isinstance(s, tuple) and s[0] in set(isl.nodes)]))
    return out


@dataclass
class IslandStep:
    island: Island
    eager: list  # the island's eager ops, for fallback
