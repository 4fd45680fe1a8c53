"""fusegraph's strict CPU interpreter of NKI 0.3 kernel source (the ``nki`` of SDK 2.29).

Public API::

    with as_nki(target="trn2"):          # `import nki` & co resolve to the interpreter inside the block
        import my_kernels
        out = my_kernels.kernel(x_np)        # @nki.jit kernels run on NumPy arrays; kernel[2](...) for LNC=2

    ns = load_kernel_source(src, "gen.py")   # generated source, no sys.modules side effects
    out = ns["kernel"](*arrays)

    out = run(kernel, *args, lnc=1, target=None, shape_only=False, assume=None, ranks=1, **kwargs)
    last_profile().to_dict()

    kernel = InterpretedKernel(generated)    # torch-facing entry (torch_io): a generated kernel on torch tensors
    outs = kernel(kernel.prepare(tensors))   # to_numpy / to_torch / abstract_args too; loaded on first use

See docs/interpreter.md for the semantics, the hardware checks and what is not modelled.
"""

from __future__ import annotations

from typing import Any

from .assume import AssumeRequest
from .errors import (
    NkiCapacityError,
    NkiNotImplementedError,
    NkiSimError,
    NkiSyncError,
    NkiUsageError,
    NkiValidationError,
)
from .jit import Kernel, Launcher
from .modules import as_nki, load_kernel_source, nki_modules
from .profile import Profile, last_profile
from .runner import run
from .storage import Abstract
from .targets import TRN2, TRN3, Target, get_target

#: names of the torch-facing entry (:mod:`.torch_io`), imported on first use: it imports torch, which the
#: interpreter itself does not (the LLM verification worker runs it without torch)
_TORCH_IO = frozenset({"InterpretedKernel", "abstract_args", "to_numpy", "to_torch"})


def __getattr__(name: str) -> Any:
    """``fusegraph.nkisim.InterpretedKernel`` & co. without importing torch with the interpreter (PEP 562)."""
    if name in _TORCH_IO:
        from . import torch_io

        return getattr(torch_io, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Abstract",
    "AssumeRequest",
    "Kernel",
    "Launcher",
    "NkiCapacityError",
    "NkiNotImplementedError",
    "NkiSimError",
    "NkiSyncError",
    "NkiUsageError",
    "NkiValidationError",
    "Profile",
    "TRN2",
    "TRN3",
    "Target",
    "as_nki",
    "get_target",
    "last_profile",
    "load_kernel_source",
    "nki_modules",
    "run",
]
