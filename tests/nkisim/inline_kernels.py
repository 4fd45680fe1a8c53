"""Kernels written inline in the interpreter's tests: load one from source, or run it and expect a rule error at
the line marked ``# <-`` (every rule error must name the kernel line that broke it)."""
from __future__ import annotations

import itertools
import textwrap
from typing import Any

import pytest

from fusegraph import nkisim
from fusegraph.nkisim import NkiSimError, load_kernel_source

HDR = "import nki\nimport nki.language as nl\nimport nki.isa as nisa\n"
_n = itertools.count()


def build(body: str, name: str = "k", target: str | None = "trn2", header: str = HDR,
          prefix: str = "kernel") -> tuple[Any, str]:
    """The kernel ``name`` of ``header + body`` (loaded for ``target``; None: the interpreter's default) and the
    location of its line marked ``# <-`` (the file name alone when none is marked)."""
    src = header + textwrap.dedent(body)
    fname = f"/virtual/{prefix}_{next(_n)}.py"
    ns = load_kernel_source(src, fname) if target is None else load_kernel_source(src, fname, target=target)
    marked = [i + 1 for i, line in enumerate(src.splitlines()) if "# <-" in line]
    return ns[name], (f"{fname}:{marked[0]}" if marked else fname)


def expect(rule: str, body: str, *args: Any, match: str = "", exc: type = NkiSimError, target: str | None = "trn2",
           header: str = HDR, **kw: Any) -> NkiSimError:
    """Run the kernel of ``body`` on ``args``: it must raise ``exc`` of ``rule`` at the marked line, its message
    containing ``match``."""
    k, loc = build(body, target=target, header=header)
    with pytest.raises(exc) as ei:
        nkisim.run(k, *args, **({"target": target} if target is not None else {}), **kw)
    e = ei.value
    assert e.rule == rule, str(e)
    assert loc in str(e), f"expected location {loc} in: {e}"
    assert match in str(e), str(e)
    return e
