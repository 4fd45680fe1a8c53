"""The verified LLM kernel writer: regions nothing else lowers, written by a model, trusted only once verified.

Public API (imported lazily: the verification worker imports this package and must not pull in torch)::

    from fusegraph.llm import KernelTask, TensorSpec, write_kernel
    if enabled(settings):                      # llm_url and llm_model are both set
        result = write_kernel(task, settings)  # -> WriterResult (never raises)

See docs/llm.md for the option, the safety model, the training data export (``fusegraph export-sft``) and the
benchmark (``fusegraph llm-eval``).
"""
from __future__ import annotations

from typing import Any

_LAZY = {
    "KernelTask": ("fusegraph.llm.task", "KernelTask"),
    "TensorSpec": ("fusegraph.llm.task", "TensorSpec"),
    "write_kernel": ("fusegraph.llm.writer", "write_kernel"),
    "enabled": ("fusegraph.llm.writer", "enabled"),
    "WriterResult": ("fusegraph.llm.writer", "WriterResult"),
    "Attempt": ("fusegraph.llm.writer", "Attempt"),
    "verify": ("fusegraph.llm.harness", "verify"),
    "Verdict": ("fusegraph.llm.harness", "Verdict"),
    "Limits": ("fusegraph.llm.harness", "Limits"),
    "export_sft": ("fusegraph.llm.sft", "export"),
    "evaluate": ("fusegraph.llm.evaluate", "evaluate"),
    "write_with_config": ("fusegraph.llm.writer", "write_with_config"),
    "WriterConfig": ("fusegraph.llm.writer", "WriterConfig"),
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'fusegraph.llm' has no attribute {name!r}")
