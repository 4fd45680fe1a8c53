"""as_nki() / load_kernel_source(): binding `nki` without leaving modules behind; targets; launch forms."""

import linecache
import sys
import traceback
import types

import numpy as np
import pytest

from fusegraph import nkisim
from fusegraph.nkisim import as_nki, load_kernel_source

NAMES = ("nki", "nki.language", "nki.isa", "nki.collectives", "nki.typing", "nki.isa.constants")

SRC = """\
import nki
import nki.language as nl
import nki.isa as nisa
from nki import collectives as nccl
from nki.isa.constants import dge_mode
import nki.typing as nt


@nki.jit
def double(x: nt.tensor[128, 64]):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x, dge_mode=dge_mode.swdge)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
    nisa.dma_copy(dst=out, src=t)
    return out


@nki.jit
def broken(x):
    t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=t, data1=t, data2=x, op=nl.add)
    return x
"""


def test_as_nki_leaves_sys_modules_clean():
    for n in NAMES:
        assert n not in sys.modules
    with as_nki() as nki:
        import nki as imported
        import nki.isa as nisa
        import nki.language as nl

        assert imported is nki and nisa.dma_copy and nl.sbuf
        assert all(n in sys.modules for n in NAMES)
    for n in NAMES:
        assert n not in sys.modules


def test_as_nki_restores_a_preexisting_nki():
    fake = types.ModuleType("nki")
    sys.modules["nki"] = fake
    try:
        with as_nki():
            assert sys.modules["nki"] is not fake
        assert sys.modules["nki"] is fake
        assert "nki.isa" not in sys.modules
    finally:
        del sys.modules["nki"]


def test_as_nki_nested_and_on_exception():
    with pytest.raises(RuntimeError):
        with as_nki(target="trn2"):
            with as_nki(target="trn3"):
                assert sys.modules["nki"].isa.get_nc_version().name == "gen4"
            assert sys.modules["nki"].isa.get_nc_version().name == "gen3"
            raise RuntimeError("boom")
    assert "nki" not in sys.modules


def test_load_kernel_source_runs_without_sys_modules():
    ns = load_kernel_source(SRC, "/virtual/gen_kernel.py")
    assert "nki" not in sys.modules
    x = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)
    np.testing.assert_array_equal(ns["double"](x), 2 * x)
    assert "nki" not in sys.modules
    assert linecache.getline("/virtual/gen_kernel.py", 14).strip().startswith("nisa.tensor_scalar")
    site_lines = {s.line for s in nkisim.last_profile().sites}
    assert site_lines == {13, 14, 15}


def test_tracebacks_show_kernel_lines():
    ns = load_kernel_source(SRC, "/virtual/gen_kernel2.py")
    with pytest.raises(nkisim.NkiValidationError) as ei:
        ns["broken"](np.zeros((128, 64), np.float32))
    tb = "".join(traceback.format_exception(ei.value))
    assert "nisa.tensor_tensor(dst=t, data1=t, data2=x, op=nl.add)" in tb
    assert "/virtual/gen_kernel2.py:22" in str(ei.value)
    assert ei.value.rule == "buffer"


def test_load_kernel_source_target():
    src = SRC.replace("nisa.tensor_scalar(", "nisa.exponential(dst=t, src=t)\n    nisa.tensor_scalar(")
    x = np.zeros((128, 64), np.float32)
    ns3 = load_kernel_source(src, "/virtual/gen_trn3.py", target="trn3")
    np.testing.assert_array_equal(ns3["double"](x), 2 * np.ones_like(x))
    ns2 = load_kernel_source(src, "/virtual/gen_trn2.py", target="trn2")
    with pytest.raises(nkisim.NkiValidationError, match="only available on NeuronCore-v4"):
        ns2["double"](x)


def test_target_from_env(monkeypatch):
    ns = load_kernel_source(SRC.replace("@nki.jit\ndef double", "def double"), "/virtual/gen_env.py")
    k = ns["double"]
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "gen4")
    nkisim.run(k, np.zeros((128, 64), np.float32))
    assert nkisim.last_profile().target == "trn3"
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
    with pytest.raises(ValueError, match="not supported"):
        nkisim.run(k, np.zeros((128, 64), np.float32))
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    nkisim.run(k, np.zeros((128, 64), np.float32))
    assert nkisim.last_profile().target == "trn2"
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE")
    nkisim.run(k, np.zeros((128, 64), np.float32))
    assert nkisim.last_profile().target == "trn3"  # unset: trn3, the nki.simulate default without a Neuron chip


def test_launch_forms():
    ns = load_kernel_source(SRC, "/virtual/gen_launch.py")
    nki = nkisim.nki_modules()["nki"]
    x = np.ones((128, 64), np.float32)
    k = ns["double"]
    for fn in (k, nki.simulate(k), k[1], nki.simulate(k[2]), nki.jit(k.func), nki.jit()(k.func)):
        np.testing.assert_array_equal(fn(x), 2 * x)
    with pytest.raises(nkisim.NkiUsageError):
        k[2, 2]
    with pytest.raises(nkisim.NkiUsageError):
        k[4]
    with pytest.raises(nkisim.NkiUsageError, match="platform_target"):
        nki.jit(k.func, platform_target="trn2")


def test_outputs_update_bf16_inputs_in_place():
    import ml_dtypes

    src = """
import nki
import nki.language as nl
import nki.isa as nisa

@nki.jit
def inc(x):
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
    nisa.dma_copy(dst=x, src=t)
    return x
"""
    ns = load_kernel_source(src, "/virtual/inplace.py")
    x = np.zeros((128, 8), dtype=ml_dtypes.bfloat16)
    out = ns["inc"](x)
    assert out is x and float(x[5, 5]) == 1.0
    xs = np.zeros((8, 128), dtype=ml_dtypes.bfloat16).T  # non-contiguous: copied in and back
    ns["inc"](xs)
    assert float(xs[3, 3]) == 1.0


def test_torch_inputs():
    import torch

    ns = load_kernel_source(SRC, "/virtual/torch_in.py")
    x = torch.ones(128, 64, dtype=torch.bfloat16)
    out = ns["double"](x)
    assert np.asarray(out, dtype=np.float32).max() == 2.0


def test_official_backend_is_reported_missing():
    ns = load_kernel_source(SRC, "/virtual/official.py")
    with pytest.raises(nkisim.NkiUsageError, match="needs the Neuron SDK"):
        nkisim.run(ns["double"], np.ones((128, 64), np.float32), backend="official")


def test_arguments_without_an_nki_dtype_are_rejected():
    ns = load_kernel_source(SRC, "/virtual/f64.py")
    with pytest.raises(nkisim.NkiValidationError, match="not an NKI dtype"):
        ns["double"](np.zeros((128, 64), dtype=np.float64))
