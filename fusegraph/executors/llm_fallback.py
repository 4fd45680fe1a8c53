"""Ops that neither a pattern nor generic lowering covers, offered to the LLM kernel writer (opt-in).

Ops outside every region are grouped into *islands* (connected, convex groups of uncovered ops). With the LLM
option on, each island becomes a :class:`~fusegraph.llm.KernelTask` — its torch reference is generated from the
island's ATen ops — and the writer is asked for a verified kernel. Rotary tables, masks and cache positions are
eager by design and never offered.

Order (:func:`plan_inline`, before any kernel is built): regions form; the ops left between and around them
become island candidates; the writer runs (its cache makes a second compile free); each accepted island becomes
an ``llm_island`` match (lowered by the ``llm_island`` op, ``patterns/llm_island/``) and regions form again, so the island sits
*inside* the megakernel and the step stays one launch. Islands that end up in no kernel (nothing to fuse them
with, or their kernel build refused them) and ops a failed build left on the eager path (:func:`write_islands`,
after the kernels are planned) keep the older path: the accepted kernel runs only in the writer's isolated,
resource-limited worker process, and any failure at run time falls back to the island's eager ops with a warning.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import networkx as nx
import torch

from ..program import Program
from ..program.execution import IslandRun
from ..settings import Settings
from ..warnings import warn
from ..codegen.inline_source import InlineSource
from ..codegen.registry import is_host_side
from ..llm import enabled, KernelTask, TensorSpec
from ..llm import writer as llm_writer
from ..llm.harness import Limits, run_isolated, static_checks
from ..matching.pattern import Pattern
from ..matching.regions import with_extra_matches
from ..matching.results import Match
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
    result, and the kernel it was inlined into (None: it runs in the isolated worker, or eagerly)."""

    result: Any = None  # fusegraph.llm.WriterResult (its report form is the record's ``llm``)
    task: Any = None
    plan: Any = None  # the KernelPlan whose megakernel computes the island (inlined)
    match: Any = None  # its ``llm_island`` match, when region formation took it
    executor: str = "nkisim"

    def set_result(self, result: Any) -> None:
        self.result = result
        self.llm = result.to_dict()

    @property
    def inlined(self) -> bool:
        return self.plan is not None

    @property
    def inlined_match(self) -> Any:
        """The ``llm_island`` match of an island a running kernel holds (what a report re-forms its regions with)."""
        return self.match if self.inlined else None

    @property
    def runs_kernel(self) -> bool:
        """Runs as a launch of its own (an inlined island is part of its megakernel's launch)."""
        return self.accepted and not self.disabled and not self.inlined

    @property
    def executed_by(self) -> str:
        """``<executor> (llm)`` inside a running megakernel, ``llm worker`` in the isolated worker, else eager."""
        if self.inlined:
            return f"{self.executor} (llm)" if not self.plan.disabled else "eager"
        return "llm worker" if self.runs_kernel else "eager"

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["executed_by"] = self.executed_by
        if self.inlined:
            d["kernel"] = self.plan.generated.name
        return d


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
                  model: str = "", known: Sequence[Island] = ()) -> list[Island]:
    """Ask the LLM writer for every island; return the islands (accepted or not, for the report). An island
    already written before the kernels were built (``known``, same ops) keeps its answer: no second request,
    no second warning."""

    if not enabled(settings):
        return []
    prior = {isl.nodes: isl for isl in known if not isl.inlined}
    islands = find_islands(program, graph_index, covered, excluded)
    for i, isl in enumerate(islands):
        if isl.nodes in prior:
            islands[i] = isl = prior[isl.nodes]
            if isl.result is not None and isl.result.accepted and not text_unchanged(isl):
                isl.disabled = True  # refused at inlining for this reason (warned there): never run it elsewhere
            continue
        isl.task = make_task(program, isl, model, i + len(known))
        isl.set_result(llm_writer.write_kernel(isl.task, settings))  # through the module: tests replace it
        if not isl.result.accepted:
            warn(f"LLM kernel for {', '.join(sorted(isl.ops))} not used ({isl.result.reason}); those ops run eagerly")
    return islands


# ---- islands inside the megakernel ---------------------------------------------------------------------------
def _no_reference(*args: Any, **kwargs: Any) -> Any:  # an island's reference is its own ATen ops
    raise NotImplementedError("an LLM island is verified against its own ATen ops")


def island_pattern() -> Any:
    """The pattern ``llm_island`` matches name (they come from the writer, never from the matcher)."""

    return Pattern(name="fusegraph.llm_island", fn=_no_reference, inputs=(), template="llm_island", priority=-1000,
                   description="an accepted LLM-written kernel, inlined into the megakernel", source="fusegraph")


class IslandReference:
    """The island's ATen ops as a callable (the reference VM's implementation of an ``llm_island``); its repr is
    the island's structure hash, so kernel cache keys stay stable across processes."""

    def __init__(self, fn: Any, structure: str) -> None:
        self.fn = fn
        self.key = hashlib.sha256(structure.encode()).hexdigest()[:16]

    def __call__(self, *tensors: torch.Tensor) -> tuple:
        return self.fn(*tensors)

    def __repr__(self) -> str:
        return f"IslandReference({self.key})"


def _recheck(task: Any) -> Any:
    """The writer's static checks (parse, allow-list, conformance, contract) on a text, for inlining time."""

    def recheck(source: str) -> str | None:
        _, bad = static_checks(source, task)
        return None if bad is None else f"{bad.stage}: {bad.reason}"

    return recheck


