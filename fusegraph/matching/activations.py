"""The one table of single-op activation functions: the PyTorch callable, the ATen op it traces to, the NKI
function the Scalar engine evaluates.

Four consumers read it: the ``act`` slot of gated-activation patterns (:data:`fusegraph.matching.ACTIVATIONS`),
codegen's templates (``nisa.activation(op=nl.<fn>)``), the reference VM (the torch callable) and generic
lowering (the ATen op). Keeping them in one table is what makes "matches, then the emitter refuses it"
impossible: an activation a slot accepts is an activation every template can emit.

Matching owns the table (codegen may import matching, never the other way round).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


@dataclass(frozen=True)
class Activation:
    """One unary function. ``slot``: offered by the ``act`` slot (an activation HF decoders use); the others are
    math functions only generic lowering needs (exp, rsqrt...). ``kwargs``: what the ATen op's keyword arguments
    must be for this entry (gelu's ``approximate``)."""

    name: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    aten: str
    nki: str  # the function's name in nki.language (``nl.<nki>``)
    slot: bool = False
    kwargs: tuple[tuple[str, Any], ...] = ()


TABLE: tuple[Activation, ...] = (
    Activation("silu", torch.nn.functional.silu, "aten.silu.default", "silu", slot=True),
    Activation("gelu", torch.nn.functional.gelu, "aten.gelu.default", "gelu", slot=True,
               kwargs=(("approximate", "none"),)),
    Activation("gelu_tanh", _gelu_tanh, "aten.gelu.default", "gelu_apprx_tanh", slot=True,
               kwargs=(("approximate", "tanh"),)),
    Activation("relu", torch.relu, "aten.relu.default", "relu", slot=True),
    Activation("sigmoid", torch.sigmoid, "aten.sigmoid.default", "sigmoid", slot=True),
    Activation("tanh", torch.tanh, "aten.tanh.default", "tanh", slot=True),
    Activation("mish", torch.nn.functional.mish, "aten.mish.default", "mish", slot=True),
    Activation("exp", torch.exp, "aten.exp.default", "exp"),
    Activation("log", torch.log, "aten.log.default", "log"),
    Activation("sqrt", torch.sqrt, "aten.sqrt.default", "sqrt"),
    Activation("rsqrt", torch.rsqrt, "aten.rsqrt.default", "rsqrt"),
    Activation("abs", torch.abs, "aten.abs.default", "abs"),
    Activation("erf", torch.erf, "aten.erf.default", "erf"),
)

#: other spellings of an entry's name (HF's ``hidden_act`` strings)
ALIASES = {"gelu_pytorch_tanh": "gelu_tanh"}

_BY_NAME = {a.name: a for a in TABLE}
_BY_NKI = {a.nki: a for a in TABLE}


def activation(name: str) -> Activation:
    """The entry called ``name`` (or an alias of it); KeyError when there is none."""
    return _BY_NAME[ALIASES.get(name, name)]


def by_nki(fn: str) -> Activation:
    """The entry whose NKI function is ``nl.<fn>``; KeyError when there is none."""
    return _BY_NKI[fn]


def slot_options() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Name -> callable of the activations the ``act`` slot offers, in table order."""
    return {a.name: a.fn for a in TABLE if a.slot}


def for_aten(op: str, kwargs: dict[str, Any] | None = None) -> Activation | None:
    """The entry an ATen call computes (``aten.gelu.default`` with ``approximate='tanh'`` is ``gelu_tanh``), or None."""
    kw = kwargs or {}
    for a in TABLE:
        if a.aten == op and all(kw.get(k, "none" if k == "approximate" else None) == v for k, v in a.kwargs):
            return a
    return None


__all__ = ["ALIASES", "Activation", "TABLE", "activation", "by_nki", "for_aten", "slot_options"]
