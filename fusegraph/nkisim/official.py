"""Switch to the official ``nki.simulate`` (only where the Neuron SDK's ``nki`` package is installed).

UNTESTED in this repository: the real ``nki`` is not installable here.  The kernel function is re-bound so
that its global names ``nki``/``nl``/``nisa``/``nccl`` refer to the real modules instead of the interpreter's
(helpers defined in other files keep their own bindings).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any, Callable

from .errors import NkiUsageError

_OURS = ("nki", "nki.language", "nki.isa", "nki.collectives", "nki.typing", "nki.isa.constants")


def _import_real() -> dict[str, types.ModuleType]:
    from .modules import is_interpreter_module

    saved = {n: sys.modules.pop(n) for n in _OURS if n in sys.modules and is_interpreter_module(sys.modules[n])}
    try:
        real = {n: importlib.import_module(n) for n in ("nki", "nki.language", "nki.isa", "nki.collectives")}
    except ImportError as exc:
        raise NkiUsageError(
            f"backend='official' needs the Neuron SDK's nki package, which is not importable ({exc})", rule="backend"
        ) from None
    finally:
        sys.modules.update(saved)
    return real


def real_launcher(func: Callable[..., Any], lnc: int) -> tuple[Any, dict[str, types.ModuleType]]:
    """``func`` re-bound to the real ``nki`` modules (its globals that are interpreter modules replaced by the SDK's)
    and jitted, with its LNC grid applied; and the real modules. Shared by ``backend="official"`` (``nki.simulate``)
    and ``backend="neuron"`` (the device), so both run the kernel source exactly as the interpreter does."""
    from .modules import is_interpreter_module

    real = _import_real()
    g = dict(func.__globals__)
    for k, v in list(g.items()):
        if isinstance(v, types.ModuleType) and is_interpreter_module(v):
            g[k] = real.get(v.__name__, real["nki"])
    rebound = types.FunctionType(func.__code__, g, func.__name__, func.__defaults__, func.__closure__)
    kernel = real["nki"].jit(rebound)
    return (kernel[lnc] if lnc != 1 else kernel), real


def run_official(func: Callable[..., Any], args: tuple, kwargs: dict, lnc: int) -> Any:
    launcher, real = real_launcher(func, lnc)
    return real["nki"].simulate(launcher)(*args, **kwargs)
