"""Turn the fusible regions of one captured graph into runnable kernels (shared by the NKI executors).

For every region of the graph: lower it to a kernel program, generate the NKI source (or take it from the
on-disk cache, :mod:`.kernel_cache`), and keep what the run needs: which program nodes the kernel replaces, where
each kernel argument comes from, and how model tensors become kernel arguments. A failure that one match causes
sends only that match's ops to the eager path (one warning naming it and the cause); any other failure leaves the
region (or the part of it) on the eager path with one warning naming the region and the cause.
"""
from __future__ import annotations

import dataclasses

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..program import Program
from ..settings import Settings
from ..warnings import warn
from ..codegen.errors import CodegenError
from ..codegen.lowering import lower_region
from ..codegen.megakernel import generate
from ..codegen.registry import NotADecodeStep, is_host_side, sized_tokens, step_tokens
from ..codegen.tensor import tensor_piece_refusal
from ..matching.carve import carve, in_graph
from ..matching.generic import as_generic
from .kernel_cache import cache_key, cache_root, default_cache_dir, entry_path, generate_cached  # noqa: F401

log = logging.getLogger(__name__)


@dataclass
class KernelPlan:
    region: Any
    lowered: Any  # codegen.lowering.Lowered
    generated: Any  # codegen.megakernel.GeneratedKernel
    label: str
    cache_hit: bool = False
    seconds: float = 0.0
    runner: Any = None  # set by the executor (interpreter or Neuron)
    trusted: bool = False  # verified on a real step
    disabled: bool = False  # verification failed: the region runs eagerly
    prepared: dict[str, tuple[int, int, torch.Tensor]] = field(default_factory=dict)
    cache_entry: Path | None = None  # the cache entry that served the kernel (discarded if it fails to load/verify)

    def tripped_guards(self, results: dict) -> list[str]:
        """Why this call's results cannot stand: the guards the kernel raised (see ``codegen.io.Guard``), each the
        reason of one guard output that is non-zero; empty when none was."""
        return [why for name, why in self.lowered.guards.items() if bool((results[name] != 0).any())]


def decode_tokens(program: Program, region: Any, others: list[Any] = ()) -> int:
    """Tokens per step (the batch of a decode step), as the region's lowerings size it (``tokens=`` of
    :func:`fusegraph.codegen.registry.register_lowering`); a region of generic pieces only (a graph-break
    fragment, say) is sized by the rest of the step's matches ``others`` (every graph of a step has its tokens). Raises ``NotADecodeStep`` when
    nothing sizes it, :class:`CodegenError` if the step is not a one-position decode step."""

    t = sized_tokens(region.matches, program.graph)
    return t if t is not None else step_tokens([*region.matches, *others], program.graph)


def build_plans(program: Program, graph_index: int, analysis: Any, settings: Settings) -> list[KernelPlan]:
    """The kernels of every fusible region of graph ``graph_index`` (see the module docstring)."""

    plans: list[KernelPlan] = []
    regions = [r for r in analysis.regions if graph_index in r.graphs]
    for region in regions:
        if all(is_host_side(m.pattern.template) for m in region.matches):
            continue  # rotary tables, masks, positions: computed on the fallback path by design
        label = f"region {region.id} ({region.kind}" + (f", layers {region.layers[0]}-{region.layers[-1]}" if region.layers else "") + ")"
        if len(region.graphs) > 1:
            plans += _build_cut(program, graph_index, region, label, settings, analysis.matches)
            continue
        plans += build_region(program, graph_index, region, label, settings, analysis.matches)
    return plans


