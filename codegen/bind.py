"""What each kernel argument is, its shape in HBM, and how a model tensor becomes it.

The kernel program's values carry *logical* (torch) shapes; the kernel reads weights in the layouts codegen
chose (see :mod:`.weights`). :func:`arg_specs` records, per argument, the transform from the model's tensor to
the kernel's tensor, as each instruction declares it (``Instruction.arg_specs(layouts, add)``); arguments no
instruction declares are passed as they are. The executor applies the transforms once per parameter version.

One kernel argument has one layout. A model tensor two instructions read in different layouts (tied embeddings:
the embedding gathers rows of the table as it is, the lm head reads the same tensor re-laid out for its matmuls)
is two kernel arguments with the same source (:func:`weight_for_use`); an argument that is still read both ways
is refused here (a :class:`CodegenError`, so the step falls back) instead of one reader seeing the other's layout.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

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
    """Every kernel argument's spec: declared by the instructions that read it, else as is. Raises
    :class:`CodegenError` (naming the instruction, so only its match leaves the kernel) when an argument one
    instruction reads as it is is re-laid out by another's spec."""
    specs: dict[str, ArgSpec] = {}
    declared_by: dict[int, set[str]] = {}  # id(instruction) -> the arguments it declared

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
        mine = declared_by.setdefault(id(ins), set())

        def add_for(v: ir.Value | None, *a: Any, mine: set[str] = mine, **kw: Any) -> None:
            add(v, *a, **kw)
            if v is not None:
                mine.add(v.name)

        ins.arg_specs(layouts, add_for)
    for ins in program.instructions:
        _check_undeclared_reads(ins, declared_by[id(ins)], specs)
    for v in program.inputs:
        if v.name not in specs:
            dtype = torch.int32 if v.dtype == torch.int64 else v.dtype
            specs[v.name] = ArgSpec(v.name, v.kind, tuple(v.shape), dtype, None, "as-is")
    return specs


def _check_undeclared_reads(ins: ir.Instruction, declared: set[str], specs: dict[str, ArgSpec]) -> None:
    """An instruction that reads an HBM argument as it is, while another re-lays it out, would read the other's
    layout (out of bounds, or wrong values): refuse the kernel, naming both readers."""
    for v in ins.reads():
        spec = specs.get(v.name)
        if v.kind == ir.ValueKind.ACT or spec is None or spec.transform is None or v.name in declared:
            continue
        err = CodegenError(f"kernel argument {v.name} is read as it is by {ins.name or ins.opcode} and re-laid out "
                           f"for another instruction ({spec.role})")
        err.instructions = (ins,)
        err.causes = (str(err),)
        raise err


def weight_for_use(L: Any, nid: str, use: str, label: str) -> ir.Value:
    """The kernel argument of weight ``nid`` as read by ``use`` (``"rows"``: gathered as it is; ``"linear"``:
    re-laid out for a matmul): the first use gets the weight's own argument (``L.hbm``), every other use its own
    argument named ``label`` with the same source, so each reader gets its own layout (tied embeddings: the
    embedding table is also the lm head). ``L`` is the :class:`~.lowering.Lowerer` of the kernel."""
    uses: dict[str, dict[str, ir.Value]] = L.shared.setdefault("weight uses", {})
    nid = L.aliases.get(nid, nid)
    seen = uses.setdefault(nid, {})
    if use in seen:
        return seen[use]
    fresh = nid not in L.values  # a weight L.hbm creates now has no reader yet
    v = L.hbm(nid)
    if seen or (not fresh and _read_by_other_use(L, v)):
        v = _second_argument(L, v, label)
    seen[use] = v
    return v


def _read_by_other_use(L: Any, v: ir.Value) -> bool:
    """Whether an instruction lowered without :func:`weight_for_use` already reads ``v`` (an unknown use)."""
    return any(r is v for ins in L.instructions for r in ins.reads())


def _second_argument(L: Any, full: ir.Value, label: str) -> ir.Value:
    """Another kernel argument fetched from the same program node as ``full`` (its own name, spec and layout)."""
    v = ir.Value(L.unique(label), full.kind, tuple(full.shape), full.dtype, node=full.node)
    L.order.append(v)
    L.args[v.name] = dataclasses.replace(L.args[full.name])
    return v
