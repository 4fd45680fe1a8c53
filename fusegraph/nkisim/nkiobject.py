"""``nl.NKIObject`` / ``nccl.NKIObject``: the base of user-defined classes in NKI kernels, with the NKI compiler's
initializer semantics.

The NKI language guide ("Class Support", SDK 2.29): "In NKI all classes are similar to Python data classes ... The
@dataclass decorator is optional; classes with and without the @dataclass decorator will be compiled in the same
way by the NKI compiler.  The compiler will create the initializer functions __init__ and __post_init__, if they
are not provided by the user", and the default ``__init__`` of ``x: int; y: bool = False`` is
``def __init__(self, x=None, y=False)``: **a field without a default defaults to None**.  Python's own
``@dataclass`` would make such a field required, so code that compiles for the device (nki-library's
``MLPTKGConstantsDimensionSizes(...)`` omits its ``remainderIFused`` field) fails under plain Python.

:meth:`NKIObject.__init_subclass__` therefore gives every subclass that does not define ``__init__`` itself the
compiler's initializer: the annotated fields (bases first, in order) as optional parameters, defaulting to the
class-level default or None, then ``__post_init__()`` if defined.  ``@dataclass`` keeps an ``__init__`` already in
the class body, so it still adds ``__eq__``/``__repr__`` ("Equality in NKI is structural") but not its own
initializer.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

_GENERATED = "__nkisim_generated_init__"
_MISSING = object()


def _fields(cls: type) -> list[tuple[str, Any]]:
    """(name, default) of the annotated instance fields of ``cls`` and its NKIObject bases, bases first."""
    out: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or klass is NKIObject or not issubclass(klass, NKIObject):
            continue
        processed = klass.__dict__.get("__dataclass_fields__", {})  # a base already through @dataclass
        for name, ann in klass.__dict__.get("__annotations__", {}).items():
            text = ann if isinstance(ann, str) else repr(ann)
            if "ClassVar" in text or (not isinstance(ann, str) and typing.get_origin(ann) is typing.ClassVar):
                continue
            default = processed[name] if name in processed else klass.__dict__.get(name, _MISSING)
            out.pop(name, None)
            out[name] = default
    return list(out.items())


def _default_value(default: Any) -> Any:
    if isinstance(default, dataclasses.Field):
        if default.default is not dataclasses.MISSING:
            return default.default
        if default.default_factory is not dataclasses.MISSING:
            return default.default_factory()
        return None
    return None if default is _MISSING else default


def _user_init(cls: type) -> bool:
    """Whether ``cls`` or one of its NKIObject bases defines ``__init__`` in its own body."""
    for klass in cls.__mro__:
        if klass is NKIObject or klass is object:
            return False
        init = klass.__dict__.get("__init__")
        if init is not None and not getattr(init, _GENERATED, False):
            return True
    return False


def _make_init(cls: type):
    fields = _fields(cls)
    names = [n for n, _ in fields]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(names):
            raise TypeError(f"{cls.__name__}() takes at most {len(names)} positional arguments ({len(args)} given)")
        for name in names[: len(args)]:
            if name in kwargs:
                raise TypeError(f"{cls.__name__}() got multiple values for argument {name!r}")
        unknown = set(kwargs) - set(names)
        if unknown:
            raise TypeError(f"{cls.__name__}() got unexpected keyword arguments {sorted(unknown)}")
        for i, (name, default) in enumerate(fields):
            value = args[i] if i < len(args) else kwargs[name] if name in kwargs else _default_value(default)
            object.__setattr__(self, name, value)
        post = getattr(self, "__post_init__", None)
        if post is not None:
            post()

    setattr(__init__, _GENERATED, True)
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    return __init__


class NKIObject:
    """Base class for NKI kernel dataclasses and configuration objects (see the module docstring)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" not in cls.__dict__ and not _user_init(cls):
            cls.__init__ = _make_init(cls)  # type: ignore[misc]
