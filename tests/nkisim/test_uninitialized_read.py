"""Reading SBUF/PSUM elements never written since their allocation is flagged, naming the instruction and the
tile, instead of a silent NaN in the result: a warning by default (hardware-tested nki-library kernels do it
legitimately), the ``uninitialized-read`` rule error with ``FUSEGRAPH_NKISIM_UNINITIALIZED=error``; reading only
the written part is legal."""
import functools

import numpy as np
import pytest

from fusegraph import nkisim
from fusegraph.nkisim import NkiValidationError

import inline_kernels  # noqa: E402

build = functools.partial(inline_kernels.build, prefix="uninit")
expect = functools.partial(inline_kernels.expect, exc=NkiValidationError)


X = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)


@pytest.fixture(autouse=True)
def strict(monkeypatch):
    monkeypatch.setenv("FUSEGRAPH_NKISIM_UNINITIALIZED", "error")


def test_reading_a_tile_never_written_is_a_rule_error():
    e = expect("uninitialized-read", """
    @nki.jit
    def k(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf, name="never_written")
        u = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=u, src=t)  # <-
        nisa.dma_copy(dst=out, src=u)
        return out
    """, X, exc=NkiValidationError)
    assert "nisa.tensor_copy" in str(e) and "'never_written'" in str(e) and "8192 of 8192 elements" in str(e)


def test_by_default_it_is_one_warning_naming_the_tile_and_the_instruction(monkeypatch):
    from fusegraph import FusegraphWarning
    from fusegraph.warnings import reset_warnings

    monkeypatch.delenv("FUSEGRAPH_NKISIM_UNINITIALIZED")
    reset_warnings()
    k, loc = build("""
    @nki.jit
    def k(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf, name="half_written")
        nisa.dma_copy(dst=t[:, 0:32], src=x[:, 0:32])
        for _ in range(3):
            nisa.dma_copy(dst=out, src=t)  # <-
        u = nl.ndarray((128, 32), dtype=nl.float32, buffer=nl.sbuf, name="other")
        nisa.dma_copy(dst=out[:, 32:64], src=u)
        return out
    """)
    with pytest.warns(FusegraphWarning) as caught:
        got = nkisim.run(k, X)
    msgs = [str(w.message) for w in caught if "uninitialized-read" in str(w.message)]
    assert len(msgs) == 1 and "nisa.dma_copy" in msgs[0] and "'half_written'" in msgs[0] and loc in msgs[0]
    assert "kernel k:" in msgs[0]  # one warning per kernel: the first read names the tile, the rest stay quiet
    np.testing.assert_array_equal(got[:, 0:32], X[:, 0:32])
    assert np.isnan(got[:, 32:]).all()  # the run itself is unchanged
    monkeypatch.setenv("FUSEGRAPH_NKISIM_UNINITIALIZED", "off")
    reset_warnings()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nkisim.run(k, X)


def test_reading_past_the_written_part_names_the_unwritten_count():
    expect("uninitialized-read", """
    @nki.jit
    def k(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:, 0:32], src=x[:, 0:32])
        nisa.dma_copy(dst=out, src=t)  # <-
        return out
    """, X, match="reads 4096 of 8192 elements", exc=NkiValidationError)


def test_psum_never_written_is_flagged_too():
    expect("uninitialized-read", """
    @nki.jit
    def k(x):
        out = nl.ndarray((128, 64), dtype=x.dtype, buffer=nl.shared_hbm)
        ps = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.psum)
        r = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=r, src=ps)  # <-
        nisa.dma_copy(dst=out, src=r)
        return out
    """, X, match="(psum", exc=NkiValidationError)


def test_reading_only_the_written_part_is_legal():
    k, _ = build("""
    @nki.jit
    def k(x):
        out = nl.ndarray((128, 32), dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:, 32:64], src=x[:, 0:32])
        u = nl.ndarray((128, 32), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=u, src=t[:, 32:64])
        nisa.dma_copy(dst=out, src=u)
        return out
    """)
    np.testing.assert_array_equal(nkisim.run(k, X), X[:, 0:32])


def test_memset_and_filled_allocations_count_as_written():
    k, _ = build("""
    @nki.jit
    def k(x):
        out = nl.ndarray((128, 64), dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=2.0)
        z = nl.zeros((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=t, data1=t, data2=z, op=nl.add)
        nisa.dma_copy(dst=out, src=t)
        return out
    """)
    np.testing.assert_array_equal(nkisim.run(k, X), np.full((128, 64), 2.0, np.float32))


def test_shape_only_runs_are_not_checked():
    k, _ = build("""
    @nki.jit
    def k(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=out, src=t)
        return out
    """)
    nkisim.run(k, nkisim.Abstract((128, 64), "float32"), shape_only=True)


def test_device_print_of_unwritten_memory_is_not_an_error(capsys):
    k, _ = build("""
    @nki.jit
    def k(x):
        t = nl.ndarray((2, 2), dtype=nl.float32, buffer=nl.sbuf)
        nl.device_print("t", t)
        return x
    """)
    nkisim.run(k, X)
    assert "nan" in capsys.readouterr().out
