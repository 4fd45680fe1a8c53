"""Binding the names ``nki``, ``nki.language``, ``nki.isa``, ... to the interpreter.

* :func:`as_nki` installs the interpreter's modules in ``sys.modules`` for the duration of a ``with`` block
  (so unmodified third-party kernel files can ``import nki``) and restores the previous entries exactly
  on exit: afterwards ``"nki" not in sys.modules`` unless a real ``nki`` was there before.
* :func:`load_kernel_source` executes generated kernel source with a private ``__import__`` that resolves
  ``nki*`` to the interpreter, never touching ``sys.modules``; the source is registered in ``linecache``
  so tracebacks and profile line attribution show the real lines.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import linecache
import sys
import types
from typing import Any, Iterator

from .context import set_session_target
from .jit import Kernel
from .targets import get_target

MODULE_NAMES = ("nki", "nki.language", "nki.isa", "nki.collectives", "nki.typing", "nki.isa.constants")
_MARK = "__fusegraph_nkisim__"


@functools.lru_cache(maxsize=None)
def nki_modules() -> dict[str, types.ModuleType]:
    """The interpreter's module objects (created once, shared by every binding)."""
    from .api import namespaces

    ns = namespaces()
    mods: dict[str, types.ModuleType] = {}
    for name in MODULE_NAMES:
        m = types.ModuleType(name, f"fusegraph's CPU interpreter of {name} (NKI 0.3)")
        m.__dict__.update(ns[name])
        setattr(m, _MARK, True)
        if name in ("nki", "nki.isa"):
            m.__path__ = []  # packages, so that submodule imports work
        mods[name] = m
    top = mods["nki"]
    top.language = mods["nki.language"]
    top.isa = mods["nki.isa"]
    top.collectives = mods["nki.collectives"]
    top.typing = mods["nki.typing"]
    mods["nki.isa"].constants = mods["nki.isa.constants"]
    return mods


#: the pre-0.2 ("Beta 1") namespace: SDK 2.27+ still ships it ("The Beta 1 APIs can be used via the
#: ``neuronxcc.nki.*`` namespace", nki-beta2-migration-guide.rst) and nki-library's router_topk annotates its
#: outputs with ``neuronxcc.nki.typing.mutable_tensor``.  Only ``typing`` (annotations) is provided; the Beta 1
#: language itself (``neuronxcc.nki.language``/``isa``, nl.load, masks, ...) is a different API and is not.
LEGACY_MODULE_NAMES = ("neuronxcc", "neuronxcc.nki", "neuronxcc.nki.typing")


def _legacy_getattr(module: str):
    def __getattr__(name: str) -> Any:
        raise AttributeError(
            f"{module}.{name}: fusegraph's interpreter provides only neuronxcc.nki.typing of the legacy Beta 1 "
            f"namespace (annotations); port the kernel to `import nki` (NKI 0.3)"
        )

    return __getattr__


@functools.lru_cache(maxsize=None)
def legacy_modules() -> dict[str, types.ModuleType]:
    """``neuronxcc``, ``neuronxcc.nki`` and ``neuronxcc.nki.typing`` (``tensor``/``mutable_tensor`` annotations)."""
    from .api import namespaces

    typing_ns = namespaces()["nki.typing"]
    mods: dict[str, types.ModuleType] = {}
    for name in LEGACY_MODULE_NAMES:
        m = types.ModuleType(name, f"fusegraph's stand-in for the legacy {name} namespace (typing only)")
        setattr(m, _MARK, True)
        if name != "neuronxcc.nki.typing":
            m.__path__ = []
            m.__getattr__ = _legacy_getattr(name)  # type: ignore[attr-defined]
        mods[name] = m
    t = mods["neuronxcc.nki.typing"]
    t.tensor = typing_ns["tensor"]
    t.mutable_tensor = typing_ns["tensor"]  # an annotation of an output tensor; not enforced either
    mods["neuronxcc"].__dict__["nki"] = mods["neuronxcc.nki"]
    mods["neuronxcc.nki"].__dict__["typing"] = t
    return mods


def _legacy_to_install() -> dict[str, types.ModuleType]:
    """The legacy modules, unless a real ``neuronxcc`` (the Neuron SDK) is importable: then the SDK's own is used."""
    if "neuronxcc" in sys.modules and not is_interpreter_module(sys.modules["neuronxcc"]):
        return {}
    try:
        import importlib.util

        if "neuronxcc" not in sys.modules and importlib.util.find_spec("neuronxcc") is not None:
            return {}
    except (ImportError, ValueError):
        pass
    return legacy_modules()


def is_interpreter_module(m: Any) -> bool:
    return isinstance(m, types.ModuleType) and getattr(m, _MARK, False)


