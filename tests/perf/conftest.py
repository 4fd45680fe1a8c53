"""Shared, session-scoped builds of the tiny MoE model (kept small: tests/perf must stay fast)."""
import pytest


@pytest.fixture(scope="session")
def tiny_perfs():
    """The full pipeline (capture -> match -> codegen -> profile -> cost model) on the tiny MoE model (cache of 64
    positions), on trn2 and trn3: one capture shared by both targets."""
    from fusegraph.modelperf.analysis import ModelPerf, analyze_model

    perfs = analyze_model("qwen3-moe-tiny", ["trn2", "trn3"], cache_len=64)
    assert all(isinstance(p, ModelPerf) for p in perfs.values()), perfs
    return perfs


@pytest.fixture(scope="session")
def tiny_builds(tiny_perfs):
    """The tiny Qwen3-MoE decode megakernel the pipeline builds, profiled on trn2 and trn3."""
    return {t: p.build for t, p in tiny_perfs.items()}


@pytest.fixture(scope="session")
def tiny_program(tiny_perf):
    """The captured ATen program of the tiny Qwen3-MoE decode step (cache of 64 positions)."""
    return tiny_perf.program


@pytest.fixture(scope="session")
def tiny_perf(tiny_perfs):
    """The tiny MoE model on trn2."""
    return tiny_perfs["trn2"]
