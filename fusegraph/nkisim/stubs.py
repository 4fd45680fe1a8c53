"""Placeholders for official functions the interpreter does not implement.

Every function of the 0.3.0 API table exists in the interpreter's namespaces with its exact official
signature; the ones without an implementation raise ``NotImplementedError("nki.isa.<name> is not implemented
by fusegraph's interpreter")`` (an :class:`~fusegraph.nkisim.errors.NkiNotImplementedError`) when called.
"""

from __future__ import annotations

from typing import Any, Callable

from fusegraph.nkiapi.tables import FunctionSig, load_table

from . import enums
from . import language_ops
from .errors import NkiNotImplementedError


def _raise(qualname: str) -> None:
    from .context import maybe_current

    ctx = maybe_current()
    raise NkiNotImplementedError(
        f"{qualname} is not implemented by fusegraph's interpreter",
        rule="not-implemented",
        location=ctx.where() if ctx is not None else None,
    )


class _NlNamespace:
    """Resolves ``nl.equal`` style defaults of the stub signatures."""

    def __getattr__(self, name: str) -> Any:
        return getattr(language_ops, name)


def _signature_source(sig: FunctionSig) -> str:
    parts = []
    for p in sig.params:
        if p.kind == "var_keyword":
            parts.append(f"**{p.name}")
        elif p.kind == "var_positional":
            parts.append(f"*{p.name}")
        elif p.default is not None:
            parts.append(f"{p.name}={p.default}")
        else:
            parts.append(p.name)
    return ", ".join(parts)


def make_stub(sig: FunctionSig) -> Callable[..., Any]:
    env: dict[str, Any] = {
        "_raise": _raise,
        "nl": _NlNamespace(),
        "MemoryRegion": enums.MemoryRegion,
        "oob_mode": enums.oob_mode,
        "dge_mode": enums.dge_mode,
        "engine": enums.engine,
        "reduce_cmd": enums.reduce_cmd,
        "matmul_perf_mode": enums.matmul_perf_mode,
        "dma_engine": enums.dma_engine,
    }
    src = (
        f"def {sig.name}({_signature_source(sig)}):\n"
        f"    '''{sig.qualname}: {sig.summary.replace(chr(39), chr(96))} (not implemented by fusegraph's interpreter)'''\n"
        f"    _raise({sig.qualname!r})\n"
    )
    exec(compile(src, __file__, "exec"), env)
    fn = env[sig.name]
    fn.__module__ = sig.module
    fn._nkisim_unimplemented = True
    return fn


def fill_missing(module: str, namespace: dict[str, Any], version: str = "0.3.0") -> list[str]:
    """Add stubs for every official function of ``module`` missing from ``namespace``; returns their names."""
    added = []
    for name, sig in load_table(version).functions(module).items():
        if name not in namespace:
            namespace[name] = make_stub(sig)
            added.append(name)
    return sorted(added)
