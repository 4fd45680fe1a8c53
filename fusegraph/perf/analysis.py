"""One built megakernel, modeled: its shape-only profile, its counters, every strategy on it, its attribution.

:class:`KernelBuild` is the record of a kernel the pipeline built (:func:`fusegraph.api.build_for_target` makes
it); this module profiles it in the interpreter's shape-only mode with the executor's settings, costs the
strategies on the same cost model and attributes kernel lines to patterns, ATen ops and model modules. It needs
the interpreter and the generated kernel only, never a capture: building a model's kernel and the benchmark
around it are :mod:`fusegraph.modelperf.analysis`, above the API.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import baselines
from .costmodel import Estimate, estimate_kernel
from .kernelview import KernelView
from .params import HardwareParams, load_params
from .progress import KernelLineMonitor, Progress

if TYPE_CHECKING:  # the record's field types; importing codegen and matching is not needed to cost a build
    from ..codegen.lowering import Lowered
    from ..codegen.megakernel import GeneratedKernel
    from ..matching import Analysis, Region
    from ..program import Program

log = logging.getLogger(__name__)

#: the like-for-like configuration of the published figures: TP=4 x LNC=2 = 8 physical cores
PUBLISHED_CORES = 8


@dataclass
class KernelBuild:
    """A decode-step megakernel generated exactly as the NKI executor generates it, what it came from and, once
    profiled, its shape-only profile and the cost model's view of that profile.

    The one record of a built kernel: :func:`fusegraph.api.build_for_target` fills the codegen part (and the
    profile when asked); :func:`fusegraph.modelperf.analysis.build_kernels` adds the model config, its own
    profile (:func:`profile_shape_only`) and the view.
    """

    model: str
    target: str
    program: Program  # the captured program
    analysis: Analysis  # the matcher's analysis of it
    region: Region  # the region the kernel computes (the decoder stack)
    lowered: Lowered
    generated: GeneratedKernel
    profile: dict[str, Any] | None = None  # the interpreter's shape-only profile (``Profile.to_dict()``)
    timings: dict[str, float] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)  # the bundled model's config (sizes the limits)
    view: KernelView | None = None  # the kernel source and profile as the cost model reads them
    notes: list[str] = field(default_factory=list)

    def kernel_source(self) -> str:
        return self.generated.source


def one_line_reason(e: BaseException) -> str:
    """``Type: first line of the message`` (a refusal's reason for a table cell; the traceback goes to the debug
    log)."""
    text = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def model_config(model: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The bundled config of ``model`` as a dict (with ``model_type``), plus ``overrides``."""
    from fusegraph.models import MODELS

    if model not in MODELS:
        raise KeyError(f"unknown model {model!r}; bundled: {', '.join(MODELS)}")
    spec = MODELS[model]
    cfg = dict(spec.config)
    cfg.setdefault("model_type", spec.family)
    cfg.setdefault("dtype", spec.dtype)
    cfg.update(overrides or {})
    return cfg


