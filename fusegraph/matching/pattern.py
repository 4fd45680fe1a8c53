"""The pattern plugin API: a fusion written as a plain PyTorch function, plus its guards and its codegen template.

A pattern is traced (see :mod:`.trace`) through the same aot_autograd path the backend captures with, so it is
written in the vocabulary users know (``x.float().pow(2).mean(-1, keepdim=True)``), not in ATen. What the graph
cannot say is declared next to the function:

* ``inputs``: names, symbolic example shapes (``"T H"``; dims named so shape-derived constants can be checked),
  dtypes and kinds (``kind="weight"`` makes a match require a real parameter there, so ``(1 + weight)`` norms do
  not silently pass for plain RMSNorm);
* ``params``: numeric constants captured from the match (eps, scale...), with example values (the role of
  Inductor's ``KeywordArg``);
* ``slots``: interchangeable single ops (the activation of a gated MLP) matched as one node and captured by name;
* ``cases``: dims/params held fixed while tracing (``{"G": 1}``: no ``repeat_kv``), each a separate variant;
* ``check``/``derive``: guards and derived params computed on the match.

Patterns are registered by decorator (:func:`register_pattern`) or, from other packages, through the entry point
group ``fusegraph.patterns``. A broken plugin produces exactly one warning naming it and is skipped.
"""
from __future__ import annotations

import contextlib
import fnmatch
import importlib
import inspect
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from ..warnings import one_line, warn
from .activations import slot_options

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "fusegraph.patterns"
BUILTIN_PACKAGE = "fusegraph.patterns"  # the built-in op folders
_NAME = re.compile(r"^[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)+$")


@dataclass(frozen=True)
class Input:
    """One tensor input of a pattern.

    ``shape`` is a space- or comma-separated list of dims: integer literals, dim symbols (``H``) or products
    (``KV*G``, ``2*I``). ``dtype=None`` means "the variant's dtype" (each pattern is traced once per entry of
    ``Pattern.dtypes``). ``kind`` restricts what may provide the value: ``"weight"``, ``"buffer"``, ``"state"``
    (a graph input of that class) or ``None`` (anything).
    """

    name: str
    shape: str
    dtype: str | None = None
    kind: str | None = None

    def dims(self) -> list[str]:
        return [t for t in re.split(r"[\s,]+", self.shape.strip()) if t]


@dataclass(frozen=True)
class Slot:
    """A set of interchangeable single-op callables (e.g. activations), matched as one node.

    The matched option's name becomes a param of the match (``act="gelu_tanh"``). Options that trace to more
    than one op (``relu(x) ** 2``) cannot fill a slot; write them as their own implementation instead.
    """

    options: Mapping[str, Callable[[torch.Tensor], torch.Tensor]]

    def names(self) -> list[str]:
        return list(self.options)


#: Single-op activations HF decoders use (ACT2FN names where they exist): the slot's options come from the one
#: activation table (:mod:`.activations`) that codegen's templates and the reference VM read too
ACTIVATIONS = Slot(slot_options())

CheckResult = bool | str | None


@dataclass(frozen=True)
class Implementation:
    """One traced form of a pattern's math (HF has several implementations of the same computation)."""

    name: str
    fn: Callable[..., Any]
    cases: tuple[Mapping[str, Any], ...] | None = None  # overrides Pattern.cases for this implementation
    dtypes: tuple[str, ...] | None = None  # overrides Pattern.dtypes for this implementation
    inputs: tuple[Input, ...] | None = None  # overrides Pattern.inputs (e.g. a boolean instead of a float mask)


