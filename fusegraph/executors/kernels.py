"""Turn the fusible regions of one captured graph into runnable kernels (shared by the NKI executors).

For every region of the graph: lower it to a kernel program, generate the NKI source (or take it from the
on-disk cache, :mod:`.kernel_cache`), and keep what the run needs: which program nodes the kernel replaces, where
each kernel argument comes from, and how model tensors become kernel arguments. Any failure leaves that region on the
eager path with one warning naming the region and the cause.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..program import Program
from ..settings import Settings
from ..warnings import warn
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


def _tokens(program: Program, region: Any) -> int:
    """Tokens per step (the batch of a decode step); raises if the region is not a one-position decode step."""
    from ..codegen.errors import CodegenError

    G = program.graph
    for m in region.matches:
        if m.pattern.template == "embedding":
            shape = G.nodes[m.inputs["indices"]]["shape"]
            if len(shape) == 2 and shape[1] != 1:
                raise CodegenError(f"a step over {shape[1]} positions is not a decode step (prefill runs eagerly)")
            return int(shape[0])
    for m in region.matches:
        if m.pattern.template in ("rmsnorm", "linear") and "x" in m.inputs:
            shape = G.nodes[m.inputs["x"]]["shape"]
            if len(shape) == 3 and shape[1] != 1:
                raise CodegenError(f"a step over {shape[1]} positions is not a decode step (prefill runs eagerly)")
            return int(shape[0]) if len(shape) >= 2 else 1
    names = ", ".join(sorted({m.pattern.name.split(".")[-1] for m in region.matches}))
    raise CodegenError(f"a fragment without an embedding, norm or projection to size the decode step from "
                       f"({names}) is not lowered")


def build_plans(program: Program, graph_index: int, analysis: Any, settings: Settings) -> list[KernelPlan]:
    from ..codegen.errors import CodegenError
    from ..codegen.lowering import lower_region
    from ..codegen.megakernel import generate

    plans: list[KernelPlan] = []
    regions = [r for r in analysis.regions if graph_index in r.graphs]
    from ..codegen.lowering import HOST_SIDE

    for region in regions:
        if all(m.pattern.template in HOST_SIDE for m in region.matches):
            continue  # rotary tables, masks, positions: computed on the fallback path by design
        label = f"region {region.id} ({region.kind}" + (f", layers {region.layers[0]}-{region.layers[-1]}" if region.layers else "") + ")"
        if len(region.graphs) > 1:
            warn(f"{label} spans a graph break; fusegraph runs each graph separately, so it stays on the eager path")
            continue
        t0 = time.perf_counter()
        try:
            tokens = _tokens(program, region)
            lowered = lower_region(program, region, tokens, name=f"fusegraph_g{graph_index}_r{region.id}")
            key = cache_key(lowered.program, settings.target, settings, region)
            generated, cache_hit = generate_cached(settings, key, lowered.program.name, lambda cached: generate(
                lowered.program, target=settings.target, chunk_bytes=settings.weight_chunk_kib * 1024,
                ring=settings.weight_buffers, sbuf_budget_bytes=settings.sbuf_budget, region=label,
                cached_source=cached, lnc=settings.lnc))
            _dump(settings, label, region, generated)
        except CodegenError as e:
            if settings.pass_through_build_failures:
                raise
            warn(f"{label}: {e}; it runs on the eager path")
            continue
        root = cache_root(settings)
        plans.append(KernelPlan(region=region, lowered=lowered, generated=generated, label=label,
                                cache_hit=cache_hit, seconds=time.perf_counter() - t0,
                                cache_entry=entry_path(root, key) if cache_hit and root is not None else None))
    return plans


def _dump(settings: Settings, label: str, region: Any, generated: Any) -> None:
    if not settings.dump_dir:
        return
    d = Path(settings.dump_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"region{region.id}_{region.kind}.py").write_text(generated.source)