@contextlib.contextmanager
def as_nki(target: str | None = None) -> Iterator[types.ModuleType]:
    """Make ``import nki`` (and ``nki.language``/``nki.isa``/``nki.collectives``/``nki.typing``, plus the legacy
    ``neuronxcc.nki.typing`` where no Neuron SDK is installed) resolve to the interpreter inside the block;
    ``target`` applies to kernels launched inside (None: like ``nki.simulate``, ``NEURON_PLATFORM_TARGET_OVERRIDE``,
    else trn3).

    Yields the interpreter's ``nki`` module."""
    tgt = get_target(target) if target is not None else None
    mods = dict(nki_modules())
    mods.update(_legacy_to_install())
    saved = {name: sys.modules.get(name) for name in mods}
    prev_target = set_session_target(tgt)
    sys.modules.update(mods)
    try:
        yield mods["nki"]
    finally:
        set_session_target(prev_target)
        for name, old in saved.items():
            if old is None:
                if sys.modules.get(name) is mods[name]:
                    del sys.modules[name]
            else:
                sys.modules[name] = old


#: submodules a bare ``import nki`` does not bind in a kernel namespace: the official package's ``__init__`` never
#: imports ``nki.collectives`` (SDK 2.29 stub: ``import nki.language`` only; SDK 2.32: no import) and every public
#: kernel imports it explicitly (nki-library's collectives kernels, the hand megakernels), so a kernel that only
#: wrote ``import nki`` would fail on hardware with an AttributeError
EXPLICIT_SUBMODULES: tuple[str, ...] = ("collectives",)
_NS_KEY = "__fusegraph_nki__"


def _namespace_nki(namespace: Any, mods: dict[str, types.ModuleType]) -> types.ModuleType:
    """The ``nki`` module a kernel namespace sees: the interpreter's, without :data:`EXPLICIT_SUBMODULES` until the
    namespace imports them (one view per namespace, kept in it)."""
    if not isinstance(namespace, dict):
        return mods["nki"]
    view = namespace.get(_NS_KEY)
    if view is None:
        view = types.ModuleType("nki")
        view.__dict__.update({k: v for k, v in mods["nki"].__dict__.items() if k not in EXPLICIT_SUBMODULES})
        namespace[_NS_KEY] = view
    return view


def kernel_import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
    """The ``__import__`` of kernel namespaces: ``nki*`` resolve to the interpreter, the rest as usual (public: the
    LLM worker wraps it in its own allow-list). ``import nki`` binds ``nki.collectives`` only once the namespace
    imported it (``import nki.collectives``, ``from nki import collectives``), like the official package."""
    if level == 0 and (name == "neuronxcc" or name.startswith("neuronxcc.")) and _legacy_to_install():
        mods = legacy_modules()
        if name not in mods:
            raise ModuleNotFoundError(f"No module named {name!r} in fusegraph's NKI interpreter (only "
                                      f"neuronxcc.nki.typing of the legacy namespace)", name=name)
        return mods[name] if fromlist else mods["neuronxcc"]
    if level == 0 and (name == "nki" or name.startswith("nki.")):
        mods = nki_modules()
        if name not in mods:
            raise ModuleNotFoundError(f"No module named {name!r} in fusegraph's NKI interpreter", name=name)
        top = _namespace_nki(globals, mods)
        wanted = [name.split(".")[1]] if "." in name else list(fromlist or ()) if name == "nki" else []
        for sub in wanted:
            if sub in EXPLICIT_SUBMODULES:
                setattr(top, sub, mods[f"nki.{sub}"])
        if fromlist:
            return top if name == "nki" else mods[name]
        return top
    return builtins.__import__(name, globals, locals, fromlist, level)


def register_source(source: str, filename: str) -> None:
    """Put ``source`` into linecache under ``filename`` (kept until replaced)."""
    lines = source.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    linecache.cache[filename] = (len(source), None, lines, filename)


def load_kernel_source(source: str, filename: str, target: str | None = None) -> dict:
    """Execute kernel source with ``nki*`` bound to the interpreter and return its namespace.

    No ``nki`` module is added to ``sys.modules``.  ``@nki.jit`` kernels defined by the source run on
    ``target`` unless a run overrides it: ``ns[kernel_name](*numpy_arrays)``.  ``target=None`` decides at run
    time (the ``as_nki`` target, else ``NEURON_PLATFORM_TARGET_OVERRIDE``, else trn3 -- the ``nki.simulate``
    default on a host without a Neuron device); fusegraph's own callers always pass the target."""
    tgt = get_target(target) if target is not None else None
    register_source(source, filename)
    bi = dict(builtins.__dict__)
    bi["__import__"] = kernel_import
    ns: dict[str, Any] = {"__name__": "__nki_kernel__", "__file__": filename, "__builtins__": bi}
    code = compile(source, filename, "exec", dont_inherit=True)  # not this module's `from __future__` flags
    exec(code, ns)
    for v in list(ns.values()):
        if isinstance(v, Kernel) and getattr(v.func, "__globals__", None) is ns:
            v.default_target = tgt
    return ns
