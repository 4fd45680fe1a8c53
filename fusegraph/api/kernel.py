"""Build (and profile) the megakernel of a model's decode step without running the model.

For full-size configs built on the ``meta`` device: capture the step, match and form regions, lower the
decoder-stack region, generate its NKI source, and run it in the interpreter's shape-only mode (no data, same
checks and counters) to get the profile a cost model turns into time. It captures through the backend and
lowers with the executor's own settings, so it sits above the pipeline: ``fusegraph kernel``, ``fusegraph
bench`` (:mod:`fusegraph.modelperf`) and the benchmarks call it.
"""
from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import nkisim
from ..codegen.errors import CodegenError
from ..codegen.registry import check as lowerable
from ..executors.kernels import build_region
from ..matching import Analysis, analyze
from ..models import build_decode
from ..models.user import is_user_spec, load_user_step
from ..nkisim.torch_io import abstract_args
from ..perf.analysis import KernelBuild
from ..program import Program
from ..settings import Settings
from ..warnings import FusegraphWarning
from .capture import capture_step

log = logging.getLogger(__name__)


@dataclass
class CapturedStep:
    """A decode step captured and analyzed once (reused for several targets)."""

    model: str
    program: Program
    analysis: Analysis
    settings_options: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)


def _quiet(msg: str) -> None:
    log.debug("%s", msg)


def capture_decode(model: str, *, options: dict[str, Any] | None = None, case_kwargs: dict[str, Any] | None = None,
                   progress: Callable[[str], None] | None = None) -> CapturedStep:
    """A bundled model (``fusegraph models``) or ``module:function`` user code, captured and analyzed."""
    say = progress or _quiet
    say(f"building {model}")
    if is_user_spec(model):
        user = load_user_step(model)
        return capture_callable(model, user.fn, user.args, user.kwargs, options=options, progress=progress)
    case = build_decode(model, **(case_kwargs or {}))
    return capture_callable(model, case.step, (case.token, case.position), {}, options=options, progress=progress)


def capture_callable(name: str, fn: Callable, args: tuple, kwargs: dict[str, Any], *,
                     options: dict[str, Any] | None = None,
                     progress: Callable[[str], None] | None = None) -> CapturedStep:
    """Capture ``fn(*args, **kwargs)`` with the eager executor and analyze it (raises :class:`CodegenError` when
    no region forms: there would be no kernel to build)."""
    say = progress or _quiet
    opts = {"executor": "eager", **(options or {})}
    t0 = time.perf_counter()
    say("capturing the decode step")
    cap = capture_step(fn, *args, options=opts, **kwargs)
    t1 = time.perf_counter()
    say("matching patterns and forming regions")
    analysis = analyze(cap.program, Settings.from_options(opts), lowerable=lowerable)
    if not analysis.regions:
        raise CodegenError(f"{name}: no fusible region was found (see `fusegraph report`)")
    return CapturedStep(model=name, program=cap.program, analysis=analysis, settings_options=opts,
                        timings={"capture_s": t1 - t0, "match_s": time.perf_counter() - t1})


def build_for_target(step: CapturedStep, target: str, *, profile: bool = True,
                     progress: Callable[[str], None] | None = None) -> KernelBuild:
    """Lower, generate and (shape-only) profile the decoder-stack kernel of a captured step for ``target``."""
    say = progress or _quiet
    settings = Settings.from_options({**step.settings_options, "target": target})
    timings = dict(step.timings)
    region = max(step.analysis.regions, key=lambda r: len(r.matches))
    t2 = time.perf_counter()
    say(f"lowering and generating the megakernel for {target} ({len(region.matches)} matches, {len(region.layers)} layers)")
    plan, notes = _build_like_the_executor(step, region, settings)
    generated = plan.generated
    timings["codegen_s"] = time.perf_counter() - t2
    build = KernelBuild(model=step.model, target=target, program=step.program, analysis=step.analysis,
                        region=plan.region, lowered=plan.lowered, generated=generated, timings=timings,
                        notes=notes)
    if profile:
        t3 = time.perf_counter()
        say(f"shape-only run of {generated.stats['lines']} kernel lines on {target}")
        ns = nkisim.load_kernel_source(generated.source, f"<fusegraph:{step.model}>", target=target)
        kwargs = {"sbuf_budget": settings.sbuf_budget} if settings.sbuf_budget else {}
        nkisim.run(ns[generated.name], *abstract_args(generated), target=target, shape_only=True, lnc=settings.lnc,
                   **kwargs)
        build.profile = nkisim.last_profile().to_dict()
        timings["profile_s"] = time.perf_counter() - t3
    return build


def _build_like_the_executor(step: CapturedStep, region: Any, settings: Settings) -> tuple[Any, list[str]]:
    """The region's kernel exactly as the NKI executor builds it (``executors.kernels.build_region``: a pattern
    whose lowering fails gives its ops to generic lowering, a match nothing lowers is dropped to the eager path):
    the plan holding the most ops, and the build's warnings as notes. Raises the build's error (a
    :class:`CodegenError`) when no kernel is left."""
    label = f"region {region.id} ({region.kind})"
    errors: list[BaseException] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FusegraphWarning)
        plans = build_region(step.program, 0, region, label, settings, step.analysis.matches,
                             name="fusegraph_decode_step", model=step.model, errors=errors)
    notes = [str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)]
    for n in notes:
        log.info("%s", n)
    if not plans:  # the build's own error (a BudgetError names the SBUF it needs), as before
        raise errors[0] if errors else CodegenError(notes[0] if notes else f"{label}: no kernel was built")
    return max(plans, key=lambda p: len(p.lowered.kernel_nodes)), notes


def build_decode_kernel(model: str = "qwen3-30b-a3b", *, target: str = "trn2", profile: bool = True,
                        options: dict[str, Any] | None = None, case_kwargs: dict[str, Any] | None = None,
                        progress: Callable[[str], None] | None = None) -> KernelBuild:
    """Capture, match, lower, generate and (shape-only) profile the decode-step megakernel of ``model``."""
    step = capture_decode(model, options={"target": target, **(options or {})}, case_kwargs=case_kwargs,
                          progress=progress)
    return build_for_target(step, target, profile=profile, progress=progress)
