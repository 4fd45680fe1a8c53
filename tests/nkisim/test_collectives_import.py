"""``nki.collectives`` is bound only by an explicit import (issue 25 item 3).

The official package's ``nki/__init__.py`` never imports ``nki.collectives`` (SDK 2.29 stub ``nki/api/nki/__init__.py``:
``import nki.language as nl`` only; SDK 2.32: no import), and every public kernel imports it explicitly; so a
kernel that writes ``import nki`` alone and calls ``nki.collectives.all_reduce`` fails on hardware. The
interpreter's kernel namespaces behave the same, and the generated TP kernel imports it.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from fusegraph import nkisim
from fusegraph.codegen.megakernel import generate
from fusegraph.patterns.collectives.lowering import AllReduce
from fusegraph.codegen.testing import Builder
from fusegraph.nkisim import load_kernel_source

_n = itertools.count()
KERNEL = """{imports}
import nki.language as nl
import nki.isa as nisa

@nki.jit
def k(x):
    out = nl.ndarray((2, 8), dtype=nl.float32, buffer=nl.shared_hbm)
    a = nl.ndarray((2, 8), dtype=nl.float32, buffer=nl.sbuf)
    b = nl.ndarray((2, 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=a, src=x)
    nki.collectives.all_reduce(srcs=[a], dsts=[b], replica_group=nki.collectives.ReplicaGroup([[0, 1]]), op=nl.add)
    nisa.dma_copy(dst=out, src=b)
    return out
"""


def _load(imports: str):
    return load_kernel_source(KERNEL.format(imports=imports), f"/virtual/coll_import_{next(_n)}.py", target="trn3")


def test_bare_import_nki_does_not_bind_collectives():
    ns = _load("import nki")
    xs = [np.ones((2, 8), np.float32), np.full((2, 8), 2.0, np.float32)]
    with pytest.raises(AttributeError, match="collectives"):
        nkisim.run(ns["k"], ranks=2, rank_args=[(x,) for x in xs])


@pytest.mark.parametrize("imports", ["import nki\nimport nki.collectives", "import nki\nfrom nki import collectives",
                                     "import nki.collectives as ncc\nimport nki"])
def test_an_explicit_import_binds_it(imports):
    ns = _load(imports)
    xs = [np.ones((2, 8), np.float32), np.full((2, 8), 2.0, np.float32)]
    outs = nkisim.run(ns["k"], ranks=2, rank_args=[(x,) for x in xs])
    for o in outs:
        np.testing.assert_array_equal(o, np.full((2, 8), 3.0, np.float32))


def test_one_namespace_importing_it_does_not_bind_it_in_another():
    with_import = _load("import nki\nimport nki.collectives")
    bare = _load("import nki")
    assert with_import["nki"].collectives is nkisim.nki_modules()["nki.collectives"]
    assert not hasattr(bare["nki"], "collectives") and bare["nki"].language is with_import["nki"].language


def _generated(with_collective: bool) -> str:
    b = Builder(tokens=2)
    x = b.act("x", torch.randn(2, 256))
    y = b.new("y", 256, torch.float32)
    if with_collective:
        b.ins.append(AllReduce(x=x, out=y, ranks=(0, 1), reduce="sum", layer=0))
        b.store(y)
    else:
        b.store(x)
    return generate(b.program(), lnc=1).source


def test_the_generated_tp_kernel_imports_nki_collectives():
    src = _generated(True)
    assert "nki.collectives.all_reduce(" in src
    assert "\nimport nki.collectives\n" in src
    assert "import nki.collectives" not in _generated(False)  # only where the kernel uses collectives
