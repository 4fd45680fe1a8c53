import os
import warnings

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch and sees every fusegraph warning (they are deduplicated per process)."""
    import torch._dynamo

    from fusegraph.warnings import reset_warnings

    torch._dynamo.reset()
    reset_warnings()
    # fusegraph may make a position counter dynamic process-wide (capture/recompiles.py: dynamic_sources); a test
    # that triggers it must not change how later tests capture
    sources = getattr(torch.compiler.config, "dynamic_sources", None)
    yield
    torch._dynamo.reset()
    if sources is not None:
        torch.compiler.config.dynamic_sources = sources


@pytest.fixture
def world1(monkeypatch: pytest.MonkeyPatch):
    """A one-rank default process group (gloo over an in-memory store: no connection is made), for tests of the
    single-process side of tensor parallelism; skipped without gloo or when a group already exists."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    if os.path.exists("/sys/class/net/lo"):
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()
