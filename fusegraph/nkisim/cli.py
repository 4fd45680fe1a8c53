"""``fusegraph nki-run FILE.py [--target trn3] [--lnc 2] [--profile out.json] [--verbose] [-- ARGS...]``

Arguments after ``--`` are passed to the file (``sys.argv[1:]``). An interpreter rule error ends the run with
its one-line message (rule, cause, the kernel's file:line); ``--verbose`` adds the Python stack.

Runs a (third-party) NKI kernel file as ``__main__`` inside :func:`fusegraph.nkisim.as_nki`, so files with their
own NumPy/torch test harness run unchanged on CPU.  ``--lnc 2`` makes kernels called without brackets launch
with LNC=2 (``kernel[lnc]`` in the file still wins).  ``--profile`` writes the profiles of every kernel run as
JSON: ``{"profiles": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import traceback
from typing import Sequence

from . import profile as prof
from .context import set_session_lnc
from .errors import NkiSimError
from .modules import as_nki


class _Parser(argparse.ArgumentParser):
    """Errors on one line (``fusegraph: error: nki-run: ...``, exit 2), as every other ``fusegraph`` command."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(2, f"fusegraph: error: nki-run: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="fusegraph nki-run",
        description="Run an NKI kernel file on CPU with fusegraph's interpreter (import nki resolves to it).",
    )
    p.add_argument("file", help="Python file to execute as __main__")
    p.add_argument("--target", default=None,
                   help="trn2|gen3 or trn3|gen4 (default: NEURON_PLATFORM_TARGET_OVERRIDE, else trn3 as nki.simulate)")
    p.add_argument("--lnc", type=int, choices=(1, 2), default=None, help="default LNC for kernels called without [lnc]")
    p.add_argument("--profile", default=None, help="write the profiles of all kernel runs to this JSON file")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="with an interpreter rule error, also print the Python stack (the interpreter's frames)")
    return p


def report_failure(exc: BaseException, verbose: bool) -> None:
    """How the CLI shows a failure of the executed file: an interpreter rule error as its one-line message (rule,
    what was wrong, the kernel's file:line), the stack only with ``--verbose``; any other exception (the file's
    own code failed) with its traceback."""
    if isinstance(exc, NkiSimError) and not verbose:
        print(f"fusegraph nki-run: {type(exc).__name__}: {exc}", file=sys.stderr)
        print("(run with --verbose for the interpreter's stack)", file=sys.stderr)
        return
    if isinstance(exc, NkiSimError):
        print(f"fusegraph nki-run: {type(exc).__name__}: {exc}", file=sys.stderr)
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    ns = build_parser().parse_args(argv)
    path = os.path.abspath(ns.file)
    if not os.path.isfile(path):
        print(f"fusegraph: error: nki-run: no such file: {ns.file}", file=sys.stderr)
        return 2
    profiles: list[prof.Profile] = []
    prof.add_listener(profiles.append)
    old_argv, old_path = sys.argv[:], sys.path[:]
    sys.argv = [path, *extra]
    sys.path.insert(0, os.path.dirname(path))
    prev_lnc = set_session_lnc(ns.lnc)
    code = 0
    try:
        with as_nki(target=ns.target):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception as exc:  # noqa: BLE001 - a CLI reports any failure of the executed file
        report_failure(exc, ns.verbose)
        code = 1
    finally:
        set_session_lnc(prev_lnc)
        prof.remove_listener(profiles.append)
        sys.argv, sys.path[:] = old_argv, old_path
    if ns.profile:
        with open(ns.profile, "w", encoding="utf-8") as f:
            json.dump({"profiles": [p.to_dict() for p in profiles]}, f, indent=1)
    for p in profiles:
        print(p.summary(), file=sys.stderr)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