@dataclass(eq=False)
class Pattern:
    """A fusion pattern. See the module docstring; :func:`register_pattern` is the usual way to make one."""

    name: str
    fn: Callable[..., Any]
    inputs: tuple[Input, ...]
    outputs: tuple[str, ...] = ("out",)
    template: str = ""
    priority: int = 0
    params: Mapping[str, float | int] = field(default_factory=dict)
    slots: Mapping[str, Slot] = field(default_factory=dict)
    cases: tuple[Mapping[str, Any], ...] = ({},)
    dims: Mapping[str, int | tuple[int, int]] = field(default_factory=dict)
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    check: Callable[["Any"], CheckResult] | None = None
    derive: Callable[["Any"], Mapping[str, Any]] | None = None
    #: the param names ``derive`` adds (declared so a lowering's reads are checked when it is imported)
    derived: tuple[str, ...] = ()
    reference: Callable[..., Any] | None = None
    description: str = ""
    #: the report block a match belongs to when its module path does not say: "embedding", "prologue" (computed
    #: before the layers: rotary tables, masks), "moe" (its layer's MLP is a mixture of experts); "" = by module
    block: str = ""
    source: str = "user"  # who registered it: "fusegraph" for built-ins, the entry point name for plugins
    implementations: list[Implementation] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"pattern name {self.name!r} must be namespaced like 'mypkg.my_norm'")
        self.inputs = tuple(i if isinstance(i, Input) else Input(*i) if isinstance(i, tuple) else Input(i, "")
                            for i in self.inputs)
        self.outputs = tuple(self.outputs)
        self.cases = tuple(self.cases) or ({},)
        self.template = self.template or self.name.rsplit(".", 1)[-1]
        self.reference = self.reference or self.fn  # the torch function that defines the math
        if not self.implementations:
            self.implementations = [Implementation("default", self.fn)]
        self._compiled: dict[str, list] | None = None  # traced variants per dtype
        self._lock = threading.Lock()
        self.disabled_reason: str | None = None

    # ---- the reference math ----------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    @property
    def reference_fn(self) -> Callable[..., Any]:
        return self.reference or self.fn  # (always set after construction; kept for readability at call sites)

    def call_reference(self, inputs: Mapping[str, Any], params: Mapping[str, Any]) -> Any:
        """Run the torch reference on named inputs and a match's params (slot names resolve to callables)."""
        fn = self.reference_fn
        accepted = keyword_names(fn)
        kwargs: dict[str, Any] = {}
        for k, v in params.items():
            if k in self.slots and isinstance(v, str):
                v = self.slots[k].options[v]
            elif k == "dtype" and isinstance(v, str):
                v = getattr(torch, v)
            if accepted is None or k in accepted:
                kwargs[k] = v
        return fn(*[inputs.get(i.name) for i in self.inputs], **kwargs)

    def implementation(self, name: str, *, cases: Sequence[Mapping[str, Any]] | None = None,
                       dtypes: Sequence[str] | None = None,
                       inputs: Sequence[Input] | None = None) -> Callable[[Callable], Callable]:
        """Decorator adding another traced implementation of the same math (another HF code path)."""

        def deco(fn: Callable) -> Callable:
            self.implementations.append(Implementation(
                name, fn, tuple(cases) if cases is not None else None,
                tuple(dtypes) if dtypes is not None else None, tuple(inputs) if inputs is not None else None))
            self._compiled = None
            return fn

        return deco

    def input(self, name: str) -> Input:
        return next(i for i in self.inputs if i.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "template": self.template,
            "priority": self.priority,
            "source": self.source,
            "inputs": [i.name for i in self.inputs],
            "outputs": list(self.outputs),
            "params": sorted(set(self.params) | set(self.slots)),
            "implementations": [i.name for i in self.implementations],
            "description": self.description,
        }

    def __repr__(self) -> str:
        return f"Pattern({self.name!r}, template={self.template!r}, priority={self.priority})"