def _build_cut(program: Program, graph_index: int, region: Any, label: str, settings: Settings,
               others: list[Any]) -> list[KernelPlan]:
    """A region across a graph break: its part(s) in graph ``graph_index`` (:func:`fusegraph.matching.carve.in_graph`),
    each its own kernel; the tensors crossing the break go through HBM. Logged, not warned: nothing runs eagerly
    that the region had (but a match with ops on both sides, named in the log)."""
    parts = in_graph(program, region, graph_index)
    kept = {id(m) for p in parts for m in p.matches}
    cut = [m for m in region.matches if id(m) not in kept and any(
        program.graph.nodes[n].get("graph") == graph_index for n in m.nodes)]
    log.info("%s spans a graph break: its part in graph %d runs as %d kernel(s)%s", label, graph_index, len(parts),
             f"; {', '.join(m.pattern.name for m in cut)} straddle(s) the break and run(s) eagerly" if cut else "")
    plans: list[KernelPlan] = []
    for k, part in enumerate(parts):
        if all(is_host_side(m.pattern.template) for m in part.matches):
            continue
        part_label = f"{label[:-1]}, graph {graph_index}" + (f" part {k + 1}" if len(parts) > 1 else "") + ")"
        plans += build_region(program, graph_index, part, part_label, settings, others,
                              name=f"fusegraph_g{graph_index}_r{region.id}" + (f"_c{k}" if len(parts) > 1 else ""))
    return plans


def build_region(program: Program, graph_index: int, region: Any, label: str, settings: Settings,
                 others: list[Any] = (), *, name: str | None = None, model: str = "",
                 errors: list[BaseException] | None = None) -> list[KernelPlan]:
    """The region as one kernel; when the build fails on some matches (their lowering or emission raised), the
    region without them: their ops run eagerly, with one warning each, and the rest stays in the kernel (as
    several kernels where dropping them breaks convexity, :func:`fusegraph.matching.carve.carve`). ``errors``
    receives the build errors behind the warnings (a caller that reports them, ``fusegraph kernel``)."""
    errors = errors if errors is not None else []

    try:  # the whole region sizes the step: a part left without an embedding or a norm still knows it
        tokens = decode_tokens(program, region, others)
    except NotADecodeStep as e:  # no embedding, norm or projection in the step: bare arithmetic runs as it is
        log.info("%s: %s; not a decode step, it runs as it is", label, e)
        return []
    except CodegenError as e:
        if settings.pass_through_build_failures:
            raise
        errors.append(e)
        warn(f"{label}: {e}; it runs on the eager path")
        return []
    dropped: list[Any] = []
    while True:
        parts = [region] if not dropped else carve(program, region, dropped)
        parts = [p for p in parts if any(not is_host_side(m.pattern.template) for m in p.matches)]
        plans: list[KernelPlan] = []
        failed: list[tuple[str, CodegenError]] = []
        culprits: list[tuple[Any, str]] = []
        for k, part in enumerate(parts):
            part_label = label if len(parts) == 1 else f"{label[:-1]}, part {k + 1} of {len(parts)})"
            kname = (name or f"fusegraph_g{graph_index}_r{region.id}") + (f"_p{k}" if len(parts) > 1 else "")
            try:
                plans.append(_build_kernel(program, part, tokens, kname, part_label, settings, model))
            except CodegenError as e:
                if settings.pass_through_build_failures:
                    raise
                found = _culprits(e, part)
                if not found:
                    failed.append((part_label, e))
                culprits += [c for c in found if all(c[0] is not d for d in dropped)]
        culprits, region = _generic_instead(program, region, culprits, label, settings)
        if culprits is None:
            continue  # a failed pattern's ops go to generic lowering: build again
        if culprits and len(dropped) + len(culprits) < len(region.matches):
            for m, cause in culprits:
                if all(m is not d for d in dropped):
                    dropped.append(m)
                    warn(f"{label}: {m.pattern.name} at {m.module or 'the step'} ({_ops(program, m)}) cannot be "
                         f"lowered ({cause}); it runs on the eager path, the rest of the region stays in the kernel")
            continue
        if culprits:  # nothing would be left
            failed = [(label, CodegenError(culprits[0][1]))]
            plans = []
        for part_label, e in failed:
            errors.append(e)
            warn(f"{part_label}: {e}; it runs on the eager path")
        return plans


