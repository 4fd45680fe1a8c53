"""Decide, before lowering, whether fusegraph can take a dynamo graph at all.

Everything refused here runs on the eager path with one warning naming the reason: a user's forward must never
fail because fusegraph could not handle it.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

import torch
import torch.fx as fx

from ..program.complex_pairs import PAIR_DTYPE, complex_refusal
from ..program.sources import parse_source

#: dtypes the Trainium engines (and so fusegraph's codegen) can hold; anything else stays on the eager path
SUPPORTED_DTYPES = {
    torch.float32, torch.bfloat16, torch.float16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
}
#: complex dtypes taken as well: the program computes them as real pairs (``program/complex_pairs.py``), provided
#: every op on them has a pair form (:func:`check_complex`, after lowering)
COMPLEX_DTYPES = {getattr(torch, name) for name in PAIR_DTYPE}


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


def check_distributed(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Refuse the parts of tensor parallelism fusegraph does not lower (``docs/tp.md``).

    DTensor inputs (HF ``tp_plan="auto"``, ``parallelize_module``), device-mesh inputs and functional collectives
    are captured: lowering traces the step over each rank's local shards (:mod:`.lower`). What is refused here,
    before lowering, is a DTensor whose local shard is itself a wrapper tensor subclass (a quantized or two-part
    shard: what its inner tensors mean is not modelled). Collectives whose process group this process does not
    know are refused after lowering (:func:`check_collectives`).
    """
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    from ..program.distributed import describe_distributed

    dtensor = _distributed_type("torch.distributed.tensor", "DTensor")
    if dtensor is None:
        return
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, value in zip(placeholders, example_inputs):
        if not isinstance(value, dtensor):
            continue
        inner = [getattr(value, a) for a in value.__tensor_flatten__()[0]]
        local = [t for t in inner if isinstance(t, torch.Tensor)]
        if len(local) != 1 or is_traceable_wrapper_subclass(local[0]):
            raise CaptureRefused(f"tensor-parallel input {parse_source(_source_name(n)).path} is a "
                                 f"{describe_distributed(value)} whose local shard is a "
                                 f"{', '.join(type(t).__name__ for t in local)}; only plain local shards are "
                                 "lowered")


def _distributed_type(module: str, name: str) -> type | None:
    """A torch.distributed class if its module is loaded (nothing can hold one otherwise, so an undistributed
    run does not pay for importing it)."""
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) else None


def check_collectives(aten_gm: fx.GraphModule) -> None:
    """Every functional collective of the lowered graph runs on a process group this process knows (the
    executors run it on that group; the program records its ranks)."""
    from ..program.distributed import collective_arguments, group_known, is_functional_collective

    for n in aten_gm.graph.nodes:
        if n.op != "call_function" or not is_functional_collective(n.target):
            continue
        name = collective_arguments(n.target, n.args, n.kwargs).get("group_name")
        if not isinstance(name, str) or not group_known(name):
            raise CaptureRefused(f"the collective {n.target} ({n.name} in {_module(n)}) runs on process group "
                                 f"{name!r}, which this process does not know (initialize torch.distributed with "
                                 "that group before compiling)")


def check_capturable(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Raise :class:`CaptureRefused` with the reason if fusegraph must leave this graph to eager PyTorch."""
    check_distributed(gm, example_inputs)
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
            if isinstance(v, torch.Tensor) and v.dtype not in SUPPORTED_DTYPES | COMPLEX_DTYPES:
                raise CaptureRefused(
                    f"unsupported dtype {str(v.dtype).replace('torch.', '')} (node {n.name} in {_module(n)}); "
                    "Trainium kernels support fp32/bf16/fp16 and integer types (complex64 as real pairs)"
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


def check_complex(aten_gm: fx.GraphModule) -> None:
    """Every op on complex values has a real-pair form (``program/complex_pairs.py`` rewrites them once the graph is
    in the program); checked on the lowered graph, before anything is added to the program."""
    found = complex_refusal(aten_gm)
    if found is not None:
        n, reason = found
        raise CaptureRefused(f"{reason} (node {n.name} in {_module(n)}); complex values are computed as real pairs "
                             "and this op has no pair form")


def dynamo_input_sources(gm: fx.GraphModule) -> list[str]:
    return [_source_name(n) for n in gm.graph.nodes if n.op == "placeholder"]