def shard_overrides(config: dict[str, Any], cores: int) -> dict[str, Any]:
    """Config of one core's shard under tensor parallelism over ``cores`` physical cores: a SYNTHETIC shard (the
    model config divided, no collectives). The real per-rank program -- HF's TP plan captured on a fake process
    group, local shards and collectives -- is :mod:`fusegraph.modelperf.tp`; this one remains for the per-engine
    calibration rows of the like-for-like table.

    Heads, MLP/expert intermediate sizes and the vocabulary (padded to a multiple of 128, as sharded deployments
    pad it) split ``cores`` ways; KV heads split as far as they go and are replicated beyond that; the hidden size,
    the experts and top-k stay. This is how the published TP=4 x LNC=2 runs divide the work, assuming the two
    physical cores of a logical core split it evenly (the split inside a logical core is not published).
    """
    out: dict[str, Any] = {}
    Hq = int(config["num_attention_heads"])
    Hkv = int(config.get("num_key_value_heads", Hq))
    out["num_attention_heads"] = max(1, Hq // cores)
    out["num_key_value_heads"] = max(1, Hkv // cores)
    if "head_dim" not in config:
        out["head_dim"] = int(config["hidden_size"]) // Hq
    for key in ("intermediate_size", "moe_intermediate_size"):
        if config.get(key):
            out[key] = max(1, int(config[key]) // cores)
    out["vocab_size"] = int(math.ceil(int(config["vocab_size"]) / cores / 128) * 128)
    return out


def profile_shape_only(generated: Any, target: str, progress: Progress | None = None,
                       layers: int | None = None, settings: Any = None) -> dict[str, Any]:
    """Run ``generated`` in the interpreter's shape-only mode (with ``settings``' SBUF budget and LNC, as the
    executor runs it); return the profile as a dict."""
    from fusegraph import nkisim

    args = _abstract_args(generated)
    ns = nkisim.load_kernel_source(generated.source, f"<fusegraph:{generated.name}>", target=target)
    fn = ns[generated.name]
    progress = progress or Progress(False)
    total = layers if layers is not None else len(generated.program.layers())
    kwargs: dict[str, Any] = {}
    if settings is not None:
        kwargs["lnc"] = settings.lnc
        if settings.sbuf_budget:
            kwargs["sbuf_budget"] = settings.sbuf_budget
    with KernelLineMonitor(generated.source, generated.name, progress.update, total):
        nkisim.run(fn, *args, target=target, shape_only=True, **kwargs)
    return nkisim.last_profile().to_dict()


_COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def profile_program0(generated: Any, target: str, settings: Any,
                     assume: Any = None) -> tuple[dict[str, Any], Any]:
    """Run ``generated`` shape-only with the executor's SBUF budget and LNC, with the per-instruction trace; return
    the profile (all programs) and the cost model's view of **program 0 of this process's rank** (rank 0 outside a
    distributed job): one physical core, as
    ``bench --against`` costs a published kernel (the profile's per-line aggregates add up both programs of an
    LNC=2 kernel, which would put two cores' work on one). A collective call has no ``name=``: it takes the
    region and layer of the instruction before it (the producer of what it reduces), so it is counted per layer."""
    from fusegraph import nkisim

    from .kernelview import view_from_trace

    ns = nkisim.load_kernel_source(generated.source, f"<fusegraph:{generated.name}>", target=target)
    kwargs: dict[str, Any] = {"lnc": settings.lnc}
    if settings.sbuf_budget:
        kwargs["sbuf_budget"] = settings.sbuf_budget
    if assume is not None:  # shape-only register values (e.g. codegen.api.position_assumption(L - 1): a full cache)
        kwargs["assume"] = assume
    nkisim.run(ns[generated.name], *_abstract_args(generated), target=target, shape_only=True, trace=True, **kwargs)
    prof = nkisim.last_profile()
    # the trace is keyed (rank, program): program 0 of the rank this process runs (rank 0 outside a job)
    view = view_from_trace(prof.trace[min(k for k in prof.trace if k[1] == 0)], source=generated.source,
                           source_file=f"<fusegraph:{generated.name}>")
    prev = None
    for ln in view.lines:
        if ln.opcode in _COLLECTIVE_OPS and ln.layer is None and prev is not None and prev.layer is not None:
            ln.region, ln.layer = prev.region, prev.layer
        prev = ln
    d = prof.to_dict()
    d.pop("records", None)
    return d, view


def _abstract_args(generated: Any) -> list:
    from fusegraph.nkisim.torch_io import abstract_args  # deferred like the interpreter above: it imports torch

    return abstract_args(generated)


# ---- the strategies on one build -------------------------------------------------------------------------------
def kernel_stats(build: KernelBuild) -> dict[str, Any]:
    """Counters of the megakernel: DMAs, bytes, SBUF, instructions."""
    p = build.profile
    dmas = p.get("dmas", [])
    slots = sum(d["count"] * max(1, d["partitions"]) for d in dmas)
    hw = load_params(build.target)
    return {
        "kernel_lines": build.generated.source.count("\n"),
        "instructions": p.get("instructions", 0),
        "engine_instructions": {k: v["instructions"] for k, v in p.get("engines", {}).items()},
        "dma_count": p.get("dma_count", 0),
        "dma_bytes": p.get("dma_bytes", 0),
        "dma_descriptors": p.get("dma_descriptors", 0),
        "mean_bytes_per_partition": p.get("dma_bytes", 0) / slots if slots else 0.0,
        "hbm_read_bytes": p.get("hbm_read_bytes", 0),
        "hbm_write_bytes": p.get("hbm_write_bytes", 0),
        "sbuf_peak_bytes_per_partition": p.get("peak_sbuf_bytes_per_partition", 0),
        "sbuf_bytes_per_partition": hw.sbuf_bytes_per_partition,
        "psum_peak_banks": p.get("peak_psum_banks", 0),
        "layers": len(build.generated.program.layers()),
    }


def strategy_summary(est: Estimate, launches: int) -> dict[str, Any]:
    d = est.to_dict(lines=0)
    return {
        "label": est.label,
        "seconds_per_token": est.seconds,
        "seconds_per_layer": est.per_layer_seconds(),
        "decoder_seconds": est.decoder_seconds(),
        "outside_layers_seconds": est.seconds - est.decoder_seconds(),
        "launches_per_step": launches,
        "bound": est.total.bound(),
        "components_s": d["total"]["components_s"],
        "busy_s": d["total"]["busy_s"],
        "per_layer_busy_s": _per_layer_busy(est),
    }


def _per_layer_busy(est: Estimate) -> dict[str, float]:
    layers = [b for k, b in est.layers.items() if isinstance(k, int)]
    out: dict[str, float] = {}
    for b in layers:
        for e, v in b.busy.items():
            out[e] = out.get(e, 0.0) + v / len(layers)
    return out


@dataclass
class Strategies:
    megakernel: Estimate
    hybrid: Estimate
    per_op: Estimate | None = None
    xla_nki_moe: Estimate | None = None
    launches: dict[str, int] = field(default_factory=dict)

    def items(self) -> list[tuple[str, Estimate]]:
        out = [("per_op", self.per_op), ("xla_nki_moe", self.xla_nki_moe), ("hybrid", self.hybrid),
               ("megakernel", self.megakernel)]
        return [(k, v) for k, v in out if v is not None]


def cost_strategies(build: KernelBuild, hw: HardwareParams, program: Any = None,
                    progress: Progress | None = None, *, per_op: bool = True) -> Strategies:
    """(a) per-op, (b) hybrid, (b') XLA + NKI MoE and (c) megakernel for one build (the per-op baselines on
    ``program``, default the build's captured program; none with ``per_op=False``)."""
    progress = progress or Progress(False)
    with progress.step(f"cost model ({hw.target})"):
        mk = estimate_kernel(build.view, hw)
        hy = baselines.hybrid(build.view, build.generated, hw)
        launches = {"megakernel": 1, "hybrid": len({w.region for w in hy.schedule.works})}
        po = xm = None
        program = (program if program is not None else build.program) if per_op else None
        if program is not None:
            po = baselines.per_op(program, hw)
            launches["per_op"] = len({w.region for w in po.schedule.works})
            if any(w.region.endswith(".experts") for w in mk.schedule.works):
                xm = baselines.xla_nki_moe(program, build.view, build.generated, hw)
                launches["xla_nki_moe"] = len({w.region for w in xm.schedule.works})
    return Strategies(mk, hy, po, xm, launches)


# ---- attribution: kernel line -> pattern -> ATen ops -> model module ---------------------------------------------
def attribution(build: KernelBuild) -> dict[str, dict[str, Any]]:
    """Per region key (``L3.q_proj.linear``): the pattern, model module and ATen ops the kernel lines implement."""
    from collections import Counter

    out: dict[str, dict[str, Any]] = {}
    G = build.program.graph if build.program is not None else None
    for ins in build.generated.program.instructions:
        key = baselines.instruction_key(ins)
        a = out.setdefault(key, {"patterns": [], "modules": [], "aten": Counter(), "nodes": 0})
        pat = getattr(ins, "pattern", None) or ins.opcode
        if pat not in a["patterns"]:
            a["patterns"].append(pat)
        mod = getattr(ins, "module", None)
        if mod and mod not in a["modules"]:
            a["modules"].append(mod)
        for n in getattr(ins, "nodes", ()) or ():
            a["nodes"] += 1
            if G is not None and n in G.nodes:
                a["aten"][str(G.nodes[n].get("op", "?"))] += 1
    for a in out.values():
        a["aten"] = dict(a["aten"].most_common())
    return out
