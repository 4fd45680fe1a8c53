"""The LLM kernel writer inside a compile: ops no pattern and no generic lowering covers (a cumsum) are written by
the (fake) LLM, verified, and run in the isolated worker; every other outcome leaves the step correct."""
import pytest
import torch

from fusegraph import FusegraphWarning
from fusegraph.capture.session import last_session

from .fake_llm import FakeLLM, Trickle
from .kernels import answer

CUMSUM = '''import nki
import nki.language as nl
import nki.isa as nisa


@nki.jit
def island_0(in0):
    out = nl.ndarray(shape=(1, 64), dtype=nl.float32, buffer=nl.shared_hbm, name="out")
    xT = nl.ndarray(shape=(64, 1), dtype=nl.float32, buffer=nl.sbuf, name="xT")
    nisa.dma_copy(dst=xT, src=in0.ap(pattern=[[1, 64], [1, 1]], offset=0))
    ones = nl.ndarray(shape=(64, 64), dtype=nl.float32, buffer=nl.sbuf, name="ones")
    nisa.memset(dst=ones, value=1.0)
    upper = nl.ndarray(shape=(64, 64), dtype=nl.float32, buffer=nl.sbuf, name="upper")
    nisa.affine_select(dst=upper, pattern=[[1, 64]], channel_multiplier=-1, on_true_tile=ones, on_false_value=0.0,
                       cmp_op=nl.greater_equal)
    ps = nl.ndarray(shape=(1, 64), dtype=nl.float32, buffer=nl.psum, name="ps")
    nisa.nc_matmul(dst=ps, stationary=xT, moving=upper)
    y = nl.ndarray(shape=(1, 64), dtype=nl.float32, buffer=nl.sbuf, name="y")
    nisa.tensor_copy(dst=y, src=ps)
    nisa.dma_copy(dst=out, src=y)
    return out
'''

WRONG = CUMSUM.replace("cmp_op=nl.greater_equal", "cmp_op=nl.greater")  # exclusive scan: numerically wrong


def step(x):
    return torch.cumsum(x, dim=-1)


def _compile(url, **kw):
    opts = {"executor": "nkisim", "cache_dir": "off", "llm": {"url": url, "model": "nki-coder"}, **kw}
    return torch.compile(step, backend="fusegraph", options=opts)


@pytest.fixture
def llm_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEGRAPH_LLM_CACHE_DIR", str(tmp_path / "llm"))
    return tmp_path


def test_island_written_by_the_llm_runs_and_is_reported(llm_cache):
    x = torch.randn(1, 64)
    with FakeLLM([answer(CUMSUM)]) as fake:
        f = _compile(fake.url)
        with torch.no_grad():
            out = f(x)
            out2 = f(x + 1)
    torch.testing.assert_close(out, step(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out2, step(x + 1), atol=1e-5, rtol=1e-5)
    stats = last_session().program.newest_execution()
    isl = stats.llm[0]
    assert isl.result.accepted and isl.calls == 2 and not isl.disabled
    assert "aten.cumsum.default" in isl.ops
    assert len(fake.requests) == 1
    assert isl.to_dict()["llm"]["attempts"][0]["accepted"]


def test_wrong_kernel_is_rejected_and_the_step_stays_correct(llm_cache):
    x = torch.randn(1, 64)
    with FakeLLM([answer(WRONG), answer(WRONG), answer(WRONG)]) as fake:
        f = _compile(fake.url, llm_max_rounds=2)
        with pytest.warns(FusegraphWarning, match="LLM kernel for .*cumsum.* not used"):
            with torch.no_grad():
                out = f(x)
    torch.testing.assert_close(out, step(x))
    isl = last_session().program.newest_execution().llm[0]
    assert not isl.result.accepted and len(isl.result.attempts) == 3
    assert all("max abs diff" in a.reason or "differ" in a.reason for a in isl.result.attempts)


def test_endpoint_down_leaves_the_step_correct(llm_cache):
    x = torch.randn(1, 64)
    with pytest.warns(FusegraphWarning, match="LLM kernel for"):
        f = _compile("http://127.0.0.1:9/v1")
        with torch.no_grad():
            out = f(x)
    torch.testing.assert_close(out, step(x))


def test_a_trickling_endpoint_holds_the_compile_only_until_the_deadline(llm_cache):
    """One byte every 0.2 s: the request gives up at llm_timeout_s (total), the step falls back and is correct."""
    import time

    x = torch.randn(1, 64)
    with FakeLLM([Trickle(0.2, CUMSUM)]) as fake:
        f = _compile(fake.url, llm_timeout_s=1.5)
        t0 = time.monotonic()
        with pytest.warns(FusegraphWarning, match="LLM kernel for"):
            with torch.no_grad():
                out = f(x)
        # the first call also compiles; without the deadline the request alone takes ~300 s
        elapsed = time.monotonic() - t0
    torch.testing.assert_close(out, step(x))
    isl = last_session().program.newest_execution().llm[0]
    assert not isl.result.accepted
    (att,) = isl.result.attempts
    assert att.stage == "endpoint" and "within 1.5 s" in att.reason and "total deadline" in att.reason
    assert att.seconds < 1.5 + 1.0 and elapsed < 60
