"""Shared, session-scoped builds of the tiny MoE model (kept small: tests/perf must stay fast)."""
import pytest


@pytest.fixture(scope="session")
def tiny_builds():
    """The tiny Qwen3-MoE decode megakernel built from its config (no capture), profiled on trn2 and trn3."""
    from fusegraph.perf.analysis import build_kernels

    return build_kernels("qwen3-moe-tiny", ["trn2", "trn3"], cache_len=64, prefer="synthetic")


@pytest.fixture(scope="session")
def tiny_program(tiny_perf):
    """The captured ATen program of the tiny Qwen3-MoE decode step (cache of 64 positions)."""
    return tiny_perf.program


@pytest.fixture(scope="session")
def tiny_perf():
    """The full pipeline (capture -> match -> codegen -> profile -> cost model) on the tiny MoE model, trn2."""
    from fusegraph.perf.analysis import analyze_model

    return analyze_model("qwen3-moe-tiny", ["trn2"], cache_len=64)["trn2"]
