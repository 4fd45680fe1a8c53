"""``fusegraph bench``, ``fusegraph kernel`` and ``fusegraph report --html`` (registered by :mod:`fusegraph.cli`).

``--model`` takes a bundled config name (``fusegraph models``) or ``module:function`` naming user code that
returns the decode step to compile: a :class:`fusegraph.models.DecodeCase`, or ``(fn, args)`` /
``(fn, args, kwargs)`` with ``fn`` a callable or ``nn.Module`` and ``args`` one decode step's inputs.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any, Callable

from .progress import Progress


def add_commands(sub: Any) -> None:
    """Register ``bench`` and ``kernel`` on the ``fusegraph`` sub-command parser."""
    b = sub.add_parser("bench", help="model the decode performance of bundled models (cost model on the "
                       "interpreter profile) and compare with the published figures")
    b.add_argument("--models", default="qwen3-30b-a3b,llama3-8b", help="comma-separated bundled names")
    b.add_argument("--targets", default="trn2,trn3")
    b.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    b.add_argument("--cache-len", type=int, default=640)
    b.add_argument("--json", default="bench-results/perf.json", help="where to write the JSON results")
    b.add_argument("--html-dir", default=None, help="also write one HTML report per model/target")
    b.add_argument("--synthetic", action="store_true", help="build kernels from the configs, not by capture")
    b.add_argument("--no-per-op", action="store_true", help="skip the per-op baselines")
    b.set_defaults(func=cmd_bench)

    k = sub.add_parser("kernel", help="print or write the generated NKI megakernel of a model's decode step")
    k.add_argument("--model", default="qwen3-moe-tiny", help="bundled name or module:function")
    k.add_argument("--target", default="trn2", choices=("trn2", "trn3"))
    k.add_argument("--layers", type=int, default=None)
    k.add_argument("--max-cache-len", type=int, default=None)
    k.add_argument("--out", default=None, help="write the source here instead of printing it")
    k.add_argument("--profile", action="store_true", help="also run it shape-only and print the modeled time")
    k.set_defaults(func=cmd_kernel)


def add_report_html_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--html", default=None, metavar="OUT.html",
                        help="also write the self-contained HTML report (graph, regions, decision log, modeled time)")


# ---- model resolution ---------------------------------------------------------------------------------------------
def load_user_step(spec: str) -> tuple[Callable, tuple, dict, Any]:
    """``module:function`` -> (step fn, args, kwargs, config or None)."""
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise SystemExit(f"--model {spec!r}: expected a bundled name or module:function")
    sys.path.insert(0, os.getcwd())
    try:
        obj = getattr(importlib.import_module(mod_name), fn_name)()
    finally:
        sys.path.pop(0)
    if hasattr(obj, "step") and hasattr(obj, "token"):
        return obj.step, (obj.token, obj.position), {}, getattr(obj.model, "config", None)
    if isinstance(obj, tuple) and len(obj) in (2, 3):
        fn, args = obj[0], tuple(obj[1])
        kwargs = dict(obj[2]) if len(obj) == 3 else {}
        return fn, args, kwargs, getattr(fn, "config", None)
    raise SystemExit(f"{spec} returned {type(obj).__name__}; expected a DecodeCase or (fn, args[, kwargs])")


def build_user_kernel(spec: str, target: str, progress: Progress) -> Any:
    """Capture -> match -> lower -> generate for user code (the bundled path is codegen.build.build_decode_kernel)."""
    from fusegraph.codegen.lowering import lower_region
    from fusegraph.codegen.megakernel import generate
    from fusegraph.executors.kernels import _tokens
    from fusegraph.inspection import capture_step
    from fusegraph.matching import analyze
    from fusegraph.settings import Settings

    fn, args, kwargs, config = load_user_step(spec)
    settings = Settings.from_options({"executor": "eager", "target": target})
    with progress.step(f"{spec}: capture"):
        cap = capture_step(fn, *args, options={"executor": "eager", "target": target}, **kwargs)
    with progress.step(f"{spec}: match"):
        analysis = analyze(cap.program, settings)
    if not analysis.regions:
        raise SystemExit(f"{spec}: no fusible region was found (see `fusegraph report`)")
    region = max(analysis.regions, key=lambda r: len(r.matches))
    with progress.step(f"{spec}: lower and generate"):
        lowered = lower_region(cap.program, region, _tokens(cap.program, region), name="fusegraph_decode_step")
        gen = generate(lowered.program, target=target, chunk_bytes=settings.weight_chunk_kib * 1024,
                       ring=settings.weight_buffers, sbuf_budget_bytes=settings.sbuf_budget, model=spec)
    return cap.program, analysis, gen, config


# ---- commands -----------------------------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    result = bench.run(args.models.split(","), args.targets.split(","), layers=args.layers, cache_len=args.cache_len,
                       prefer="synthetic" if args.synthetic else "pipeline", per_op=not args.no_per_op,
                       keep=bool(args.html_dir))
    perfs = result.pop("_perf", {})
    print(bench.format_tables(result))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"wrote {args.json}")
    if args.html_dir:
        from .html import write_perf

        os.makedirs(args.html_dir, exist_ok=True)
        for key, perf in perfs.items():
            path = os.path.join(args.html_dir, f"perf-{key.replace('@', '-')}.html")
            write_perf(path, perf)
            print(f"wrote {path}")
    return 0


def cmd_kernel(args: argparse.Namespace) -> int:
    progress = Progress(None)
    if ":" in args.model:
        _, _, gen, _ = build_user_kernel(args.model, args.target, progress)
    else:
        from fusegraph.codegen.build import build_decode_kernel

        case_kwargs: dict[str, Any] = {}
        if args.layers is not None:
            case_kwargs["num_layers"] = args.layers
        if args.max_cache_len is not None:
            case_kwargs["max_cache_len"] = args.max_cache_len
        with progress.step(f"{args.model}: capture, match, codegen ({args.target})"):
            gen = build_decode_kernel(args.model, target=args.target, profile=False, case_kwargs=case_kwargs,
                                      progress=progress.update).generated
    if args.out:
        with open(args.out, "w") as f:
            f.write(gen.source)
        print(f"wrote {args.out} ({gen.source.count(chr(10))} lines, {len(gen.program.instructions)} instructions)")
    else:
        sys.stdout.write(gen.source)
    if args.profile:
        from .analysis import profile_shape_only
        from .costmodel import estimate_kernel
        from .kernelview import build_view
        from .params import load_params

        prof = profile_shape_only(gen, args.target, progress)
        est = estimate_kernel(build_view(gen.source, prof), load_params(args.target))
        print(f"modeled on {args.target} (one core): {est.seconds * 1e3:.3f} ms per step, "
              f"{est.per_layer_seconds() * 1e6:.1f} us per layer, {est.total.bound()}-bound", file=sys.stderr)
    return 0


def write_report_html(args: argparse.Namespace, cap: Any, report: Any) -> str:
    """``fusegraph report --html``: the capture's graph/regions/decisions plus the modeled kernel of the model."""
    from . import html
    from .analysis import analyze_model

    progress = Progress(None)
    target = getattr(cap.session.settings, "target", "trn2") or "trn2"
    perf = None
    try:
        perfs = analyze_model(args.model, [target], layers=args.layers,
                              cache_len=getattr(args, "max_cache_len", None) or 640, like_for_like=None,
                              progress=progress)
        perf = perfs[target]
    except Exception as e:  # noqa: BLE001 - the capture part of the report is still worth writing
        print(f"(no modeled performance in the HTML report: {type(e).__name__}: {e})", file=sys.stderr)
    data = report.to_dict() if hasattr(report, "to_dict") else dict(report or {})
    text = html.render(title=f"fusegraph report: {args.model}", perf=perf.to_dict() if perf else None,
                       program=cap.program, analysis=getattr(report, "analysis", None), report=data,
                       source=perf.build.generated.source if perf else None)
    with open(args.html, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.html}")
    return args.html
