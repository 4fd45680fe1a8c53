"""fusegraph: a torch.compile backend that fuses an LLM decode step into one NKI megakernel for Trainium.

Use it as ``torch.compile(model, backend="fusegraph", options={...})`` (registered by entry point; no import
needed), or inspect what it captures with :func:`fusegraph.capture_step`.
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Settings": ("fusegraph.settings", "Settings"),
    "FusegraphOptionError": ("fusegraph.settings", "FusegraphOptionError"),
    "FusegraphWarning": ("fusegraph.warnings", "FusegraphWarning"),
    "capture_step": ("fusegraph.api.capture", "capture_step"),
    "last_capture": ("fusegraph.api.capture", "last_capture"),
    "Capture": ("fusegraph.api.capture", "Capture"),
    "fusegraph_backend": ("fusegraph.backend", "fusegraph_backend"),
    "explain": ("fusegraph.api.explain", "explain"),
    "Report": ("fusegraph.report", "Report"),
    "analyze": ("fusegraph.matching", "analyze"),
    "register_pattern": ("fusegraph.matching", "register_pattern"),
    "Pattern": ("fusegraph.matching", "Pattern"),
    "Input": ("fusegraph.matching", "Input"),
    "ACTIVATIONS": ("fusegraph.matching", "ACTIVATIONS"),
    # the lowering API (docs/patterns.md, "Give a pattern its lowering")
    "register_lowering": ("fusegraph.codegen.registry", "register_lowering"),
    "add_template_dir": ("fusegraph.codegen.registry", "add_template_dir"),
    "Lowering": ("fusegraph.codegen.registry", "Lowering"),
    "Lowerer": ("fusegraph.codegen.lowering", "Lowerer"),
    "Instruction": ("fusegraph.codegen.ir", "Instruction"),
    "Constant": ("fusegraph.codegen.ir", "Constant"),
    # tensor parallelism with fewer KV heads than ranks (docs/tp.md, "When HF cannot shard the KV heads")
    "replicate_kv_heads": ("fusegraph.models.kv_replication", "replicate_kv_heads"),
    "replicate_kv_checkpoint": ("fusegraph.models.kv_replication", "replicate_kv_checkpoint"),
    # complete TP plans for families whose HF plan misses the decoder (docs/tp.md, "Models whose HF plan is incomplete")
    "tp_plan": ("fusegraph.models.tp_plans", "tp_plan"),
    "apply_tp_plan": ("fusegraph.models.tp_plans", "apply_tp_plan"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    # lazy: `import fusegraph` must stay cheap (the entry point imports fusegraph.backend only when used)
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'fusegraph' has no attribute {name!r}")
