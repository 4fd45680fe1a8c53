"""The ``partition-alignment`` rule against the architecture guide and hardware-tested kernels.

The guide (``nki/guides/architecture/trainium_inferentia2_arch.rst``, "Cross-Partition Connectivity") documents the
src -> dst movement of a Vector/Scalar/GpSimd instruction: cross-half for 32 < n <= 64 partitions, cross-quadrant for
n <= 32, none above 64.  It says nothing about two inputs; the rule follows the kernels that ran on hardware:

* nki-library ``qkv_tkg`` at its own accuracy-test shape (``test_qkv_tkg.py``: lnc 2, B=8, S=5, d_head 64) adds PSUM
  rows [64, 104) to SBUF rows [0, 40) (``_accumulate_psum_to_output``): an SBUF and a PSUM input on different halves
  are accepted;
* nki-library ``RoPE_sbuf`` copies the upper half of an SBUF tile before ``tensor_tensor`` with another SBUF tile
  ("required for tensor_tensor base partition alignment"): two >32-partition inputs in one memory stay rejected.
"""

import itertools
import textwrap

import numpy as np
import pytest

from fusegraph import nkisim
from fusegraph.nkisim import NkiValidationError, load_kernel_source

HDR = "import nki\nimport nki.language as nl\nimport nki.isa as nisa\n"
_n = itertools.count()


def build(body: str):
    src = HDR + textwrap.dedent(body)
    return load_kernel_source(src, f"/virtual/palign_{next(_n)}.py", target="trn2")["k"]


QKV_ACCUMULATE = """
@nki.jit
def k(a, b):
    # qkv_tkg's _accumulate_psum_to_output at B*S = 40 with array tiling 64: out[0:40] += psum[64:104]
    acc = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=acc[0:40, :], src=a)
    src = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=src[64:104, :], src=b)
    ps = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.psum)
    nisa.tensor_copy(dst=ps[64:104, :], src=src[64:104, :])
    nisa.tensor_tensor(dst=acc[0:40, :], data1=acc[0:40, :], data2=ps[64:104, :], op=nl.add)
    out = nl.ndarray((40, 64), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=acc[0:40, :])
    return out
"""


def test_sbuf_and_psum_inputs_on_different_halves_are_accepted_and_computed():
    r = np.random.default_rng(0)
    a = r.standard_normal((40, 64)).astype(np.float32)
    b = r.standard_normal((40, 64)).astype(np.float32)
    got = nkisim.run(build(QKV_ACCUMULATE), a, b)
    np.testing.assert_array_equal(got, a + b)  # one fp32 add per element: exactly NumPy's


def test_two_sbuf_inputs_on_different_halves_are_rejected():
    # (two PSUM inputs are refused earlier by tensor_tensor's own rule: rule "buffer")
    k = build("""
    @nki.jit
    def k(x):
        t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=1.0)
        o = nl.ndarray((40, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=o, data1=t[0:40, :], data2=t[64:104, :], op=nl.add)
        return x
    """)
    with pytest.raises(NkiValidationError) as ei:
        nkisim.run(k, np.zeros((1, 1), np.float32))
    assert ei.value.rule == "partition-alignment"
    assert "both in SBUF" in str(ei.value)


def test_quadrant_offset_inputs_up_to_32_partitions_are_accepted():
    k = build("""
    @nki.jit
    def k(a):
        t = nl.ndarray((128, 16), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[0:32, :], src=a)
        nisa.dma_copy(dst=t[96:128, :], src=a)
        o = nl.ndarray((32, 16), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=o, data1=t[0:32, :], data2=t[96:128, :], op=nl.multiply)
        out = nl.ndarray((32, 16), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=o)
        return out
    """)
    a = np.random.default_rng(1).standard_normal((32, 16)).astype(np.float32)
    np.testing.assert_array_equal(nkisim.run(k, a), a * a)