def island_match(program: Program, cv: Any, island: Island, match_id: int) -> Any:
    """An accepted island as an ``llm_island`` match over the canonical view (like generic pieces)."""

    G = program.graph
    res = island.result
    structure = island.task.structure if island.task is not None else ""
    spec = InlineSource(source=res.kernel_source, sha256=res.sha256, entry=res.kernel_name, inputs=island.inputs,
                        outputs=island.outputs, recheck=_recheck(island.task),
                        reference=IslandReference(island.task.reference, structure),
                        what=", ".join(sorted(island.ops)))

    def canonical(nodes: Sequence[str]) -> list[str]:
        out: list[str] = []
        for n in nodes:
            c = cv.rep.get(n, n)
            if c in cv.data and c not in out:
                out.append(c)
        return out

    canon = canonical(island.nodes)
    first = island.nodes[0]
    return Match(pattern=island_pattern(), variant="llm", nodes=frozenset(island.nodes),
                 inputs={f"in{i}": n for i, n in enumerate(canonical(island.inputs))},
                 outputs={f"out{i}": n for i, n in enumerate(canonical(island.outputs))},
                 params={"inline": spec, "ops": dict(island.ops)}, layer=G.nodes[first].get("layer"),
                 module=G.nodes[first].get("module"), mapping={f"n{i}": c for i, c in enumerate(sorted(canon))},
                 graphs=tuple(sorted({G.nodes[n]["graph"] for n in island.nodes})),
                 order=min(G.nodes[n]["order"] for n in island.nodes), id=match_id)


def plan_inline(program: Program, graph_index: int, analysis: Any, settings: Settings,
                model: str = "") -> tuple[Any, list[Island]]:
    """Before the kernels are built: offer the ops outside every region to the writer and form the regions again
    with each accepted island as an ``llm_island`` match (see the module doc). Returns the analysis the kernels
    are built from and the islands written (accepted or not). An island whose region would hold nothing but
    islands is left out (nothing to fuse it with): it keeps the isolated worker."""

    if not enabled(settings) or analysis.view is None or analysis.reach is None:
        return analysis, []
    excluded = {n for m in analysis.matches if is_host_side(m.pattern.template) for n in m.nodes}
    islands = find_islands(program, graph_index, set(analysis.region_of), excluded)
    for i, isl in enumerate(islands):
        isl.task = make_task(program, isl, model, i)
        isl.set_result(llm_writer.write_kernel(isl.task, settings))  # through the module: tests replace it
        if not isl.result.accepted:
            warn(f"LLM kernel for {', '.join(sorted(isl.ops))} not used ({isl.result.reason}); those ops run eagerly")
    accepted = [isl for isl in islands if isl.result.accepted and isl.result.sha256]
    if not accepted:
        return analysis, islands
    if settings.lnc != 1:  # an island is written for one core; an LNC=2 kernel would run it on both
        log.info("graph %d: lnc=%d: LLM islands are not inlined; they run in the isolated worker", graph_index,
                 settings.lnc)
        return analysis, islands
    next_id = max((m.id for m in analysis.matches), default=-1) + 1
    try:
        for k, isl in enumerate(accepted):
            isl.match = island_match(program, analysis.view, isl, next_id + k)
        new, used = with_island_matches(analysis, [isl.match for isl in accepted])
    except Exception as e:  # noqa: BLE001 - inlining is an optimization: the islands keep the isolated worker
        if settings.pass_through_build_failures:
            raise
        for isl in accepted:
            isl.match = None
        warn(f"graph {graph_index}: LLM islands could not join the regions ({type(e).__name__}: {e}); they run in "
             "the isolated worker")
        log.debug("plan_inline failure", exc_info=e)
        return analysis, islands
    for isl in accepted:
        if all(isl.match is not m for m in used):
            isl.match = None  # nothing to fuse it with: it keeps the isolated worker
    log.info("graph %d: %d LLM island(s) offered to region formation", graph_index, len(used))
    return new, islands


def with_island_matches(analysis: Any, extra: Sequence[Any]) -> tuple[Any, list[Any]]:
    """``analysis`` with its regions formed again with the ``llm_island`` matches ``extra``; an island whose region
    would hold nothing but islands and host-side matches is left out (see
    :func:`fusegraph.matching.regions.with_extra_matches`)."""

    def fuses(m: Any) -> bool:
        return m.pattern.template != "llm_island" and not is_host_side(m.pattern.template)

    return with_extra_matches(analysis, list(extra), fuses,
                              note="accepted LLM-written kernel offered to region formation (inlined in the kernel)")


def bind_inlined(islands: Sequence[Island], plans: Sequence[Any], active: set[int], executor: str) -> None:
    """Mark each island a running kernel computes as inlined in it (the report's ``executed_by``)."""
    for isl in islands:
        isl.executor = executor
        for k, p in enumerate(plans):
            if k in active and isl.result is not None and isl.result.accepted and set(isl.nodes) <= set(
                    p.lowered.kernel_nodes):
                isl.plan = p
                break


def text_unchanged(island: Island) -> bool:
    """Is the accepted kernel's text still the one that passed verification (its recorded SHA-256)?"""

    res = island.result
    return bool(res is not None and res.kernel_source is not None and res.sha256
                and llm_writer.source_sha256(res.kernel_source) == res.sha256)


def run_island(island: Island, env: dict, program: Program, settings: Settings) -> bool:
    """Run an accepted island kernel in the isolated worker; False (and the island disabled) on any failure."""

    if not text_unchanged(island):
        island.disabled = True
        warn(f"LLM kernel for {', '.join(sorted(island.ops))} changed after verification (SHA-256 mismatch); "
             "it is not run, those ops run eagerly")
        return False
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
