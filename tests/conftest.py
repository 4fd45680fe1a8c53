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
    yield
    torch._dynamo.reset()