def keyword_names(fn: Callable) -> set[str] | None:
    """The names ``fn`` accepts as keywords; None when it takes ``**kwargs`` (or has no readable signature)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return {p.name for p in sig.parameters.values() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


# ---- the registry ----------------------------------------------------------------------------------------
class PatternRegistry:
    """All known patterns: built-ins (``fusegraph.patterns``), entry-point plugins, and user registrations."""

    def __init__(self) -> None:
        self._patterns: dict[str, Pattern] = {}
        self._lock = threading.RLock()
        self._builtins_loaded = False
        self._plugins_loaded = False
        self._current_source: str | None = None
        self.plugin_errors: dict[str, str] = {}
        self.plugin_sources: dict[str, str] = {}  # entry point name -> "module:attr"

    def register(self, pattern: Pattern, *, replace: bool = False) -> Pattern:
        with self._lock:
            if self._current_source is not None and pattern.source == "user":
                pattern.source = self._current_source
            old = self._patterns.get(pattern.name)
            if old is not None and old is not pattern and not replace:
                warn(f"pattern {pattern.name!r} from {pattern.source} ignored: the name is already registered by "
                     f"{old.source} (pass replace=True to override)")
                return old
            self._patterns[pattern.name] = pattern
            log.debug("registered pattern %s (source %s)", pattern.name, pattern.source)
            return pattern

    def unregister(self, name: str) -> Pattern | None:
        with self._lock:
            return self._patterns.pop(name, None)

    def get(self, name: str) -> Pattern | None:
        self.ensure_loaded()
        return self._patterns.get(name)

    def patterns(self, disabled: Iterable[str] = ()) -> list[Pattern]:
        """Every usable pattern, deterministically ordered (priority desc, then name)."""
        self.ensure_loaded()
        globs = list(disabled)
        with self._lock:
            pats = [p for p in self._patterns.values()
                    if not any(fnmatch.fnmatchcase(p.name, g) for g in globs)]
        return sorted(pats, key=lambda p: (-p.priority, p.name))

    # ---- loading ---------------------------------------------------------------------------------------
    def ensure_builtins_loaded(self) -> None:
        """Import the built-in op folders (their patterns register as ``source="fusegraph"``); codegen calls this
        too, since the folders also hold the lowerings, so there is one loading path whoever asks first."""
        with self._lock:
            if not self._builtins_loaded:
                self._builtins_loaded = True
                self._load_module(BUILTIN_PACKAGE, source="fusegraph")

    def ensure_loaded(self) -> None:
        self.ensure_builtins_loaded()
        with self._lock:
            if not self._plugins_loaded:
                self._plugins_loaded = True
                self.load_entry_points()

    def _load_module(self, module: str, source: str) -> None:
        with self.registering_as(source):
            importlib.import_module(module)

    @contextlib.contextmanager
    def registering_as(self, source: str) -> Iterator[None]:
        """Patterns registered inside (still marked ``"user"``) get ``source``. The built-in package wraps its own
        imports in this, so its patterns are ``"fusegraph"`` whichever import reaches them first (a test importing
        one op folder, codegen loading the lowerings, or :meth:`ensure_builtins_loaded`)."""
        with self._lock:
            prev, self._current_source = self._current_source, source
            try:
                yield
            finally:
                self._current_source = prev

    def load_entry_points(self) -> None:
        """Load every ``fusegraph.patterns`` entry point; a failing one warns once (naming it) and is skipped."""
        from importlib.metadata import entry_points

        try:
            eps = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
        except Exception as e:  # noqa: BLE001 - broken metadata must not break compilation
            warn(f"could not list pattern plugins ({type(e).__name__}: {e}); continuing with built-in patterns")
            return
        for ep in eps:
            self.plugin_sources[ep.name] = ep.value
            prev, self._current_source = self._current_source, ep.name
            try:
                obj = ep.load()
                for p in _patterns_of(obj):
                    if p.source == "user":
                        p.source = ep.name
                    self.register(p)
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - any plugin failure (SystemExit of an import-time argparse too) leaves the compile working
                msg = one_line(e)
                self.plugin_errors[ep.name] = msg
                warn(f"pattern plugin {ep.name!r} ({ep.value}) failed to load ({msg}); continuing without it")
            finally:
                self._current_source = prev

    def reload_plugins(self) -> None:
        """Forget entry-point plugins and load them again (tests; after installing a plugin at runtime)."""
        with self._lock:
            for name in [n for n, p in self._patterns.items() if p.source in self.plugin_sources]:
                del self._patterns[name]
            self.plugin_errors.clear()
            self.plugin_sources.clear()
            self._plugins_loaded = False


def _patterns_of(obj: Any) -> list[Pattern]:
    """What an entry point resolves to: a module (registered on import), a Pattern, patterns, or a callable."""
    if isinstance(obj, Pattern):
        return [obj]
    if inspect.ismodule(obj):
        return [v for v in vars(obj).values() if isinstance(v, Pattern)]
    if isinstance(obj, (list, tuple)):
        return [p for x in obj for p in _patterns_of(x)]
    if callable(obj):
        result = obj()
        return [] if result is None else _patterns_of(result)
    raise TypeError(f"entry point resolved to {type(obj).__name__}, expected a module, Pattern or callable")


REGISTRY = PatternRegistry()


def register_pattern(name: str | Pattern | None = None, /, *, replace: bool = False,
                     **kwargs: Any) -> Any:
    """Register a pattern. Three spellings:

    * ``@register_pattern("mypkg.my_norm", inputs=[...], template="rmsnorm", ...)`` on the function;
    * ``register_pattern(Pattern(...))`` for a pattern object;
    * ``@register_pattern(name=..., ...)`` (same as the first).

    Returns the :class:`Pattern` (the decorator returns it too; it stays callable as the reference function).
    """
    if isinstance(name, Pattern):
        return REGISTRY.register(name, replace=replace)
    pname = name if name is not None else kwargs.pop("name", None)
    if pname is None:
        raise TypeError("register_pattern needs a pattern name")

    def deco(fn: Callable) -> Pattern:
        p = Pattern(name=pname, fn=fn, **kwargs)
        p.description = p.description or (inspect.getdoc(fn) or "").split("\n\n")[0]
        return REGISTRY.register(p, replace=replace)

    return deco


def registered_patterns(disabled: Iterable[str] = ()) -> list[Pattern]:
    return REGISTRY.patterns(disabled)


def unregister_pattern(name: str) -> Pattern | None:
    return REGISTRY.unregister(name)


def get_pattern(name: str) -> Pattern | None:
    return REGISTRY.get(name)
