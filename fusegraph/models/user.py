"""``--model module:function``: a decode step from the user's own code.

The function (called with no arguments) returns either a :class:`~fusegraph.models.DecodeCase` (its
``step(token, position)``) or ``(fn, args)`` / ``(fn, args, kwargs)``. The current directory is importable, so
``fusegraph report --model mymodels:qwen_step`` finds ``./mymodels.py``.
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class UserStep:
    spec: str
    fn: Callable
    args: tuple
    kwargs: dict = field(default_factory=dict)
    case: Any = None  # the DecodeCase when the function returned one (then eager can be checked on a fork)
    config: Any = None


def is_user_spec(name: str) -> bool:
    return ":" in name


def user_function(spec: str) -> Callable:
    """The function ``module:function`` names, imported (not called); a ``ValueError`` with a one-line message
    when the module or the function does not exist (an error raised inside the user's module propagates)."""
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise ValueError(f"--model {spec!r}: expected module:function (e.g. mymodels:qwen_step)")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name and (mod_name == e.name or mod_name.startswith(e.name + ".")):
            raise ValueError(f"--model {spec!r}: no module named {e.name!r} (the current directory and sys.path "
                             "were searched)") from None
        raise
    finally:
        sys.path.pop(0)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"--model {spec!r}: module {mod_name!r} has no function {fn_name!r}")
    return fn


def load_user_step(spec: str) -> UserStep:
    """Call the user's ``module:function`` and wrap what it returned."""
    fn = user_function(spec)
    sys.path.insert(0, os.getcwd())
    try:
        obj = fn()
    finally:
        sys.path.pop(0)
    if hasattr(obj, "step") and hasattr(obj, "token"):
        return UserStep(spec, obj.step, (obj.token, obj.position), {}, case=obj,
                        config=getattr(getattr(obj, "model", None), "config", None))
    if isinstance(obj, tuple) and len(obj) in (2, 3):
        fn, args = obj[0], tuple(obj[1])
        kwargs = dict(obj[2]) if len(obj) == 3 else {}
        return UserStep(spec, fn, args, kwargs, config=getattr(fn, "config", None))
    raise ValueError(f"{spec} returned {type(obj).__name__}; expected a DecodeCase or (fn, args[, kwargs])")
