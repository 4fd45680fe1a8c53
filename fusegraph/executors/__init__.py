"""Executors run a captured graph of the program: eager ATen ops now; NKI kernels (interpreter, Neuron) later."""
from .base import Executor, available_executors, get_executor, register_executor
from . import eager as _eager  # noqa: F401  (registers "eager")
from .neuron import register as _register_neuron
from .nki import register as _register_nki

_register_nki()
_register_neuron()

__all__ = ["Executor", "available_executors", "get_executor", "register_executor"]
