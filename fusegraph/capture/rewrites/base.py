"""The capture-rewrite plugin mechanism.

Some module implementations make dynamo break the graph (data-dependent Python loops such as HF's eager MoE
expert loop: 11 graphs for 2 layers of tiny Qwen3-MoE). A capture rewrite supplies a mathematically equal,
traceable ``forward`` for such modules. fusegraph wraps the ``forward`` of each target class with a dispatcher
that uses the rewrite only while dynamo traces *for fusegraph* (``torch.compiler.is_compiling()`` and the
current backend is fusegraph with ``capture_rewrites`` on); eager calls and other backends run the original
code untouched. :func:`apply_to_module` offers the explicit, instance-level alternative.
"""
from __future__ import annotations

import functools
import logging
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ...settings import Settings
from ..compile_context import current_fusegraph_options

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptureRewrite:
    """A substitution of one family of module implementations.

    ``find_classes`` returns the classes (already imported) whose instances may be rewritten; ``applies``
    decides per instance (configuration checks); ``forward(module, *args, **kwargs)`` must return exactly what
    ``module.forward`` returns, up to floating-point summation order.
    """

    name: str
    description: str
    find_classes: Callable[[], Iterable[type]]
    applies: Callable[[torch.nn.Module], bool]
    forward: Callable[..., Any]


_REWRITES: dict[str, CaptureRewrite] = {}
_PATCHED: dict[type, Callable] = {}
#: per patched class, the rewrites that target it (the dispatcher reads only this: cheap for dynamo to trace)
_BY_CLASS: dict[type, list[CaptureRewrite]] = {}


def register_capture_rewrite(rewrite: CaptureRewrite) -> CaptureRewrite:
    if "." not in rewrite.name:
        raise ValueError(f"capture rewrite names are namespaced (e.g. 'mypkg.{rewrite.name}')")
    _REWRITES[rewrite.name] = rewrite
    return rewrite


def registered_rewrites() -> list[CaptureRewrite]:
    return list(_REWRITES.values())


def fusegraph_setting(name: str) -> Any:
    """A setting of the fusegraph compile dynamo is tracing for (None outside one). Call it from functions marked
    ``assume_constant_result``, so dynamo runs it eagerly instead of tracing it."""
    opts = current_fusegraph_options()
    if opts is None:
        return None
    try:
        return getattr(Settings.from_options(opts), name)
    except Exception:
        return None


@torch._dynamo.assume_constant_result
def _rewrites_active() -> bool:
    """True while dynamo traces for a fusegraph compile with capture rewrites enabled (constant at trace time)."""
    return bool(fusegraph_setting("capture_rewrites"))


def _dispatcher(cls: type, original: Callable) -> Callable:
    candidates = _BY_CLASS.setdefault(cls, [])

    @functools.wraps(original)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() and _rewrites_active():
            for rw in candidates:
                if rw.applies(self):
                    return rw.forward(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    forward._fusegraph_original = original  # type: ignore[attr-defined]
    return forward


def hf_modeling_classes(select: Callable[[types.ModuleType], list[type]], seen: dict[str, list[type]]) -> list[type]:
    """Classes ``select`` picks from each imported transformers modeling module (asked once per module: ``seen``
    memoizes), so a rewrite covers every model family already loaded without importing any."""
    found: list[type] = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or ".modeling_" not in name or mod is None:
            continue
        if name not in seen:
            seen[name] = select(mod)
        found.extend(seen[name])
    return found


def original_forward(cls: type) -> Callable:
    """The forward ``cls`` had before fusegraph wrapped it (the first patched class on its MRO), for rewrites
    that call the module's own code with different arguments."""
    for klass in cls.__mro__:
        if klass in _PATCHED:
            return _PATCHED[klass]
    return cls.forward


def install_rewrites() -> list[type]:
    """Wrap the forward of every (already imported) target class once; return the classes newly wrapped."""
    new = []
    for rw in _REWRITES.values():
        try:
            classes = list(rw.find_classes())
        except Exception as e:  # a broken plugin must not break compilation
            log.warning("capture rewrite %s failed to list its classes: %s", rw.name, e)
            continue
        for cls in classes:
            targets = _BY_CLASS.setdefault(cls, [])
            if rw not in targets:
                targets.append(rw)
            if cls in _PATCHED or "forward" not in cls.__dict__:
                continue
            original = cls.__dict__["forward"]
            _PATCHED[cls] = original
            cls.forward = _dispatcher(cls, original)
            new.append(cls)
            log.debug("capture rewrite %s installed on %s", rw.name, cls.__qualname__)
    return new


def apply_to_module(model: torch.nn.Module) -> list[str]:
    """Explicitly rewrite matching submodules of ``model`` (instance-level); return the rewritten module paths."""
    done = []
    for path, mod in model.named_modules():
        for rw in _REWRITES.values():
            if isinstance(mod, tuple(rw.find_classes())) and rw.applies(mod):
                mod.forward = functools.partial(rw.forward, mod)
                mod._fusegraph_rewrite = rw.name
                done.append(path)
                break
    return done


def remove_from_module(model: torch.nn.Module) -> None:
    for _, mod in model.named_modules():
        if getattr(mod, "_fusegraph_rewrite", None):
            del mod.forward
            del mod._fusegraph_rewrite