def _build_kernel(program: Program, region: Any, tokens: int, name: str, label: str,
                  settings: Settings, model: str = "") -> KernelPlan:

    t0 = time.perf_counter()
    lowered = lower_region(program, region, tokens, name=name)
    key = cache_key(lowered.program, settings.target, settings, region)
    generated, cache_hit = generate_cached(settings, key, lowered.program.name, lambda cached: generate(
        lowered.program, target=settings.target, chunk_bytes=settings.weight_chunk_kib * 1024,
        ring=settings.weight_buffers, sbuf_budget_bytes=settings.sbuf_budget, model=model, region=label,
        cached_source=cached, lnc=settings.lnc))
    _dump(settings, name, region, generated)
    root = cache_root(settings)
    return KernelPlan(region=region, lowered=lowered, generated=generated, label=label, cache_hit=cache_hit,
                      seconds=time.perf_counter() - t0,
                      cache_entry=entry_path(root, key) if cache_hit and root is not None else None)


def _generic_instead(program: Program, region: Any, culprits: list[tuple[Any, str]], label: str,
                     settings: Settings) -> tuple[list[tuple[Any, str]] | None, Any]:
    """Patterns are the fast path, not the condition for fusing: a pattern match whose lowering failed is replaced
    by generic lowering of its own ops (the tensor path takes any shape) when that can lower them, with one warning
    (a plugin author learns their lowering failed; a user learns which op is slow). Returns ``(None, new region)``
    when some match was replaced (build again), else the culprits left to drop."""
    if not settings.generic_lowering:
        return culprits, region
    replaced = {}
    for m, cause in culprits:
        g = as_generic(program, m)
        if g is not None and tensor_piece_refusal(program.graph, g.params["piece"]) is None:
            replaced[id(m)] = g
            warn(f"{label}: {m.pattern.name} at {m.module or 'the step'} ({_ops(program, m)}) cannot be lowered "
                 f"({cause}); its ops run in the kernel through generic lowering instead")
    if not replaced:
        return culprits, region
    matches = [replaced.get(id(m), m) for m in region.matches]
    return None, dataclasses.replace(region, matches=sorted(matches, key=lambda m: m.order))


def _culprits(e: Any, region: Any) -> list[tuple[Any, str]]:
    """The matches a build error names, with its cause: the match being lowered, or the matches of the
    instructions that failed to emit (an instruction that belongs to no match fails the whole kernel)."""
    if e.match is not None:
        return [(e.match, str(e))]
    found: list[tuple[Any, str]] = []
    causes = getattr(e, "causes", ()) or (str(e),) * len(e.instructions)
    for ins, cause in zip(e.instructions, causes):
        nodes = frozenset(ins.nodes)
        m = next((m for m in region.matches if nodes and nodes <= m.nodes), None)  # a TensorOp: one node of its match
        if m is None:
            return []
        if all(m is not f for f, _ in found):
            found.append((m, cause))
    return found


def _ops(program: Program, m: Any) -> str:
    G = program.graph
    ops = sorted({G.nodes[n].get("op") for n in m.nodes if G.nodes[n].get("kind") == "op"})
    return ", ".join(ops[:3]) + (", ..." if len(ops) > 3 else "")


def _dump(settings: Settings, name: str, region: Any, generated: Any) -> None:
    if not settings.dump_dir:
        return
    d = Path(settings.dump_dir)
    d.mkdir(parents=True, exist_ok=True)
    part = name.rsplit("_p", 1)[1] if "_p" in name.rsplit("_r", 1)[-1] else ""
    (d / f"region{region.id}_{region.kind}{f'_p{part}' if part else ''}.py").write_text(generated.source)


# ---- rank agreement (tensor parallelism) ---------------------------------------------------------------------
#: outcome codes a rank reports for a kernel; every rank acts on the smallest one (the group's MIN)
FAILED, RETRY, OK = 0, 1, 2
_MSG_BYTES = 255


def covered_collectives(program: Program, plan: KernelPlan) -> list[str]:
    """The program's collective nodes a kernel computes (in program order): a kernel with any of them issues its
    collectives in lock step with every rank of their group, so its build and verification outcome must be agreed."""
    inside = plan.lowered.kernel_nodes
    return [n for n in program.collectives() if n in inside]


