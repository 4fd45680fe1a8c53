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
from ..perf.measured import band_note
from ..perf.params import (SOURCED, ParameterSetError, calibrations, check_parameter_set, load_params,
                            parameter_set_targets)
from ..perf.progress import Progress, UsageError
from ..settings import DEFAULT_TARGET

DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
EXPERTS_IMPLEMENTATIONS = ("batched_mm", "grouped_mm", "eager")
TARGETS = ("trn2", "trn3")
MODEL_HELP = ("a bundled name (`fusegraph models`), an HF family (model_type: llama, qwen2, mistral, qwen3_moe, "
              "...; random weights), a path to a config.json (random weights), or module:function of your own code")


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse with its errors on one line, ``fusegraph: error: ...`` (exit 2), like every other input error of
    the CLI; ``--help`` still shows the usage."""

    def error(self, message: str) -> Any:  # noqa: D102 - argparse's hook
        command = self.prog.split(" ", 1)[1] + ": " if " " in self.prog else ""
        self.exit(2, f"fusegraph: error: {command}{message}\n")


def positive_int(text: str) -> int:
    """argparse type of counts (``--batch``, ``--layers``, cache lengths): an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_model_flags(parser: argparse.ArgumentParser, default: str | None) -> None:
    """``--model`` and ``--size`` (tiny | full, for an HF family or a config.json)."""
    parser.add_argument("--model", default=default, help=MODEL_HELP + (f" (default {default})" if default else ""))
    parser.add_argument("--size", default="tiny", choices=("tiny", "full"),
                        help="for an HF family or config.json: tiny dimensions with the family's structure (default; "
                        "runs with data on CPU) or the config as written, on the meta device (kernel/bench)")


def check_model(name: str, size: str = "tiny") -> None:
    """Fail with a one-line :class:`UsageError` before anything is built when ``--model`` names nothing buildable;
    a family name or config.json path is registered under ``name`` (:func:`fusegraph.models.resolve_model`)."""
    from ..models import resolve_model
    from ..models.user import is_user_spec, user_function

    try:
        if is_user_spec(name):
            user_function(name)
        else:
            resolve_model(name, size)
    except (KeyError, ValueError) as e:
        raise UsageError(str(e.args[0]) if e.args else str(e)) from None


def add_verbose_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="with a kernel's rule error, also show the interpreter's Python stack")


def report_kernel_error(e: BaseException, verbose: bool, progress: Progress | None = None) -> int:
    """An interpreter rule error of a generated kernel (or codegen refusing the model): its one-line message
    first, the stack only with ``--verbose``; returns the exit code (1)."""
    import traceback

    if progress is not None:
        progress.finish()
    print(f"fusegraph: kernel error: {e}", file=sys.stderr)
    if verbose:
        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    else:
        print("(run with --verbose for the interpreter's stack)", file=sys.stderr)
    return 1


def add_commands(sub: Any) -> None:
    """Register ``bench`` and ``kernel`` on the ``fusegraph`` sub-command parser."""
    b = sub.add_parser("bench", help="model the decode performance of bundled models (cost model on the "
                       "interpreter profile of the kernel the pipeline builds) and compare with the published "
                       "figures; a model/target the pipeline refuses is reported as not run, with the reason")
    b.add_argument("--models", default=None, help="comma-separated models (default qwen3-30b-a3b,llama3-8b; "
                   "with --against: the spec's model): bundled names, HF families or config.json paths")
    b.add_argument("--size", default="full", choices=("tiny", "full"),
                   help="for an HF family or config.json: full (default; meta device) or tiny dimensions")
    b.add_argument("--targets", default=None, help="default trn2,trn3 (with --against: the spec's target)")
    b.add_argument("--layers", type=positive_int, default=None, help="decoder layers (default: the model's)")
    b.add_argument("--cache-len", type=positive_int, default=640)
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
    add_model_flags(k, default="qwen3-moe-tiny")
    k.add_argument("--target", default=DEFAULT_TARGET, choices=TARGETS)
    k.add_argument("--layers", type=positive_int, default=None)
    k.add_argument("--max-cache-len", type=positive_int, default=None)
    k.add_argument("--out", default=None, help="write the source here instead of printing it")
    k.add_argument("--profile", action="store_true", help="also run it shape-only and print the modeled time")
    add_verbose_flag(k)
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
def _bench_models(args: argparse.Namespace) -> list[str] | None:
    """``--models``, each checked (and a family/config registered) before anything runs or is written."""
    if not args.models:
        return None
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models:
        raise UsageError(f"--models {args.models!r}: no model named")
    for m in models:
        check_model(m, args.size)
    return models


