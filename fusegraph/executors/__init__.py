"""Executors run a captured graph of the program: eager ATen ops now; NKI kernels (interpreter, Neuron) later."""
from .base import Executor, available_executors, get_executor, register_executor
from . import eager as _eager  # noqa: F401  (registers "eager")

__all__ = ["Executor", "available_executors", "get_executor", "register_executor"]
