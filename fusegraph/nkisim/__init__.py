"""fusegraph's strict CPU interpreter of NKI 0.3 kernel source (the ``nki`` of SDK 2.29).

Public API::

    with as_nki(target="trn2"):          # `import nki` & co resolve to the interpreter inside the block
        import my_kernels
        out = my_kernels.kernel(x_np)        # @nki.jit kernels run on NumPy arrays; kernel[2](...) for LNC=2

    ns = load_kernel_source(src, "gen.py")   # generated source, no sys.modules side effects
    out = ns["kernel"](*arrays)

    out = run(kernel, *args, lnc=1, target=None, shape_only=False, assume=None, ranks=1, **kwargs)
    last_profile().to_dict()

See docs/interpreter.md for the semantics, the hardware checks and what is not modelled.
"""

from __future__ import annotations

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
