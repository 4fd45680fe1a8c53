"""The ``fusegraph`` command line.

Each command imports what it runs (torch, transformers, the pipeline, the LLM tools, jax) inside its function:
the parser, ``--help`` and ``options`` start in a tenth of a second, without torch.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Sequence

from .modelperf.cli import (ATTN_IMPLEMENTATIONS, DTYPES, EXPERTS_IMPLEMENTATIONS, OneLineErrorParser,
                            add_commands as _perf_commands, add_model_flags, add_report_html_flag, check_model,
                            positive_int, write_report_html)
from .perf.progress import Progress, UsageError
from .settings import DEFAULT_TARGET, TARGETS


def _parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``--option NAME=VALUE`` pairs, validated like the backend validates them (a bad name or value is a
    :class:`UsageError` naming it, before anything is built)."""
    from .settings import FusegraphOptionError, Settings

    out: dict[str, Any] = {}
    for p in pairs:
        if "=" not in p:
            raise UsageError(f"--option expects NAME=VALUE, got {p!r}")
        k, v = p.split("=", 1)
        out[k.strip()] = v.strip()
    try:
        Settings.from_options(out)
    except (FusegraphOptionError, ValueError, TypeError) as e:
        raise UsageError(f"--option: {e}") from None
    return out


def cmd_models(_: argparse.Namespace) -> int:
    from .models import MODELS

    for spec in MODELS.values():
        print(f"{spec.name:<16} {spec.description}")
    return 0


def cmd_options(args: argparse.Namespace) -> int:
    from .settings import describe_options

    print(describe_options(markdown=args.markdown))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    import torch

    from .api.capture import capture_step
    from .models import build_decode
    from .models.user import is_user_spec, load_user_step

    options = _parse_options(args.option)
    jax = getattr(args, "frontend", "torch") == "jax"
    args.model = args.model or ("llama-tiny" if jax else "qwen3-moe-tiny")
    if jax:
        from .jax.cli import cmd_report_jax  # imports jax only on this path

        return cmd_report_jax(args, options)
    check_model(args.model, args.size)
    progress = Progress.for_cli()
    if is_user_spec(args.model):
        with progress.step(f"{args.model}: build (user code) and capture"):
            user = load_user_step(args.model)
            case = user.case
            reference = case.fork() if case is not None and case.token.device.type != "meta" else None
            cap = capture_step(user.fn, *user.args, options=options, **user.kwargs)
        progress.finish()
        print(f"model {args.model} (user code)")
    else:
        with progress.step(f"{args.model}: build"):
            case = build_decode(args.model, dtype=args.dtype, attn=args.attn, experts=args.experts,
                                batch=args.batch, max_cache_len=args.max_cache_len, num_layers=args.layers)
            reference = case.fork() if case.token.device.type != "meta" else None
        with progress.step(f"{args.model}: capture, match and compile"):
            cap = capture_step(case.step, case.token, case.position, options=options)
        progress.finish()
        print(f"model {args.model} ({case.model.config.model_type}, {case.dtype}, attn={args.attn}"
              + (f", experts={args.experts}" if "moe" in case.model.config.model_type else "")
              + f", batch {args.batch})")
    summary = cap.summary()
    print(cap.format())
    if reference is not None:
        # the first call of a kernel is verified against eager and returns eager's values; a second step shows
        # what the kernel itself computes
        compiled = cap.extra["compiled"]
        with torch.no_grad():
            expected = reference.step(reference.token, reference.position)
            diff = (cap.outputs.float() - expected.float()).abs().max().item()
            nxt = expected[:, -1].argmax(-1, keepdim=True)
            got2 = compiled(nxt, case.position + 1)
            exp2 = reference.step(nxt, reference.position + 1)
        diff2 = (got2.float() - exp2.float()).abs().max().item()
        cache_diff = max((a.float() - b.float()).abs().max().item()
                         for a, b in zip(case.cache_tensors(), reference.cache_tensors()))
        summary["check"] = {"max_abs_diff_vs_eager": diff, "step2_max_abs_diff_vs_eager": diff2,
                            "logit_scale": exp2.abs().max().item(), "kv_cache_max_abs_diff": cache_diff,
                            "kv_cache_equal": cache_diff == 0.0}
        print(f"compiled vs eager: step 1 max |diff| = {diff:.3g}; step 2 max |diff| = {diff2:.3g} "
              f"(logit scale {exp2.abs().max().item():.3g}); KV cache max |diff| = {cache_diff:.3g}")
    from .report import report_for_session

    report = report_for_session(cap.session)
    print(report.format())
    if args.json:
        data = report.to_dict()
        if "check" in summary:
            data["check"] = summary["check"]
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2, default=str)
        print(f"wrote {args.json}")
    if getattr(args, "html", None):
        write_report_html(args, cap, report)
    return 0


