"""Capture rewrites: substitute graph-break-causing module implementations while fusegraph traces."""
from .base import (
    CaptureRewrite,
    apply_to_module,
    install_rewrites,
    original_forward,
    register_capture_rewrite,
    registered_rewrites,
    remove_from_module,
)
from . import hf_eager_experts as _hf_eager_experts  # noqa: F401  (registers the built-in rewrites)
from . import hf_layer_reuse as _hf_layer_reuse  # noqa: F401
from . import quantized_linear as _quantized_linear  # noqa: F401

__all__ = [
    "CaptureRewrite",
    "apply_to_module",
    "install_rewrites",
    "original_forward",
    "register_capture_rewrite",
    "registered_rewrites",
    "remove_from_module",
]
