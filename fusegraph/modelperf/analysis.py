"""From a model name to modeled performance: build the megakernel, profile it shape-only, cost every strategy.

The kernel is the one the real pipeline builds: :mod:`fusegraph.api` captures the decode step, matches
patterns, forms regions, lowers the decoder-stack region and generates its NKI source, with the same settings the
NKI executor uses (SBUF budget, weight ring, LNC). When the pipeline refuses (a :class:`BudgetError` at a cache
length that does not fit SBUF, a :class:`CodegenError`, a capture that fails) there is no kernel to model, so the
result for that target is a :class:`NotRun` with the one-line reason, never a kernel built some other way: a
benchmark must only report kernels the pipeline would run. The shape-only run is done here, not by the builder,
because it reports progress (the decoder layer the run is in). Costing one build is the cost model's
(:mod:`fusegraph.perf.analysis`); this module captures, so it sits above the API.
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

from ..api.kernel import build_for_target, capture_decode
from ..perf import baselines, calibration
from ..perf.analysis import (KernelBuild, Strategies, attribution, cost_strategies, kernel_stats, model_config,
                             one_line_reason, profile_shape_only, shard_overrides, strategy_summary)
from ..perf.kernelview import build_view
from ..perf.params import SOURCED, load_params, published
from ..perf.progress import Progress
from ..settings import Settings

log = logging.getLogger(__name__)


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
        b.config, b.profile, b.view, b.timings = cfg, prof, build_view(gen.source, prof), timings
        builds[target] = b
    return builds


def build_kernel(model: str, target: str, **kw: Any) -> BuildResult:
    """:func:`build_kernels` for one target."""
    return build_kernels(model, [target], **kw)[target]


# ---- one model on one target -----------------------------------------------------------------------------------
#: a tensor-path op's comment in a generated kernel: ``# <aten op> (<region>) on the tensor path``
_TENSOR_OP_COMMENT = re.compile(r"# (\S+) \((\S+)\) on the tensor path")


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
    parameter_set: str = SOURCED  # the cost model's parameter set the strategies were costed with

    def summaries(self) -> dict[str, dict[str, Any]]:
        return {k: strategy_summary(e, self.strategies.launches.get(k, 0)) for k, e in self.strategies.items()}

    def generic_by_cost(self, n: int = 5) -> list[dict[str, Any]]:
        """The ops that run in the kernel through generic lowering (the tensor path: no pattern), ranked by the
        modeled time they expose in the megakernel (the cost model's per-line attribution), each with its kernel
        region, ATen op and milliseconds: the next patterns to write, in the order they would pay off. The op is
        read from the kernel's own comment on each tensor-path op (``# <aten op> (<region>) on the tensor path``)."""
        src = self.build.generated.source
        op_of = dict((name, op) for op, name in _TENSOR_OP_COMMENT.findall(src))
        if not op_of:
            return []
        cost: dict[str, float] = {}
        for line in self.strategies.megakernel.to_dict(lines=400)["top_lines"]:
            region = line.get("region") or ""
            if region in op_of:
                cost[region] = cost.get(region, 0.0) + (line.get("exposed_s") or 0.0)
        mk = self.strategies.megakernel.seconds or 1.0
        top = sorted(cost.items(), key=lambda kv: -kv[1])[:n]
        return [{"region": r, "op": op_of[r], "ms": sec * 1e3, "share": sec / mk} for r, sec in top]

    def to_dict(self, top_lines: int = 30) -> dict[str, Any]:
        s = self.summaries()
        mk = s["megakernel"]["seconds_per_token"]
        speed = {f"megakernel_vs_{k}": v["seconds_per_token"] / mk for k, v in s.items() if k != "megakernel" and mk}
        hw = load_params(self.target, self.parameter_set)
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
            "generic_by_cost": self.generic_by_cost(),
            "like_for_like": self.like_for_like,
            "params": hw.table(),
            "parameter_set": self.parameter_set,
        }


def analyze_model(model: str, targets: Sequence[str] = ("trn3",), *, layers: int | None = None,
                  cache_len: int = 640, like_for_like: bool | None = None, per_op: bool = True,
                  progress: Progress | None = None,
                  parameter_set: str = SOURCED) -> dict[str, ModelPerf | NotRun]:
    """Build, profile and cost ``model`` on each target (a :class:`NotRun` where the pipeline builds no kernel).
    With ``like_for_like`` (default: for the published model, on the published target) also build and cost one
    core's shard of it in the published configuration (its own result: the shard may fit where the whole model
    on one core does not)."""
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
        hw = load_params(target, parameter_set)
        limit = baselines.physical_limit(build.config, cache_len, hw)
        wanted = like_for_like if like_for_like is not None else (model == pub["model"] and target == pub["target"])
        lfl = (_like_for_like(model, target, build.config, limit, layers=layers, cache_len=cache_len, per_op=per_op,
                              progress=progress, parameter_set=parameter_set) if wanted else None)
        if isinstance(build, NotRun):
            build.like_for_like = lfl
            out[target] = build
            continue
        timings = dict(build.timings)
        t0 = time.perf_counter()
        strategies = cost_strategies(build, hw, progress=progress, per_op=per_op)
        timings["cost_model_s"] = time.perf_counter() - t0
        out[target] = ModelPerf(model, target, build, strategies, limit, cache_len, build.program, lfl, timings,
                                parameter_set)
    return out


def _like_for_like(model: str, target: str, config: dict[str, Any], limit: dict[str, float], *,
                   layers: int | None, cache_len: int, per_op: bool, progress: Progress,
                   parameter_set: str = SOURCED) -> dict[str, Any]:
    """One core's shard of ``model`` in the published configuration, costed and compared with the figures (or
    ``status: not run`` with the reason, when the pipeline builds no kernel for the shard)."""
    pub = published()
    hw = load_params(target, parameter_set)
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
