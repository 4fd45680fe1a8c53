"""Keep dynamically quantized ``Linear`` modules inside the graph: one opaque op per call instead of a graph break.

``torch.ao.quantization.quantize_dynamic`` replaces ``nn.Linear`` by ``torch.ao.nn.quantized.dynamic.Linear``,
whose forward calls ``torch.ops.quantized.linear_dynamic(x, packed)`` with ``packed`` a TorchScript object
(``LinearPackedParamsBase``) dynamo cannot put in a graph: it breaks the graph at every quantized linear (12
graphs for a 2-layer Llama), and nothing between two breaks is large enough to fuse.

The rewrite calls :func:`quantized_linear_dynamic` instead, a custom op whose arguments are the input tensor and
two integers: a handle naming the module and its output width. At run time the op calls the module's *own*
original forward, so the result is bit-identical to eager PyTorch (qint8 and fp16 packed weights alike); the rest of
the step stays in one graph, and fusegraph fuses around the op (the op itself runs in PyTorch: fusegraph has no
int8 kernel). The handle is computed eagerly at trace time (``assume_constant_result``) from the module *and* its
packed-weight object, so dynamo guards on the packed object's identity: a reused decoder-layer trace (layer reuse)
fails that guard for the next layer and is traced again, so no layer ever runs another layer's weights.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Iterable

import torch

from .base import CaptureRewrite, original_forward, register_capture_rewrite

log = logging.getLogger(__name__)

#: the op's name in program nodes and reports (``fusegraph.quantized_linear_dynamic.default``)
OP_NAME = "fusegraph.quantized_linear_dynamic.default"

#: handle -> the module (weakly: the registry must not keep a user's model alive)
_MODULES: dict[int, weakref.ref] = {}


def _linear_class() -> type | None:
    try:
        from torch.ao.nn.quantized.dynamic import Linear
    except Exception as e:  # a torch without eager-mode quantization: nothing to rewrite
        log.debug("torch.ao.nn.quantized.dynamic.Linear unavailable: %s", e)
        return None
    return Linear


def find_classes() -> Iterable[type]:
    cls = _linear_class()
    return [cls] if cls is not None else []


def applies(module: torch.nn.Module) -> bool:
    """Only the two packed-weight kinds the class itself supports (its forward raises for any other)."""
    packed = getattr(module, "_packed_params", None)
    return getattr(packed, "dtype", None) in (torch.qint8, torch.float16) and isinstance(
        getattr(module, "out_features", None), int)


@torch._dynamo.assume_constant_result
def _handle(module: torch.nn.Module, packed: Any) -> int:
    """Register ``module`` and return its handle. Run eagerly at trace time; ``packed`` is passed only so that
    dynamo guards on the identity of the packed weights (see the module docstring)."""
    _MODULES[id(module)] = weakref.ref(module)
    return id(module)


def module_of(handle: int) -> torch.nn.Module | None:
    """The quantized module a handle names (None once it was freed)."""
    ref = _MODULES.get(int(handle))
    return ref() if ref is not None else None


@torch.library.custom_op("fusegraph::quantized_linear_dynamic", mutates_args=())
def quantized_linear_dynamic(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """The module's own forward on ``x`` (so the result is exactly eager PyTorch's)."""
    module = module_of(handle)
    if module is None:
        raise RuntimeError("the dynamically quantized Linear this graph was traced with no longer exists")
    return original_forward(type(module))(module, x)


@quantized_linear_dynamic.register_fake
def _(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return quantized_linear_dynamic(x, _handle(module, module._packed_params._packed_params), module.out_features)


register_capture_rewrite(
    CaptureRewrite(
        name="fusegraph.quantized_linear_dynamic",
        description="torch.ao.nn.quantized.dynamic.Linear (packed weights dynamo cannot trace: a graph break per "
        "call) -> one opaque op that runs the module's own forward (no graph breaks; not fused itself).",
        find_classes=find_classes,
        applies=applies,
        forward=forward,
    )
)
