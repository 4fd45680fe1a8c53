"""Which torch.compile call is dynamo working for right now?

The backend is called once per dynamo graph; graphs of one compiled callable (split by graph breaks) must be
linked into one program, and capture rewrites must only change what *fusegraph* traces. Both need to identify
the current ``torch.compile`` call from inside dynamo. Dynamo exposes the current instruction translator, whose
output graph holds the (wrapped) backend object: that object is stable for all frames of one ``torch.compile``.
"""
from __future__ import annotations

from typing import Any


def current_compiler_fn() -> Any | None:
    """The wrapped backend object of the compile in progress, or None outside dynamo tracing."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:  # not tracing, or a torch without this API
        return None
    output = getattr(tx, "output", None)
    return getattr(output, "compiler_fn", None)


def unwrap_backend(obj: Any) -> tuple[Any, dict]:
    """Follow dynamo's wrappers down to the user's backend function; return it with its torch.compile kwargs."""
    kwargs: dict = {}
    seen = 0
    while obj is not None and seen < 8:
        seen += 1
        if hasattr(obj, "kwargs") and hasattr(obj, "compiler_fn"):  # torch._TorchCompileWrapper
            kwargs = dict(obj.kwargs)
            obj = obj.compiler_fn
            continue
        inner = getattr(obj, "_torchdynamo_orig_backend", None)
        if inner is not None and inner is not obj:
            obj = inner
            continue
        if hasattr(obj, "func") and hasattr(obj, "keywords"):  # functools.partial
            kwargs = {**dict(obj.keywords), **kwargs}
            obj = obj.func
            continue
        break
    return obj, kwargs


def current_fusegraph_options() -> dict | None:
    """The options of the fusegraph compile in progress; None if dynamo is not compiling for fusegraph."""
    fn, kwargs = unwrap_backend(current_compiler_fn())
    if fn is None or not getattr(fn, "_fusegraph_backend", False):
        return None
    return dict(kwargs.get("options") or {})


def current_frame_compile() -> tuple[int, int] | None:
    """(frame id, how many times dynamo compiled that frame before) of the compile in progress.

    A frame compiled a second time is a *recompile* (a guard failed: a new batch size, a Python int that
    changed...): its graph replaces the earlier version of the same piece of the step, it does not extend it.
    """
    import torch

    try:
        cid = torch._guards.CompileContext.current_compile_id()
    except Exception:  # a torch without this API, or not compiling
        return None
    if cid is None or getattr(cid, "frame_id", None) is None or getattr(cid, "frame_compile_id", None) is None:
        return None
    return int(cid.frame_id), int(cid.frame_compile_id)


def current_recompile_reason() -> str | None:
    """Why dynamo is compiling the current frame again: the latest guard failure it recorded for the frame's code
    (``torch._dynamo.utils.guard_failures``, e.g. ``"0/3: L['self'].cache.layers[0].cumulative_length_int == 11"``);
    None outside a recompile or on a torch without that record."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._dynamo.utils import guard_failures

        code = InstructionTranslator.current_tx().f_code
    except Exception:  # not tracing, or a torch without this API
        return None
    reasons = guard_failures.get(code) or []
    return str(reasons[-1]) if reasons else None