def cmd_nki_run(args: argparse.Namespace) -> int:
    from .nkisim import cli as nki_cli

    rest = list(args.rest)
    if args.verbose:  # `fusegraph -v nki-run FILE`: the interpreter's own --verbose (before the file's `--` args)
        i = rest.index("--") if "--" in rest else len(rest)
        rest[i:i] = ["--verbose"]
    return nki_cli.main(rest)


def cmd_export_sft(args: argparse.Namespace) -> int:
    from .llm.harness import Limits
    from .llm.sft import export

    stats = export(args.out, max_examples=args.max, seed=args.seed, sweep_name=args.sweep, cards=not args.no_cards,
                   target=args.target, limits=Limits(timeout_s=args.timeout), experience=args.experience,
                   include_benchmark=args.include_benchmark)
    print(stats.summary())
    return 0 if stats.examples or args.max == 0 else 1


def cmd_llm_eval(args: argparse.Namespace) -> int:
    from .llm.evaluate import evaluate
    from .llm.evalset import EVALSET_VERSION, PROBLEMS

    if args.list:
        for p in PROBLEMS:
            print(f"{p.name:<20} {p.summary}")
        print(f"(problem set v{EVALSET_VERSION})")
        return 0
    if not args.url or not args.model:
        print("llm-eval needs --url and --model (or --list)", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.problems.split(",") if n.strip()] if args.problems else None

    def progress(r: Any) -> None:
        print(f"  {r.problem}: {'correct' if r.correct else r.stage} after {r.requests} request(s)", flush=True)

    try:
        report = evaluate(args.url, args.model, rounds=args.rounds, problems=names, target=args.target,
                          timeout_s=args.timeout, max_tokens=args.max_tokens, run_timeout_s=args.run_timeout,
                          experience_dir=args.experience or "", progress=progress)
    except KeyError as e:
        print(f"llm-eval: {e.args[0]}", file=sys.stderr)
        return 2
    print(report.format())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=2)
        print(f"wrote {args.json}")
    t = report.totals()
    return 1 if t["problems"] and t["endpoint_errors"] == t["problems"] else 0


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="fusegraph", description="Fuse an LLM decode step into one NKI megakernel.")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log at INFO level; show the interpreter's stack with a kernel's rule error")
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("report", help="capture a model's decode step; print what was captured and the "
                       "fused-region report")
    add_model_flags(r, default=None)  # qwen3-moe-tiny; llama-tiny with --frontend jax
    r.add_argument("--frontend", default="torch", choices=("torch", "jax"),
                   help="torch (HF transformers models) or jax (llama-tiny, keras-llama-tiny, keras-mixtral-tiny; "
                   "needs fusegraph[jax])")
    r.add_argument("--dtype", default=None, choices=DTYPES, help="default: the model's")
    r.add_argument("--attn", default="eager", choices=ATTN_IMPLEMENTATIONS, help="HF attention implementation")
    r.add_argument("--experts", default="batched_mm", choices=EXPERTS_IMPLEMENTATIONS,
                   help="HF MoE experts implementation")
    r.add_argument("--batch", type=positive_int, default=1)
    r.add_argument("--layers", type=positive_int, default=None, help="override the number of decoder layers")
    r.add_argument("--max-cache-len", type=positive_int, default=32)
    r.add_argument("--option", action="append", default=[], metavar="NAME=VALUE", help="a fusegraph option (repeatable)")
    r.add_argument("--json", default=None, help="also write the fused-region report (schema: docs/report.md) as JSON")
    add_report_html_flag(r)
    r.set_defaults(func=cmd_report)

    sub.add_parser("models", help="list the bundled model configs").set_defaults(func=cmd_models)
    o = sub.add_parser("options", help="list every fusegraph option with its default")
    o.add_argument("--markdown", action="store_true", help="as the markdown table of docs/options.md")
    o.set_defaults(func=cmd_options)

    e = sub.add_parser("export-sft", help="write verified chat-format NKI training data (kernels + API fact cards)")
    e.add_argument("out", metavar="OUT.jsonl", help="output file (a side file OUT.meta.jsonl is written next to it)")
    e.add_argument("--max", type=int, default=None, help="at most N kernel examples")
    e.add_argument("--seed", type=int, default=0, help="shuffles the sweep before --max and seeds verification")
    e.add_argument("--sweep", default="small", choices=("small", "large"), help="shapes x dtypes to export")
    e.add_argument("--no-cards", action="store_true", help="kernel examples only")
    e.add_argument("--target", default=DEFAULT_TARGET, choices=TARGETS)
    e.add_argument("--timeout", type=float, default=120.0, help="verification time limit per example (s)")
    e.add_argument("--experience", default=None, metavar="DIR",
                   help="also write repair trajectories (OUT.trajectories.jsonl) and reward records "
                        "(OUT.rewards.jsonl) from the writer's experience records in DIR "
                        "(<llm cache dir>/experience, or llm-eval --experience DIR)")
    e.add_argument("--include-benchmark", action="store_true",
                   help="also export experience records of llm-eval runs (left out by default: they answer the "
                        "benchmark's held-out problems; included records stay marked source=llm-eval)")
    e.set_defaults(func=cmd_export_sft)

    v = sub.add_parser("llm-eval", help="score an NKI-writing model (OpenAI-compatible endpoint) on the fixed "
                       "problem set, through the writer's harness")
    v.add_argument("--url", default="", help="endpoint, e.g. http://localhost:8000/v1 (token: FUSEGRAPH_LLM_API_KEY)")
    v.add_argument("--model", default="", help="model name sent with each request")
    v.add_argument("--rounds", type=int, default=2, help="repair rounds after the first answer (0: the model alone)")
    v.add_argument("--problems", default="", help="comma-separated problem names (default: all; see --list)")
    v.add_argument("--json", default=None, help="also write the full results as JSON")
    v.add_argument("--list", action="store_true", help="list the problems and exit")
    v.add_argument("--target", default=DEFAULT_TARGET, choices=TARGETS)
    v.add_argument("--timeout", type=float, default=120.0, help="HTTP timeout per request (s)")
    v.add_argument("--max-tokens", type=int, default=4096, help="completion token limit per request")
    v.add_argument("--run-timeout", type=float, default=60.0, help="verification time limit per answer (s)")
    v.add_argument("--experience", default=None, metavar="DIR",
                   help="record every conversation as experience for export-sft --experience")
    v.set_defaults(func=cmd_llm_eval)

    n = sub.add_parser("nki-run", help="run an NKI kernel file on CPU with fusegraph's interpreter "
                       "(`fusegraph nki-run --help`)", add_help=False)
    n.add_argument("rest", nargs=argparse.REMAINDER)
    n.set_defaults(func=cmd_nki_run)
    _perf_commands(sub)
    return p


def _split_nki_run(argv: list[str]) -> tuple[list[str], list[str]] | None:
    """``[global flags] nki-run ARGS...``: the global flags and ARGS, which go to the interpreter's own parser
    unparsed (argparse's REMAINDER would take ``--help`` for the top-level parser's)."""
    i = 0
    while i < len(argv) and argv[i] in ("-v", "--verbose"):
        i += 1
    if i < len(argv) and argv[i] == "nki-run":
        return argv[:i], argv[i + 1:]
    return None


def _run(argv: list[str]) -> int:
    nki = _split_nki_run(argv)
    if nki is not None:
        args = argparse.Namespace(verbose=bool(nki[0]), rest=nki[1], func=cmd_nki_run)
    else:
        args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"fusegraph: error: {e}", file=sys.stderr)
        return 2


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: the reader went away, and the interpreter flushes stdout once more at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (a test's capture)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """The ``fusegraph`` command; returns the exit code. A reader that closes the pipe early (``fusegraph options |
    head``) ends the command quietly with 141, as a process killed by SIGPIPE reports in a shell."""
    try:
        return _run(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:
        _quiet_stdout()
        return 141


if __name__ == "__main__":
    sys.exit(main())