def _bench_targets(args: argparse.Namespace) -> list[str] | None:
    if not args.targets:
        return None
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    bad = [t for t in targets if t not in TARGETS]
    if bad or not targets:
        raise UsageError(f"--targets {args.targets!r}: expected a comma-separated list of {', '.join(TARGETS)}")
    return targets


def cmd_bench(args: argparse.Namespace) -> int:
    targets = _bench_targets(args)
    models = _bench_models(args)
    progress = Progress.for_cli()
    try:
        if targets is not None:
            check_parameter_set(args.parameters, targets)
        if args.against:
            from .against import run_against

            json_path = args.json if args.json != "bench-results/perf.json" else "bench-results/against.json"
            run_against(args.against, args.against_args, models=models, targets=targets, layers=args.layers,
                        cache_len=args.cache_len, paths=args.against_path, json_path=json_path, progress=progress,
                        parameter_set=args.parameters)
            return 0
        from .bench import run_and_write

        if targets is None:  # a calibration runs on its own target by default
            targets = ["trn2", "trn3"] if args.parameters == SOURCED else list(parameter_set_targets(args.parameters))
        run_and_write(models or ["qwen3-30b-a3b", "llama3-8b"], targets, layers=args.layers,
                      cache_len=args.cache_len, per_op=not args.no_per_op, json_path=args.json,
                      html_dir=args.html_dir, parameter_set=args.parameters, progress=progress)
    except ParameterSetError as e:
        raise UsageError(str(e)) from None
    return 0


def cmd_kernel(args: argparse.Namespace) -> int:
    from ..api.kernel import build_decode_kernel
    from ..codegen.errors import CodegenError
    from ..nkisim import NkiSimError

    if args.profile:
        try:
            check_parameter_set(args.parameters, [args.target])
        except ParameterSetError as e:
            raise UsageError(str(e)) from None
    check_model(args.model, args.size)
    progress = Progress.for_cli()
    case_kwargs: dict[str, Any] = {}
    if args.layers is not None:
        case_kwargs["num_layers"] = args.layers
    if args.max_cache_len is not None:
        case_kwargs["max_cache_len"] = args.max_cache_len
    verbose = bool(getattr(args, "verbose", False))
    try:
        with progress.step(f"{args.model}: capture, match, codegen ({args.target})"):
            gen = build_decode_kernel(args.model, target=args.target, profile=False, case_kwargs=case_kwargs,
                                      progress=progress.update).generated
    except (NkiSimError, CodegenError) as e:  # no kernel for this model (no region, over budget, a rule)
        return report_kernel_error(e, verbose, progress)
    progress.finish()
    if args.out:
        with open(args.out, "w") as f:
            f.write(gen.source)
        print(f"wrote {args.out} ({gen.source.count(chr(10))} lines, {len(gen.program.instructions)} instructions)")
    else:
        sys.stdout.write(gen.source)
        sys.stdout.flush()
    if args.profile:
        try:
            with progress.step(f"{args.model}: shape-only profile ({args.target})"):
                prof = profile_shape_only(gen, args.target, progress)
        except NkiSimError as e:
            return report_kernel_error(e, verbose, progress)
        with progress.step(f"{args.model}: cost model ({args.parameters})"):
            est = estimate_kernel(build_view(gen.source, prof), load_params(args.target, args.parameters))
        progress.finish()
        print(f"modeled on {args.target} (one core, cost-model parameters: {args.parameters}): "
              f"{est.seconds * 1e3:.3f} ms per step, "
              f"{est.per_layer_seconds() * 1e6:.1f} us per layer, {est.total.bound()}-bound", file=sys.stderr)
        print(band_note(args.parameters, args.target), file=sys.stderr)
    return 0


def write_report_html(args: argparse.Namespace, cap: Any, report: Any) -> str:
    """``fusegraph report --html``: the capture's graph/regions/decisions plus the modeled kernel of the model."""
    from . import html
    from .analysis import NotRun, analyze_model

    progress = Progress.for_cli()
    target = getattr(cap.session.settings, "target", "trn2") or "trn2"
    perf = None
    try:
        perfs = analyze_model(args.model, [target], layers=args.layers,
                              cache_len=getattr(args, "max_cache_len", None) or 640, like_for_like=None,
                              progress=progress)
        perf = perfs[target]
    except Exception as e:  # noqa: BLE001 - the capture part of the report is still worth writing
        progress.finish()
        print(f"(no modeled performance in the HTML report: {type(e).__name__}: {e})", file=sys.stderr)
    progress.finish()
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
