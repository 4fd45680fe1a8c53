"""Shared fixtures: the hand-written kernels, imported with `import nki` bound to the interpreter."""

import importlib
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def K():
    """The kernels module (tests/nkisim/nki_kernels.py) imported inside as_nki(); its kernels run on trn2 (fusegraph's
    default target) unless a run passes target= -- the interpreter's own default is trn3, like nki.simulate."""
    from fusegraph.nkisim import as_nki
    from fusegraph.nkisim.jit import Kernel
    from fusegraph.nkisim.targets import get_target

    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    with as_nki(target="trn2"):
        mod = importlib.import_module("nki_kernels")
    for v in vars(mod).values():
        if isinstance(v, Kernel):
            v.default_target = get_target("trn2")
    return mod
