"""``fusegraph nki-run FILE.py [--target trn3] [--lnc 2] [--profile out.json] [-- ARGS...]``

Arguments after ``--`` are passed to the file (``sys.argv[1:]``).

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
from .modules import as_nki


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fusegraph nki-run",
        description="Run an NKI kernel file on CPU with fusegraph's interpreter (import nki resolves to it).",
    )
    p.add_argument("file", help="Python file to execute as __main__")
    p.add_argument("--target", default=None,
                   help="trn2|gen3 or trn3|gen4 (default: NEURON_PLATFORM_TARGET_OVERRIDE, else trn3 as nki.simulate)")
    p.add_argument("--lnc", type=int, choices=(1, 2), default=None, help="default LNC for kernels called without [lnc]")
    p.add_argument("--profile", default=None, help="write the profiles of all kernel runs to this JSON file")
    return p


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
        print(f"fusegraph nki-run: no such file: {ns.file}", file=sys.stderr)
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
    except Exception:  # noqa: BLE001 - a CLI reports any failure of the executed file
        traceback.print_exc()
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
