"""What each kernel argument is, its shape in HBM, and how a model tensor becomes it.

The kernel program's values carry *logical* (torch) shapes; the kernel reads weights in the layouts codegen
chose (see :mod:`.weights`). :func:`arg_specs` records, per argument, the transform from the model's tensor to
the kernel's tensor, as each instruction declares it (``Instruction.arg_specs(layouts, add)``); arguments no
instruction declares are passed as they are. The executor applies the transforms once per parameter version.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import ir
from .errors import CodegenError
from .layout import Layout, experts_intermediate_layout  # noqa: F401  (re-exported: its historical home)


@dataclass
class ArgSpec:
    name: str
    kind: str  # ir.ValueKind
    shape: tuple[int, ...]  # in the kernel
    dtype: torch.dtype  # in the kernel
    transform: Callable[[torch.Tensor], torch.Tensor] | None  # None: passed as is (int64 -> int32 at the boundary)
    role: str = ""


def _shape_of(fn: Callable[[torch.Tensor], torch.Tensor], v: ir.Value) -> tuple[int, ...]:
    return tuple(fn(torch.empty(v.shape, dtype=v.dtype, device="meta")).shape)


def arg_specs(program: ir.KernelProgram, layouts: dict[str, Layout]) -> dict[str, ArgSpec]:
    """Every kernel argument's spec: declared by the instructions that read it, else as is."""
    specs: dict[str, ArgSpec] = {}

    def add(v: ir.Value | None, role: str, fn: Callable[[torch.Tensor], torch.Tensor] | None,
            dtype: torch.dtype | None = None) -> None:
        if v is None:
            return
        if v.name in specs and specs[v.name].role != role:
            raise CodegenError(f"kernel argument {v.name} is used in two incompatible ways ({specs[v.name].role}, {role})")
        shape = _shape_of(fn, v) if fn is not None else tuple(v.shape)
        kdtype = dtype or v.dtype
        if fn is not None and dtype is not None:
            base = fn
            fn = lambda t, base=base, dtype=dtype: base(t).to(dtype)  # noqa: E731
        specs[v.name] = ArgSpec(v.name, v.kind, shape, kdtype, fn, role)

    for ins in program.instructions:
        ins.arg_specs(layouts, add)
    for v in program.inputs:
        if v.name not in specs:
            dtype = torch.int32 if v.dtype == torch.int64 else v.dtype
            specs[v.name] = ArgSpec(v.name, v.kind, tuple(v.shape), dtype, None, "as-is")
    return specs
