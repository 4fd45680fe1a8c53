"""From a model name to modeled performance: build the megakernel, profile it shape-only, cost every strategy.

The kernel is the one the real pipeline builds: :mod:`fusegraph.codegen.build` captures the decode step, matches
patterns, forms regions, lowers the decoder-stack region and generates its NKI source, with the same settings the
NKI executor uses (SBUF budget, weight ring, LNC). When the pipeline refuses (a :class:`BudgetError` at a cache
length that does not fit SBUF, a :class:`CodegenError`, a capture that fails) there is no kernel to model, so the
result for that target is a :class:`NotRun` with the one-line reason, never a kernel built some other way: a
benchmark must only report kernels the pipeline would run. The shape-only run is done here, not by the builder,
because it reports progress (the decoder layer the run is in).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

from . import baselines
from .costmodel import Estimate, estimate_kernel
from .kernelview import KernelView, build_view
from .params import HardwareParams, load_params
from .progress import KernelLineMonitor, Progress

log = logging.getLogger(__name__)

#: the like-for-like configuration of the published figures: TP=4 x LNC=2 = 8 physical cores
PUBLISHED_CORES = 8


@dataclass
class KernelBuild:
    """A megakernel the pipeline generated, its shape-only profile, and the captured program it came from."""

    model: str
    target: str
    config: dict[str, Any]
    generated: Any  # codegen GeneratedKernel
    profile: dict[str, Any]
    view: KernelView
    program: Any = None  # the captured Program
    analysis: Any = None  # the matcher's Analysis
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class NotRun:
    """A model/target for which the pipeline builds no kernel (so nothing is modeled), and why, in one line."""

    model: str
    target: str
    stage: str  # "capture" (capture or matching), "codegen" (lowering, generation, budget) or "profile"
    reason: str  # "BudgetError: the kernel needs 528.3 KiB of SBUF per partition but trn2 has 208.0 KiB ..."
    config: dict[str, Any] = field(default_factory=dict)
    program: Any = None  # the captured Program, when capture succeeded
    like_for_like: dict[str, Any] | None = None  # the published-configuration shard, built on its own

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "target": self.target, "status": "not run", "stage": self.stage,
                "reason": self.reason}


BuildResult = Union[KernelBuild, NotRun]


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
    """Config of one core's shard under tensor parallelism over ``cores`` physical cores.

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


def _abstract_args(generated: Any) -> list:
    from fusegraph.codegen.build import abstract_args

    return abstract_args(generated)


def _not_run(model: str, target: str, stage: str, e: BaseException, cfg: dict[str, Any],
             program: Any = None) -> NotRun:
    nr = NotRun(model, target, stage, one_line_reason(e), cfg, program)
    log.info("%s on %s: not run (%s): %s", model, target, stage, nr.reason)
    log.debug("%s on %s: the pipeline refused", model, target, exc_info=e)
    return nr


def build_kernels(model: str, targets: Sequence[str], *, layers: int | None = None, cache_len: int = 640,
                  overrides: dict[str, Any] | None = None,
                  progress: Progress | None = None) -> dict[str, BuildResult]:
    """Capture, match, generate and profile the decode megakernel of a bundled model for each target, exactly as
    the pipeline does; a target the pipeline refuses gets a :class:`NotRun`. Capture and matching do not depend
    on the target, so they run once."""
    from fusegraph.codegen.build import build_for_target, capture_decode
    from fusegraph.settings import Settings

    progress = progress or Progress(False)
    try:
        cfg = model_config(model, overrides)
    except KeyError as e:  # an unknown model name: its row says so, the other models still run
        return {t: _not_run(model, t, "capture", e, {}) for t in targets}
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    case_kwargs: dict[str, Any] = {"max_cache_len": cache_len}
    if layers is not None:
        case_kwargs["num_layers"] = layers
    if overrides:
        case_kwargs["config_overrides"] = dict(overrides)
    first = targets[0]
    try:
        with progress.step(f"{model}: capture and match"):
            step = capture_decode(model, options={"target": first}, case_kwargs=case_kwargs,
                                  progress=progress.update)
    except Exception as e:  # noqa: BLE001 - a refused capture is a result of the benchmark, not a crash
        return {t: _not_run(model, t, "capture", e, cfg) for t in targets}
    builds: dict[str, BuildResult] = {}
    for target in targets:
        settings = Settings.from_options({**step.settings_options, "target": target})
        try:
            with progress.step(f"{model}: lower and codegen ({target})"):
                b = build_for_target(step, target, profile=False, progress=progress.update)
        except Exception as e:  # noqa: BLE001 - BudgetError, CodegenError, ...: the row says why
            builds[target] = _not_run(model, target, "codegen", e, cfg, step.program)
            continue
        timings = {k: v for k, v in b.timings.items() if k != "total_s"}
        if any(isinstance(x, KernelBuild) for x in builds.values()):  # shared with the first target built
            timings.pop("capture_s", None)
            timings.pop("match_s", None)
        gen = b.generated
        try:
            with progress.step(f"{model}: shape-only profile of {len(gen.program.layers())} layers ({target})"):
                t0 = time.perf_counter()
                prof = profile_shape_only(gen, target, progress, settings=settings)
                timings["profile_s"] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - the interpreter refused the kernel: the executor would too
            builds[target] = _not_run(model, target, "profile", e, cfg, step.program)
            continue
        view = build_view(gen.source, prof)
        builds[target] = KernelBuild(model, target, cfg, gen, prof, view, step.program, step.analysis, timings)
    return builds


