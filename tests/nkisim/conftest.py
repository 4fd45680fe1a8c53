"""Shared fixtures: the hand-written kernels, imported with `import nki` bound to the interpreter."""

import importlib
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def K():
    """The kernels module (tests/nkisim/nki_kernels.py) imported inside as_nki()."""
    from fusegraph.nkisim import as_nki

    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    with as_nki():
        mod = importlib.import_module("nki_kernels")
    return mod
