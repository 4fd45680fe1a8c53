"""The executor interface and its registry.

An executor turns one captured graph of the program into a callable ``run(list_of_inputs) -> list_of_outputs``
with exactly the semantics of the ATen graph it came from, including in-place writes of state inputs. The
eager executor interprets the program's ATen ops; the NKI executors run generated kernels for the regions they
cover and hand the remaining ops to the eager path.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from ..program import Program
from ..settings import Settings

Runner = Callable[[Sequence[Any]], list]

#: a kernel (or a JAX step's fused run) that fails at run time on this many calls in a row is retired: it runs on
#: the fallback path from then on. A single failing call (a malformed request: an out-of-range id, a NaN) falls
#: back for that call only, so one bad request does not cost every later one its kernel.
RETIRE_AFTER_FAILURES = 3


class Executor(Protocol):
    name: str

    def compile(self, program: Program, graph_index: int, settings: Settings) -> Runner:
        """Prepare graph ``graph_index`` of ``program`` for execution."""


_EXECUTORS: dict[str, Callable[[], Executor]] = {}


def register_executor(name: str) -> Callable[[Callable[[], Executor]], Callable[[], Executor]]:
    def deco(factory: Callable[[], Executor]) -> Callable[[], Executor]:
        _EXECUTORS[name] = factory
        return factory

    return deco


def available_executors() -> list[str]:
    return sorted(_EXECUTORS)


def get_executor(name: str) -> Executor:
    if name not in _EXECUTORS:
        raise KeyError(f"unknown executor {name!r}; available: {', '.join(available_executors())}")
    return _EXECUTORS[name]()
