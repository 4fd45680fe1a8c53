"""``nki.jit`` / ``nki.simulate`` and the ``kernel[lnc]`` launch syntax, bound to the interpreter."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from .context import maybe_current
from .errors import NkiUsageError, NkiValidationError

log = logging.getLogger(__name__)


class Kernel:
    """A top-level NKI kernel (the result of ``@nki.jit``); calling it runs the interpreter."""

    def __init__(self, func: Callable[..., Any], options: dict[str, Any] | None = None):
        if isinstance(func, Kernel):
            func = func.func
        self.func = func
        self.options = dict(options or {})
        self.default_target: Any = None
        functools.update_wrapper(self, func)

    def __repr__(self) -> str:
        return f"<nki.jit kernel {getattr(self.func, '__qualname__', self.func)}>"

    def _inline(self, args: tuple, kwargs: dict, lnc: int | None = None) -> tuple[bool, Any]:
        """Inside a running kernel a call of another ``@nki.jit`` kernel is inlined, like any function call.

        The compiler inlines every call at specialization time (language guide, "Compilation Model"), and
        nki-library's hardware-tested ``attention_block_tkg`` (itself ``@nki.jit``) calls the ``@nki.jit`` kernels
        ``qkv`` and ``output_projection_tkg``; so the body runs in the caller's programs.  A launch with a grid
        different from the running kernel's LNC cannot be inlined (rule ``nested-jit``)."""
        ctx = maybe_current()
        if ctx is None:
            return False, None
        if lnc is not None and lnc != ctx.run.lnc:
            raise NkiValidationError(
                f"@nki.jit kernel {self.func.__name__}[{lnc}] launched from inside a running LNC={ctx.run.lnc} kernel; "
                f"a nested kernel call is inlined into the running programs and cannot change the launch grid",
                rule="nested-jit",
                location=ctx.where(),
            )
        log.debug("@nki.jit kernel %s called from a running kernel: inlined", self.func.__name__)
        return True, self.func(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        nested, out = self._inline(args, kwargs)
        if nested:
            return out
        from .context import session_lnc
        from .runner import launch

        lnc = session_lnc() or 1
        return launch(self, args, kwargs, lnc=lnc, grid_ndim=0 if lnc == 1 else 1)

    def __getitem__(self, grid: Any) -> "Launcher":
        return Launcher(self, _parse_grid(grid))


class Launcher:
    """``kernel[lnc]``: a kernel bound to a launch grid of one integer (1 or 2)."""

    def __init__(self, kernel: Kernel, lnc: int):
        self.kernel = kernel
        self.lnc = lnc

    def __repr__(self) -> str:
        return f"{self.kernel!r}[{self.lnc}]"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        nested, out = self.kernel._inline(args, kwargs, self.lnc)
        if nested:
            return out
        from .runner import launch

        return launch(self.kernel, args, kwargs, lnc=self.lnc, grid_ndim=1)


def _parse_grid(grid: Any) -> int:
    if isinstance(grid, tuple):
        if len(grid) != 1:
            raise NkiUsageError(
                f"kernel[{grid}]: the stable NKI API launches with one integer (the LNC, 1 or 2), not a "
                f"multi-dimensional SPMD grid",
                rule="lnc",
            )
        grid = grid[0]
    if not isinstance(grid, int) or isinstance(grid, bool) or grid not in (1, 2):
        raise NkiUsageError(f"kernel[{grid!r}]: the launch grid must be the integer 1 or 2 (LNC)", rule="lnc")
    return grid


def jit(func=None, mode="auto", **kwargs):
    """Decorator marking a top-level NKI kernel (``@nki.jit``, ``@nki.jit()``, ``nki.jit(f)``)."""
    if "platform_target" in kwargs:
        raise NkiUsageError(
            "nki.jit(platform_target=...) raises an error since NKI 0.3.0; set NEURON_PLATFORM_TARGET_OVERRIDE "
            "(or pass target= to fusegraph.nkisim.run)",
            rule="jit",
        )
    if mode != "auto":
        log.debug("nki.jit(mode=%r) is deprecated and ignored", mode)
    options = dict(kwargs, mode=mode)
    if func is None:
        return lambda f: Kernel(f, options)
    if not callable(func):
        raise NkiUsageError(f"nki.jit expects a function, got {func!r}", rule="jit")
    return Kernel(func, options)


def simulate(kernel):
    """``nki.simulate(kernel)`` / ``nki.simulate(kernel[2])``: a callable running the kernel in the interpreter."""
    if isinstance(kernel, (Kernel, Launcher)):
        return kernel
    if callable(kernel):
        return Kernel(kernel)
    raise NkiUsageError(f"nki.simulate expects a kernel, got {kernel!r}", rule="jit")