def collective_groups(program: Program, nodes: Any) -> list[str]:
    """The process-group names of the collective ``nodes`` (sorted, so every rank agrees on them in one order)."""
    G = program.graph
    return sorted({str(G.nodes[n]["collective"].group.name) for n in nodes})


def agree(program: Program, nodes: Any, code: int, why: str = "",
          timeout_s: float | None = None) -> tuple[int, list[tuple[int, int, str]]]:
    """Every rank of the groups of the collective ``nodes`` tells its outcome ``code`` (``FAILED``/``RETRY``/``OK``)
    and why (a short text); returns (the smallest code, [(rank, code, why) of every rank]).

    One ``all_gather`` of a small byte tensor per group over ``torch.distributed`` (gloo on CPU), bounded by
    ``timeout_s`` (default ``FUSEGRAPH_NKISIM_SYNC_TIMEOUT``, 60 s): a peer that never answers makes this rank's
    outcome ``FAILED`` ("rank agreement ... failed"), never a hang. Without a job (or groups) it is this rank's
    code (torch's fake process group hands every rank its own tensor back: the same)."""
    groups = collective_groups(program, nodes)
    try:
        import torch.distributed as dist

        up = dist.is_available() and dist.is_initialized()
    except Exception:  # noqa: BLE001 - no usable torch.distributed: nothing to agree with
        up = False
    if not groups or not up:
        return code, [(0, code, why)]
    import datetime

    from ..nkisim.sync import default_timeout

    timeout = default_timeout() if timeout_s is None else timeout_s
    msg = why.encode("utf-8", "replace")[:_MSG_BYTES]
    mine = torch.zeros(_MSG_BYTES + 1, dtype=torch.uint8)
    mine[0] = code
    mine[1:1 + len(msg)] = torch.frombuffer(bytearray(msg), dtype=torch.uint8) if msg else mine[1:1]
    worst, bad = code, {dist.get_rank(): (code, why)}
    for name in groups:
        try:
            pg = dist.distributed_c10d._resolve_process_group(name)
            size = dist.get_world_size(group=pg)
            out = torch.zeros(size * mine.numel(), dtype=torch.uint8)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            work = gather(out, mine, group=pg, async_op=True)
            if work.wait(timeout=datetime.timedelta(seconds=timeout)) is False:
                raise TimeoutError(f"no answer from every rank after {timeout:.0f} s")
        except Exception as e:  # noqa: BLE001 - a peer that cannot answer: this rank fails, bounded
            from ..warnings import one_line

            me = dist.get_rank()
            return FAILED, [(me, FAILED, f"rank agreement on group {name} failed ({one_line(e)})")]
        rows = out.reshape(size, -1)
        for r in range(size):
            c = int(rows[r, 0])
            worst = min(worst, c)
            text = bytes(rows[r, 1:].tolist()).rstrip(b"\0").decode("utf-8", "replace")
            g = dist.get_global_rank(pg, r) if pg is not dist.group.WORLD else r
            if g not in bad or c < bad[g][0]:
                bad[g] = (c, text)
    return worst, [(r, c, w) for r, (c, w) in sorted(bad.items())]


def describe_disagreement(bad: list[tuple[int, int, str]]) -> str:
    """``rank 1: <why>`` (the first failing rank's cause; the others counted) for the one warning every rank gives.
    A rank that failed only because a peer did (its collective timed out or was aborted: ``NkiSyncError``) is named
    after the ranks that failed on their own."""
    failed = [b for b in bad if b[1] == FAILED] or [b for b in bad if b[1] < OK] or bad
    failed = sorted(failed, key=lambda b: "NkiSyncError" in b[2])
    r, _, why = failed[0]
    more = f" (and rank(s) {[b[0] for b in failed[1:]]})" if len(failed) > 1 else ""
    return f"rank {r}: {why or 'failed'}{more}"
