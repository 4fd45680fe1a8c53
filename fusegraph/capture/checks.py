"""Decide, before lowering, whether fusegraph can take a dynamo graph at all.

Everything refused here runs on the eager path with one warning naming the reason: a user's forward must never
fail because fusegraph could not handle it.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

import torch
import torch.fx as fx

from ..program.sources import parse_source

#: dtypes the Trainium engines (and so fusegraph's codegen) can hold; anything else stays on the eager path
SUPPORTED_DTYPES = {
    torch.float32, torch.bfloat16, torch.float16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
}


class CaptureRefused(Exception):
    """fusegraph cannot (or should not) take this graph; the message is the user-facing reason."""


def _source_name(node: fx.Node) -> str:
    ga = node.meta.get("grapharg")
    src = getattr(ga, "source", None)
    name = getattr(src, "name", None)
    if callable(name):
        name = name()
    return name or node.name


def _module(node: fx.Node) -> str:
    """The innermost module an op ran in, for messages."""
    where = node.meta.get("nn_module_stack")
    return list(where.values())[-1][0] if where else "the step"


def _is_symbolic(v: Any) -> bool:
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(v, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in v.shape)
    return False


#: op namespaces of torch's functional collectives (what dynamo records for DTensor redistributions and funcol)
_COLLECTIVE_NAMESPACES = {"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "_dtensor"}
_TP_REFUSAL = "tensor-parallel (DTensor) graphs are not fused yet"


def _distributed_types() -> tuple[type, ...]:
    """DTensor and DeviceMesh if torch.distributed's tensor package is loaded (nothing can hold one otherwise, so
    an undistributed run does not pay for importing it)."""
    types_ = []
    for mod, name in (("torch.distributed.tensor", "DTensor"), ("torch.distributed.device_mesh", "DeviceMesh")):
        cls = getattr(sys.modules.get(mod), name, None)
        if isinstance(cls, type):
            types_.append(cls)
    return tuple(types_)


def _describe(v: Any) -> str:
    """``DTensor (Shard(dim=0) over 2 ranks)``: what a distributed input is, for the refusal message."""
    placements = getattr(v, "placements", None)
    mesh = getattr(v, "device_mesh", v)
    try:
        size = mesh.size()
        ranks = f" over {size} rank{'s' if size != 1 else ''}"
    except Exception:  # noqa: BLE001 - a mesh without a size: name the type only
        ranks = ""
    where = f"{', '.join(map(repr, placements))}{ranks}" if placements else ranks.strip()
    return f"{type(v).__name__} ({where})" if where else type(v).__name__


def _collective(target: Any) -> str | None:
    ns = getattr(target, "namespace", None)  # OpOverload
    if ns is None:
        ns = getattr(target, "_qualified_op_name", "").partition("::")[0] or None  # OpOverloadPacket
    return str(target) if ns in _COLLECTIVE_NAMESPACES else None


def check_not_distributed(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Refuse graphs of a tensor-parallel model: DTensor parameters, device meshes, functional collectives.

    Lowering would trace *through* DTensor's dispatch on fake tensors, bake each rank's fake local shard into the
    graph as a constant and drop the collectives: a program that cannot run (or computes one rank's partial sums).
    Until tensor parallelism is fused, such a graph runs eagerly: dynamo's graph with DTensor dispatch, the same
    ops as the uncompiled model.
    """
    dist_types = _distributed_types()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for cls in dist_types:  # DTensors first: the parameter names the model; a mesh input is a closure cell
        for n, value in zip(placeholders, list(example_inputs) + [None] * len(placeholders)):
            v = next((x for x in (value, n.meta.get("example_value")) if isinstance(x, cls)), None)
            if v is not None:
                raise CaptureRefused(f"{_TP_REFUSAL} (input {parse_source(_source_name(n)).path} is a "
                                     f"{_describe(v)})")
    for n in gm.graph.nodes:
        if n.op != "call_function" and n.op != "call_method":
            continue
        op = _collective(n.target) if n.op == "call_function" else None
        if op is not None:
            raise CaptureRefused(f"{_TP_REFUSAL} (node {n.name} in {_module(n)} is the collective {op})")
        if dist_types and isinstance(n.meta.get("example_value"), dist_types):
            raise CaptureRefused(f"{_TP_REFUSAL} (node {n.name} in {_module(n)} makes a DTensor)")


def check_capturable(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Raise :class:`CaptureRefused` with the reason if fusegraph must leave this graph to eager PyTorch."""
    check_not_distributed(gm, example_inputs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in placeholders:
        val = n.meta.get("example_value")
        if isinstance(val, torch.Tensor) and _is_symbolic(val):
            raise CaptureRefused(
                f"dynamic shapes are not supported (input {_source_name(n)} has a symbolic size); "
                "compile with dynamic=False"
            )
        if isinstance(val, (torch.SymFloat, torch.SymBool)):
            raise CaptureRefused(f"symbolic float/bool inputs are not supported (input {_source_name(n)})")
    tensors = [v for v in example_inputs if isinstance(v, torch.Tensor)]
    if not tensors:
        raise CaptureRefused("the graph has no tensor inputs, so there is nothing to fuse")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise CaptureRefused(
            "autograd is enabled and inputs require grad; fusegraph fuses inference steps only "
            "(run the step under torch.no_grad() or torch.inference_mode())"
        )
    for n in gm.graph.nodes:
        val = n.meta.get("example_value")
        vals = val if isinstance(val, (list, tuple)) else [val]
        for v in vals:
            if isinstance(v, torch.Tensor) and v.dtype not in SUPPORTED_DTYPES:
                raise CaptureRefused(
                    f"unsupported dtype {str(v.dtype).replace('torch.', '')} (node {n.name} in {_module(n)}); "
                    "Trainium kernels support fp32/bf16/fp16 and integer types"
                )
    if not any(n.op == "call_function" or n.op == "call_method" or n.op == "call_module" for n in gm.graph.nodes):
        raise CaptureRefused("the graph computes nothing")


def check_static_shapes(aten_gm: fx.GraphModule) -> None:
    """Symbolic *scalar* inputs are fine (a Python int dynamo made dynamic, such as a cache's step counter, that
    only enters arithmetic: it is a runtime value like a position); a tensor whose shape depends on one is not
    (kernels are generated for static shapes)."""
    for n in aten_gm.graph.nodes:
        val = n.meta.get("val")
        for v in val if isinstance(val, (list, tuple)) else [val]:
            if isinstance(v, torch.Tensor) and _is_symbolic(v):
                raise CaptureRefused(
                    f"dynamic shapes are not supported ({n.name} in {_module(n)} has a symbolic size "
                    f"{tuple(v.shape)}); compile with dynamic=False"
                )


def dynamo_input_sources(gm: fx.GraphModule) -> list[str]:
    return [_source_name(n) for n in gm.graph.nodes if n.op == "placeholder"]
