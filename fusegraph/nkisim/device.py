"""``backend="neuron"``: run the kernel on a Neuron device with the real ``nki`` (where the Neuron SDK is installed).

NOT VALIDATED HERE: there is no Neuron device or SDK in this environment; this path only re-binds the kernel to the
real modules (as ``backend="official"`` does for ``nki.simulate``) and calls it, so that the same kernel source and
the same ``torchrun`` launch a user tests with the interpreter (``process_group=``, one process per rank) run on
Trainium. There, ``nki.collectives`` are carried out by the Neuron runtime over the job's ranks (the replica groups
of the kernel name them), not by fusegraph: no transport, timeout or profile of this package is involved, and
the arguments must be device tensors of the framework that launches NKI kernels (torch-neuronx / NxD Inference).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger(__name__)


def run_on_neuron(func: Callable[..., Any], args: tuple, kwargs: dict, lnc: int) -> Any:
    """Call ``func`` as a real ``nki.jit`` kernel (``kernel[lnc](*args)``); collectives go to the Neuron runtime."""
    from .official import real_launcher

    launcher, _ = real_launcher(func, lnc)
    log.info("running %s on the Neuron device with the real nki (LNC=%d)", func.__name__, lnc)
    return launcher(*args, **kwargs)