def build_kernel(model: str, target: str, **kw: Any) -> BuildResult:
    """:func:`build_kernels` for one target."""
    return build_kernels(model, [target], **kw)[target]


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


# ---- one model on one target -----------------------------------------------------------------------------------
@dataclass
class ModelPerf:
    """Everything the benchmark, the CLI and the HTML report show for one model on one target."""

    model: str
    target: str
    build: KernelBuild
    strategies: Strategies
    limit: dict[str, float]
    cache_len: int
    program: Any = None
    like_for_like: dict[str, Any] | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def summaries(self) -> dict[str, dict[str, Any]]:
        return {k: strategy_summary(e, self.strategies.launches.get(k, 0)) for k, e in self.strategies.items()}

    def to_dict(self, top_lines: int = 30) -> dict[str, Any]:
        s = self.summaries()
        mk = s["megakernel"]["seconds_per_token"]
        speed = {f"megakernel_vs_{k}": v["seconds_per_token"] / mk for k, v in s.items() if k != "megakernel" and mk}
        hw = load_params(self.target)
        return {
            "model": self.model,
            "target": self.target,
            "cache_len": self.cache_len,
            "layers": self.build.config.get("num_hidden_layers"),
            "status": "run",
            "notes": list(self.build.notes),
            "timings": dict(self.timings),
            "kernel": kernel_stats(self.build),
            "limit": self.limit,
            "hbm_bytes_vs_minimum": (self.build.profile.get("hbm_read_bytes", 0) / self.limit["total_bytes"]
                                     if self.limit.get("total_bytes") else None),
            "strategies": s,
            "speedup": speed,
            "megakernel": self.strategies.megakernel.to_dict(lines=top_lines),
            "attribution": attribution(self.build),
            "like_for_like": self.like_for_like,
            "params": hw.table(),
        }


def analyze_model(model: str, targets: Sequence[str] = ("trn3",), *, layers: int | None = None,
                  cache_len: int = 640, like_for_like: bool | None = None, per_op: bool = True,
                  progress: Progress | None = None) -> dict[str, ModelPerf | NotRun]:
    """Build, profile and cost ``model`` on each target (a :class:`NotRun` where the pipeline builds no kernel).
    With ``like_for_like`` (default: for the published model, on the published target) also build and cost one
    core's shard of it in the published configuration (its own result: the shard may fit where the whole model
    on one core does not)."""
    from .params import published

    progress = progress or Progress(False)
    targets = list(targets)
    pub = published()
    builds = build_kernels(model, targets, layers=layers, cache_len=cache_len, progress=progress)
    out: dict[str, ModelPerf | NotRun] = {}
    for target in targets:
        build = builds[target]
        if isinstance(build, NotRun) and not build.config:  # not even a config to size the limit from
            out[target] = build
            continue
        hw = load_params(target)
        limit = baselines.physical_limit(build.config, cache_len, hw)
        wanted = like_for_like if like_for_like is not None else (model == pub["model"] and target == pub["target"])
        lfl = (_like_for_like(model, target, build.config, limit, layers=layers, cache_len=cache_len, per_op=per_op,
                              progress=progress) if wanted else None)
        if isinstance(build, NotRun):
            build.like_for_like = lfl
            out[target] = build
            continue
        timings = dict(build.timings)
        t0 = time.perf_counter()
        strategies = cost_strategies(build, hw, progress=progress, per_op=per_op)
        timings["cost_model_s"] = time.perf_counter() - t0
        out[target] = ModelPerf(model, target, build, strategies, limit, cache_len, build.program, lfl, timings)
    return out


def _like_for_like(model: str, target: str, config: dict[str, Any], limit: dict[str, float], *,
                   layers: int | None, cache_len: int, per_op: bool, progress: Progress) -> dict[str, Any]:
    """One core's shard of ``model`` in the published configuration, costed and compared with the figures (or
    ``status: not run`` with the reason, when the pipeline builds no kernel for the shard)."""
    from . import calibration
    from .params import published

    pub = published()
    hw = load_params(target)
    cores = pub["tp"] * pub["lnc"]
    overrides = shard_overrides(config, cores)
    head = {"cores": cores, "tp": pub["tp"], "lnc": pub["lnc"], "shard_overrides": overrides}
    shard = build_kernel(model, target, layers=layers, cache_len=cache_len, overrides=overrides, progress=progress)
    if isinstance(shard, NotRun):
        return {**head, **shard.to_dict()}
    sstrat = cost_strategies(shard, hw, progress=progress, per_op=per_op)
    summaries = {k: strategy_summary(e, sstrat.launches.get(k, 0)) for k, e in sstrat.items()}
    n_layers = int(config["num_hidden_layers"])
    rows = calibration.calibrate(summaries, hw, n_layers)
    what_if = calibration.what_ifs(shard.view, hw, summaries["megakernel"])
    sens = calibration.sensitivity(shard.view, hw)
    return {
        **head,
        "status": "run",
        "timings": dict(shard.timings),
        "kernel": kernel_stats(shard),
        "strategies": summaries,
        "calibration": [r.to_dict() for r in rows],
        "goal": calibration.goal(summaries, hw, limit),
        "what_if": what_if,
        "sensitivity": sens,
        "megakernel": sstrat.megakernel.to_dict(lines=20),
        "attribution": attribution(shard),
    }
