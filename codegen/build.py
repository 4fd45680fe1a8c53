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


def _abstract_args(generated: Any) -> list:
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


def build_decode_kernel(model: str = "qwen3-30b-a3b", *, target: str = "trn2", profile: bool = True,
                        options: dict | None = None, case_kwargs: dict | None = None,
                        progress: Callable[[str], None] | None = None) -> KernelBuild:
    """Capture, match, lower, generate and (shape-only) profile the decode-step megakernel of ``model``."""
    from fusegraph import nkisim
    from fusegraph.executors.kernels import _tokens
    from fusegraph.inspection import capture_step
    from fusegraph.matching import analyze
    from fusegraph.models import build_decode
    from fusegraph.settings import Settings

    from .lowering import lower_region
    from .megakernel import generate

    say = progress or (lambda msg: None)
    timings: dict[str, float] = {}
    opts = {"executor": "eager", "target": target, **(options or {})}
    settings = Settings.from_options(opts)
    t0 = time.perf_counter()
    say(f"building {model}")
    case = build_decode(model, **(case_kwargs or {}))
    say("capturing the decode step")
    cap = capture_step(case.step, case.token, case.position, options=opts)
    timings["capture_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    say("matching patterns and forming regions")
    analysis = analyze(cap.program, settings)
    timings["match_s"] = time.perf_counter() - t1
    region = max(analysis.regions, key=lambda r: len(r.matches))
    t2 = time.perf_counter()
    say(f"lowering and generating the megakernel ({len(region.matches)} matches, {len(region.layers)} layers)")
    lowered = lower_region(cap.program, region, _tokens(cap.program, region), name="fusegraph_decode_step")
    generated = generate(lowered.program, target=target, chunk_bytes=settings.weight_chunk_kib * 1024,
                         ring=settings.weight_buffers, sbuf_budget_bytes=settings.sbuf_budget, model=model,
                         region=f"region {region.id} ({region.kind})")
    timings["codegen_s"] = time.perf_counter() - t2
    build = KernelBuild(model=model, target=target, program=cap.program, analysis=analysis, region=region,
                        lowered=lowered, generated=generated, timings=timings)
    if profile:
        t3 = time.perf_counter()
        say(f"shape-only run of {generated.stats['lines']} kernel lines on {target}")
        ns = nkisim.load_kernel_source(generated.source, f"<fusegraph:{model}>", target=target)
        kwargs = {"sbuf_budget": settings.sbuf_budget} if settings.sbuf_budget else {}
        nkisim.run(ns[generated.name], *_abstract_args(generated), target=target, shape_only=True, **kwargs)
        build.profile = nkisim.last_profile().to_dict()
        timings["profile_s"] = time.perf_counter() - t3
    timings["total_s"] = time.perf_counter() - t0
    return build
