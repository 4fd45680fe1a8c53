"""Build (and profile) the megakernel of a bundled model's decode step without running the model.

For full-size configs built on the ``meta`` device: capture the step, match and form regions, lower the
decoder-stack region, generate its NKI source, and run it in the interpreter's shape-only mode (no data, same
checks and counters) to get the profile a cost model turns into time. Used by benchmarks and ``fusegraph kernel``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class KernelBuild:
    model: str
    target: str
    program: Any  # fusegraph Program
    analysis: Any
    region: Any
    lowered: Any
    generated: Any
    profile: dict | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def kernel_source(self) -> str:
        return self.generated.source


def abstract_args(generated: Any) -> list:
    """Shape-only stand-ins for every argument of a generated kernel (kernel shapes and dtypes)."""
    from fusegraph import nkisim

    from .runtime import _np_dtype

    args = []
    for name in generated.args:
        if name in generated.specs:
            spec = generated.specs[name]
            args.append(nkisim.Abstract(tuple(spec.shape), _np_dtype(spec.dtype)))
        else:
            t = generated.constants[name]
            args.append(nkisim.Abstract(tuple(t.shape), _np_dtype(t.dtype)))
    return args


@dataclass
class CapturedStep:
    """A bundled model's decode step captured and analyzed once (reused for several targets)."""

    model: str
    program: Any
    analysis: Any
    settings_options: dict
    timings: dict[str, float] = field(default_factory=dict)


def capture_decode(model: str, *, options: dict | None = None, case_kwargs: dict | None = None,
                   progress: Callable[[str], None] | None = None) -> CapturedStep:
    """A bundled model (``fusegraph models``) or ``module:function`` user code, captured and analyzed."""
    from fusegraph.models import build_decode
    from fusegraph.models.user import is_user_spec, load_user_step

    say = progress or (lambda msg: None)
    say(f"building {model}")
    if is_user_spec(model):
        user = load_user_step(model)
        return capture_callable(model, user.fn, user.args, user.kwargs, options=options, progress=progress)
    case = build_decode(model, **(case_kwargs or {}))
    return capture_callable(model, case.step, (case.token, case.position), {}, options=options, progress=progress)


def capture_callable(name: str, fn: Callable, args: tuple, kwargs: dict, *, options: dict | None = None,
                     progress: Callable[[str], None] | None = None) -> CapturedStep:
    from fusegraph.inspection import capture_step
    from fusegraph.matching import analyze
    from fusegraph.settings import Settings

    say = progress or (lambda msg: None)
    opts = {"executor": "eager", **(options or {})}
    t0 = time.perf_counter()
    say("capturing the decode step")
    cap = capture_step(fn, *args, options=opts, **kwargs)
    t1 = time.perf_counter()
    say("matching patterns and forming regions")
    analysis = analyze(cap.program, Settings.from_options(opts))
    if not analysis.regions:
        from .errors import CodegenError

        raise CodegenError(f"{name}: no fusible region was found (see `fusegraph report`)")
    return CapturedStep(model=name, program=cap.program, analysis=analysis, settings_options=opts,
                        timings={"capture_s": t1 - t0, "match_s": time.perf_counter() - t1})


def build_for_target(step: CapturedStep, target: str, *, profile: bool = True,
                     progress: Callable[[str], None] | None = None) -> KernelBuild:
    """Lower, generate and (shape-only) profile the decoder-stack kernel of a captured step for ``target``."""
    from fusegraph import nkisim
    from fusegraph.executors.kernels import _tokens
    from fusegraph.settings import Settings

    from .lowering import lower_region
    from .megakernel import generate

    say = progress or (lambda msg: None)
    settings = Settings.from_options({**step.settings_options, "target": target})
    timings = dict(step.timings)
    region = max(step.analysis.regions, key=lambda r: len(r.matches))
    t2 = time.perf_counter()
    say(f"lowering and generating the megakernel for {target} ({len(region.matches)} matches, {len(region.layers)} layers)")
    lowered = lower_region(step.program, region, _tokens(step.program, region), name="fusegraph_decode_step")
    generated = generate(lowered.program, target=target, chunk_bytes=settings.weight_chunk_kib * 1024,
                         ring=settings.weight_buffers, sbuf_budget_bytes=settings.sbuf_budget, model=step.model,
                         region=f"region {region.id} ({region.kind})", lnc=settings.lnc)
    timings["codegen_s"] = time.perf_counter() - t2
    build = KernelBuild(model=step.model, target=target, program=step.program, analysis=step.analysis, region=region,
                        lowered=lowered, generated=generated, timings=timings)
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


def build_decode_kernel(model: str = "qwen3-30b-a3b", *, target: str = "trn2", profile: bool = True,
                        options: dict | None = None, case_kwargs: dict | None = None,
                        progress: Callable[[str], None] | None = None) -> KernelBuild:
    """Capture, match, lower, generate and (shape-only) profile the decode-step megakernel of ``model``."""
    step = capture_decode(model, options={"target": target, **(options or {})}, case_kwargs=case_kwargs,
                          progress=progress)
    return build_for_target(step, target, profile=profile, progress=progress)
