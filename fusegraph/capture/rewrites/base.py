"""The capture-rewrite plugin mechanism.

Some module implementations make dynamo break the graph (data-dependent Python loops such as HF's eager MoE
expert loop: 11 graphs for 2 layers of tiny Qwen3-MoE). A capture rewrite supplies a mathematically equal,
traceable ``forward`` for such modules. fusegraph wraps the ``forward`` of each target class with a dispatcher
that uses the rewrite only while dynamo traces *for fusegraph* (``torch.compiler.is_compiling()`` and the
current backend is fusegraph with ``capture_rewrites`` on); eager calls and other backends run the original
code untouched. :func:`apply_to_module` offers the explicit, instance-level alternative.

The wrapping must happen before dynamo first traces a class: wrapping it later changes the class under a compiled
frame, whose guard then fails on the next call (a recompile, and one decode call run by a program fusegraph
does not report). :func:`install_rewrites` therefore wraps the classes already imported and installs an import
hook that wraps the classes of each HF modeling module imported afterwards, as soon as its import completes.
"""
from __future__ import annotations

import functools
import importlib.abc
import logging
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ...settings import Settings
from ...warnings import one_line, warn
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
        if not is_hf_modeling_module(name) or mod is None:
            continue
        if name not in seen:
            if not _import_complete(name, mod):
                continue  # still executing (it imported another module): scanned when its own import completes
            seen[name] = select(mod)
        found.extend(seen[name])
    return found


def is_hf_modeling_module(name: str) -> bool:
    """A transformers modeling module (``transformers.models.<family>.modeling_<family>``): where the built-in
    rewrites find their classes, and the imports the hook of :func:`install_rewrites` acts on."""
    return name.startswith("transformers.models.") and ".modeling_" in name


#: modules whose exec finished under the import hook (their spec still says ``_initializing`` at that moment)
_EXECUTED: set[str] = set()


def _import_complete(name: str, mod: types.ModuleType) -> bool:
    spec = getattr(mod, "__spec__", None)
    return not getattr(spec, "_initializing", False) or name in _EXECUTED


def original_forward(cls: type) -> Callable:
    """The forward ``cls`` had before fusegraph wrapped it (the first patched class on its MRO), for rewrites
    that call the module's own code with different arguments."""
    for klass in cls.__mro__:
        if klass in _PATCHED:
            return _PATCHED[klass]
    return cls.forward


def install_rewrites() -> list[type]:
    """Wrap the forward of every (already imported) target class once, and hook later imports of HF modeling
    modules so that their classes are wrapped before anything can trace them; return the classes newly wrapped."""
    new = _wrap_imported_classes()
    _install_import_hook()
    return new


_state = threading.local()


def _wrap_imported_classes() -> list[type]:
    """One pass over the registered rewrites; a call made while a pass runs (a rewrite's ``find_classes``
    imported a modeling module) asks the running pass to go once more instead of nesting."""
    if getattr(_state, "busy", False):
        _state.again = True
        return []
    _state.busy, new = True, []
    try:
        _state.again = True
        while _state.again:
            _state.again = False
            new.extend(_wrap_pass())
    finally:
        _state.busy = False
    return new


def _wrap_pass() -> list[type]:
    new = []
    for rw in list(_REWRITES.values()):
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


class _WrapAfterExec(importlib.abc.Loader):
    """The module's own loader, plus wrapping its rewrite targets once the module has executed."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _EXECUTED.add(module.__name__)
        try:
            new = _wrap_imported_classes()
        except Exception as e:  # a broken plugin must not break the user's import
            warn(f"capture rewrites not installed after importing {module.__name__} ({one_line(e)}); dynamo "
                 "traces the original module code")
            return
        if new:
            log.debug("import of %s: capture rewrites installed on %s", module.__name__,
                      ", ".join(c.__qualname__ for c in new))

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, ... of the real loader
        if name == "_loader":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._loader, name)


class _ModelingImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the finders after it and hands HF modeling modules a :class:`_WrapAfterExec`."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not is_hf_modeling_module(fullname):
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or isinstance(finder, _ModelingImportHook) or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module") \
                    and not isinstance(spec.loader, _WrapAfterExec):
                spec.loader = _WrapAfterExec(spec.loader)
            return spec
        return None


def _install_import_hook() -> None:
    if not any(isinstance(f, _ModelingImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _ModelingImportHook())


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
