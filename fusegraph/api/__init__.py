"""The public API above the pipeline: capture a step, explain it, build a model's megakernel without running it.

* :func:`capture_step` / :func:`last_capture` -> :class:`Capture` (``fusegraph.capture_step``), in ``capture``;
* :func:`explain` -> the fused-region report of a dry run (``fusegraph.explain``), in ``explain``;
* :func:`capture_decode` / :func:`capture_callable` -> :class:`CapturedStep`, then :func:`build_for_target`
  (or both at once, :func:`build_decode_kernel`) -> :class:`KernelBuild`: the decode-step megakernel of a
  bundled model or of user code, generated as the NKI executor generates it (``fusegraph kernel``, the
  performance benchmark), in ``kernel``.

Everything here drives the backend (it captures through ``torch.compile``), so it sits above the pipeline,
the executors and the report; nothing below imports it. The names load with their module on first use, as
in ``fusegraph`` itself: capturing a step must not depend on codegen loading (a capture, a dry run or the eager
executor never generates a kernel, and the pipeline contains codegen failures by falling back to eager).
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Capture": "capture", "capture_step": "capture", "last_capture": "capture",
    "explain": "explain",
    "CapturedStep": "kernel", "KernelBuild": "kernel", "build_decode_kernel": "kernel", "build_for_target": "kernel",
    "capture_callable": "kernel", "capture_decode": "kernel",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
