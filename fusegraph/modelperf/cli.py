"""``fusegraph bench``, ``fusegraph kernel`` and ``fusegraph report --html`` (registered by :mod:`fusegraph.cli`).

``--model`` takes a bundled config name (``fusegraph models``) or ``module:function`` naming user code that
returns the decode step to compile: a :class:`fusegraph.models.DecodeCase`, or ``(fn, args)`` /
``(fn, args, kwargs)`` with ``fn`` a callable or ``nn.Module`` and ``args`` one decode step's inputs.

``fusegraph`` builds its parser from :func:`add_commands` on every start, so this module imports only the light
cost model at its top; each command imports what captures and reports (torch, the pipeline) when it runs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..perf.analysis import profile_shape_only
from ..perf.costmodel import estimate_kernel
from ..perf.kernelview import build_view
from ..perf.params import (SOURCED, ParameterSetError, calibrations, check_parameter_set, load_params,
                            parameter_set_targets)
from ..perf.progress import Progress


def add_commands(sub: Any) -> None:
    """Register ``bench`` and ``kernel`` on the ``fusegraph`` sub-command parser."""
    b = sub.add_parser("bench", help="model the decode performance of bundled models (cost model on the "
                       "interpreter profile of the kernel the pipeline builds) and compare with the published "
                       "figures; a model/target the pipeline refuses is reported as not run, with the reason")
    b.add_argument("--models", default=None, help="comma-separated bundled names (default qwen3-30b-a3b,llama3-8b; "
                   "with --against: the spec's model)")
    b.add_argument("--targets", default=None, help="default trn2,trn3 (with --against: the spec's target)")
    b.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    b.add_argument("--cache-len", type=int, default=640)
    b.add_argument("--json", default="bench-results/perf.json", help="where to write the JSON results")
    b.add_argument("--html-dir", default=None, help="also write one HTML report per model/target")
    b.add_argument("--no-per-op", action="store_true", help="skip the per-op baselines")
    b.add_argument("--against", default=None, metavar="MODULE:ATTR|FILE.py[:ATTR]",
                   help="also run a third-party NKI kernel through the same interpreter and cost model and print it "
                   "beside fusegraph's kernel, per layer and per engine: a spec (fusegraph.perf.against.KernelSpec or "
                   "a factory returning one, e.g. fusegraph.perf.against_specs:qwen3_megakernel), or the kernel "
                   "itself with --against-args (docs/performance.md)")
    b.add_argument("--against-args", default=None, metavar="MODULE:ATTR|FILE.py[:ATTR]",
                   help="the spec of the --against kernel's arguments (shape-only)")
    b.add_argument("--against-path", action="append", default=[], metavar="DIR",
                   help="directory to import the --against kernel from (repeatable)")
    add_parameters_flag(b)
    b.set_defaults(func=cmd_bench)

    k = sub.add_parser("kernel", help="print or write the generated NKI megakernel of a model's decode step")
    k.add_argument("--model", default="qwen3-moe-tiny", help="bundled name or module:function")
    k.add_argument("--target", default="trn2", choices=("trn2", "trn3"))
    k.add_argument("--layers", type=int, default=None)
    k.add_argument("--max-cache-len", type=int, default=None)
    k.add_argument("--out", default=None, help="write the source here instead of printing it")
    k.add_argument("--profile", action="store_true", help="also run it shape-only and print the modeled time")
    add_parameters_flag(k)
    k.set_defaults(func=cmd_kernel)


def add_parameters_flag(parser: argparse.ArgumentParser) -> None:
    """``--parameters sourced|<calibration>``: which of the data file's parameter sets turns counted work into
    time. Why a flag: a calibration fitted to one kernel's measured profile is a different source from the vendor
    figures, so the user chooses it explicitly and every table says which set it used."""
    names = ", ".join([SOURCED, *sorted(calibrations())])
    parser.add_argument("--parameters", default=SOURCED, metavar="SET",
                        help=f"cost-model parameter set: {names} (default {SOURCED}: every value from its public "
                        "source; a calibration replaces its fitted low-confidence values and applies to its own "
                        "target only; docs/performance.md)")


def add_report_html_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--html", default=None, metavar="OUT.html",
                        help="also write the self-contained HTML report (graph, regions, decision log, modeled time)")


# ---- commands -----------------------------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    targets = args.targets.split(",") if args.targets else None
    try:
        if targets is not None:
            check_parameter_set(args.parameters, targets)
        if args.against:
            from .against import run_against

            json_path = args.json if args.json != "bench-results/perf.json" else "bench-results/against.json"
            run_against(args.against, args.against_args, models=args.models.split(",") if args.models else None,
                        targets=targets, layers=args.layers, cache_len=args.cache_len, paths=args.against_path,
                        json_path=json_path, progress=Progress(None), parameter_set=args.parameters)
            return 0
        from .bench import run_and_write

        if targets is None:  # a calibration runs on its own target by default
            targets = ["trn2", "trn3"] if args.parameters == SOURCED else list(parameter_set_targets(args.parameters))
        run_and_write((args.models or "qwen3-30b-a3b,llama3-8b").split(","), targets, layers=args.layers,
                      cache_len=args.cache_len, per_op=not args.no_per_op, json_path=args.json,
                      html_dir=args.html_dir, parameter_set=args.parameters)
    except ParameterSetError as e:
        print(f"fusegraph bench: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_kernel(args: argparse.Namespace) -> int:
    from ..api.kernel import build_decode_kernel

    if args.profile:
        try:
            check_parameter_set(args.parameters, [args.target])
        except ParameterSetError as e:
            print(f"fusegraph kernel: {e}", file=sys.stderr)
            return 2
    progress = Progress(None)
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
        prof = profile_shape_only(gen, args.target, progress)
        est = estimate_kernel(build_view(gen.source, prof), load_params(args.target, args.parameters))
        print(f"modeled on {args.target} (one core, cost-model parameters: {args.parameters}): "
              f"{est.seconds * 1e3:.3f} ms per step, "
              f"{est.per_layer_seconds() * 1e6:.1f} us per layer, {est.total.bound()}-bound", file=sys.stderr)
    return 0


def write_report_html(args: argparse.Namespace, cap: Any, report: Any) -> str:
    """``fusegraph report --html``: the capture's graph/regions/decisions plus the modeled kernel of the model."""
    from . import html
    from .analysis import NotRun, analyze_model

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
    if isinstance(perf, NotRun):
        print(f"(no modeled performance in the HTML report: the kernel was not run: {perf.reason})", file=sys.stderr)
        perf = None
    data = report.to_dict() if hasattr(report, "to_dict") else dict(report or {})
    text = html.render(title=f"fusegraph report: {args.model}", perf=perf.to_dict() if perf else None,
                       program=cap.program, analysis=getattr(report, "analysis", None), report=data,
                       source=perf.build.generated.source if perf else None)
    with open(args.html, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.html}")
    return args.html
