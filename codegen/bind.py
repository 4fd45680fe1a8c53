"""What each kernel argument is, its shape in HBM, and how a model tensor becomes it.

The kernel program's values carry *logical* (torch) shapes; the kernel reads weights in the layouts codegen
chose (see :mod:`.weights`). :func:`arg_specs` records, per argument, the transform from the model's tensor to
the kernel's tensor. The executor applies the transforms once per parameter version.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import ir
from . import weights as W
from .errors import CodegenError
from .layout import Layout, largest_divisor


@dataclass
class ArgSpec:
    name: str
    kind: str  # ir.ValueKind
    shape: tuple[int, ...]  # in the kernel
    dtype: torch.dtype  # in the kernel
    transform: Callable[[torch.Tensor], torch.Tensor] | None  # None: passed as is (int64 -> int32 at the boundary)
    role: str = ""


def experts_intermediate_layout(intermediate: int) -> Layout:
    return Layout(largest_divisor(intermediate), intermediate // largest_divisor(intermediate))


def _shape_of(fn: Callable[[torch.Tensor], torch.Tensor], v: ir.Value) -> tuple[int, ...]:
    return tuple(fn(torch.empty(v.shape, dtype=v.dtype, device="meta")).shape)


def arg_specs(program: ir.KernelProgram, layouts: dict[str, Layout]) -> dict[str, ArgSpec]:
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
        if isinstance(ins, ir.Linear):
            li, lo = layouts[ins.x.name], layouts[ins.out.name]
            add(ins.weight, f"linear:{li}:{lo}", lambda t, li=li, lo=lo: W.linear(t, li, lo))
            add(ins.bias, f"bias:{lo}", lambda t, lo=lo: W.per_feature(t, lo), torch.float32)
        elif isinstance(ins, ir.RMSNorm) and ins.weight is not None:
            per_head = ins.group != ins.x.features
            xl = layouts[ins.x.name]  # a head split over S partition tiles: [P, S], one column per tile
            lay = (Layout(ins.group, 1) if xl.split == 1 else Layout(xl.P, xl.split)) if per_head else xl
            dtype = torch.float32 if (per_head or ins.weight_offset or ins.center) else ins.weight.dtype
            add(ins.weight, f"norm:{lay}:{ins.weight_offset}",
                lambda t, lay=lay, off=ins.weight_offset: W.per_feature(t, lay, offset=off), dtype)
            add(ins.bias, f"norm_bias:{lay}", lambda t, lay=lay: W.per_feature(t, lay), torch.float32)
        elif isinstance(ins, ir.Elementwise):
            full = [v for v, c in zip(ins.inputs, ins.input_classes) if c == "full"] + list(ins.outputs)
            lay = layouts[full[0].name]
            for v, c in zip(ins.inputs, ins.input_classes):
                if c == "feature":
                    add(v, f"feature:{lay}", lambda t, lay=lay: W.per_feature(t.reshape(-1), lay))
        elif isinstance(ins, ir.Router):
            li = layouts[ins.x.name]
            add(ins.weight, f"router:{li}", lambda t, li=li: W.router(t, li))
        elif isinstance(ins, ir.Experts):
            lx, lo = layouts[ins.x.name], layouts[ins.out.name]
            mid = experts_intermediate_layout(ins.intermediate)
            gu_out = Layout(mid.P, 2 * mid.FT)
            add(ins.gate_up, f"experts_gate_up:{lx}:{gu_out}", lambda t, a=lx, b=gu_out: W.experts(t, a, b))
            add(ins.down, f"experts_down:{mid}:{lo}", lambda t, a=mid, b=lo: W.experts(t, a, b))
    for v in program.inputs:
        if v.name not in specs:
            dtype = torch.int32 if v.dtype == torch.int64 else v.dtype
            specs[v.name] = ArgSpec(v.name, v.kind, tuple(v.shape), dtype, None, "as-is")
    return specs
