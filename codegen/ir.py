"""The kernel IR: semantic instructions over named values, the unit codegen emits and the reference VM runs.

A region of the program (a list of pattern matches) is lowered to a :class:`KernelProgram`: instructions in
execution order, each reading and writing :class:`Value`s. Instructions are dataclasses that hold all of their
behaviour (HazyResearch Megakernels style): what the template needs, the program nodes they implement (for
comments, attribution and bisection), their decoder layer, and the hooks the central passes call instead of
switching on the instruction's type:

========================  ==========================================================================================
hook                      called by
========================  ==========================================================================================
``constrain(c)``          :func:`.plan.plan_layouts`: layout constraints (``c.same``, ``c.heads``, ``c.prefer_pmajor``)
``arg_specs(layouts, add)`` :func:`.bind.arg_specs`: how the model tensors it reads become kernel arguments
``constants(ctx)``        :func:`.megakernel.generate`: constant kernel arguments it needs (``{name: Constant}``)
``setup(ctx)``            :func:`.megakernel.generate`: per-kernel prologue code (loaded once, shared by layers)
``module_code(ctx)``      :func:`.megakernel.generate`: module-level code before the kernel (sub-functions it calls)
``emit(ctx, i)``          :func:`.megakernel.generate`: its NKI code (:class:`~.emitters.Emitted`)
``reference(env)``        :func:`.reference.run`: the same math in PyTorch on logical values
========================  ==========================================================================================

Built-in instructions live with their lowering, templates and reference in their op folder
(``fusegraph.patterns.<op>``); ``ir.RMSNorm`` etc. still resolve here. Values are per-token feature vectors ``[T, F]`` (T
tokens; decode means one position per sequence, so T is the batch) unless stated otherwise. On chip they live in
SBUF as ``[P, FT, T]`` tiles with feature ``f = ft * P + p`` (see :mod:`.layout`). HBM values (weights, caches,
step inputs) are kernel arguments.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from .errors import CodegenError
from .registry import instruction_class

if TYPE_CHECKING:  # pragma: no cover
    from .emitters import Context, Emitted
    from .layout import Layout


class ValueKind:
    ACT = "act"  # per-token activation in SBUF, [P, FT, T]
    WEIGHT = "weight"  # read-only HBM tensor (a model parameter, possibly re-laid out for the kernel)
    STATE = "state"  # HBM tensor written in place (KV cache)
    INPUT = "input"  # per-step HBM input computed outside the kernel (token ids, cos/sin, mask, cache index)
    OUTPUT = "output"  # HBM output of the kernel (logits)
    ROUTING = "routing"  # token-major [T, K] SBUF tile (router top-k weights / expert ids)
    TENSOR = "tensor"  # a buffer of any shape in the kernel's HBM scratch (the tensor path, codegen/tensor)


@dataclass
class Value:
    name: str  # identifier-safe, unique in the kernel
    kind: str
    shape: tuple[int, ...]  # logical (torch) shape: [T, F] for activations, the tensor shape for HBM values
    dtype: torch.dtype
    node: str | None = None  # program node id it corresponds to (for verification and bisection)
    group: int = 0  # for head-structured activations: the head size (features are [heads, group])

    @property
    def tokens(self) -> int:
        return self.shape[0]

    @property
    def features(self) -> int:
        n = 1
        for s in self.shape[1:]:
            n *= s
        return n


@dataclass
class Constant:
    """A constant kernel argument fusegraph supplies (ones, rotation matrices, token selectors). ``role`` is the
    key emitters look its SBUF variable up by (``ctx.consts[role]``). ``on_chip=False``: it stays in HBM (a value
    of any shape the tensor path folded when the kernel was built: an ``arange``, a ``full``), read by its
    argument name."""

    tensor: torch.Tensor
    role: str
    on_chip: bool = True


class Constraints:
    """What :meth:`Instruction.constrain` may say about layouts (implemented by :mod:`.plan`)."""

    def same(self, *values: Value | None) -> None:  # pragma: no cover - interface
        """These activations are combined elementwise: one layout for all of them."""
        raise NotImplementedError

    def heads(self, value: Value, size: int) -> None:  # pragma: no cover - interface
        """This activation is head-structured: ``size`` features per head on partitions."""
        raise NotImplementedError

    def prefer_pmajor(self, value: Value) -> None:  # pragma: no cover - interface
        """This activation is stored to HBM: prefer the partition-major (contiguous) layout."""
        raise NotImplementedError


AddSpec = Callable[..., None]  # bind.arg_specs' add(value, role, transform, dtype=None)


@dataclass
class Instruction:
    """Base class. ``nodes``: program nodes implemented; ``layer``: decoder layer (None outside layers);
    ``name``: unique in the kernel (``L<layer>.<module>.<op>``, see :func:`assign_names`)."""

    opcode: ClassVar[str] = "?"
    nodes: tuple[str, ...] = field(default=(), kw_only=True)
    layer: int | None = field(default=None, kw_only=True)
    module: str | None = field(default=None, kw_only=True)
    pattern: str | None = field(default=None, kw_only=True)
    name: str = field(default="", kw_only=True)

    def reads(self) -> list[Value]:
        return [v for f in dataclasses.fields(self) if isinstance(v := getattr(self, f.name), Value)
                and f.name not in self.output_fields]

    def writes(self) -> list[Value]:
        return [getattr(self, f) for f in self.output_fields if getattr(self, f) is not None]

    output_fields: ClassVar[tuple[str, ...]] = ("out",)

    # ---- hooks (defaults: no constraint, arguments as they are, nothing shared, no code) -----------------
    def constrain(self, c: Constraints) -> None:
        """Layout constraints between the values this instruction reads and writes."""

    def arg_specs(self, layouts: dict[str, "Layout"], add: AddSpec) -> None:
        """Declare how each model tensor it reads becomes a kernel argument (``add(value, role, transform)``)."""

    def constants(self, ctx: "Context") -> dict[str, Constant]:
        """Constant kernel arguments it needs, by argument name (shared across instructions by name)."""
        return {}

    def setup(self, ctx: "Context") -> list[str]:
        """Per-kernel prologue code (per-step tables loaded once); register what it loads in ``ctx.inputs``."""
        return []

    def module_code(self, ctx: "Context") -> list[str]:
        """Module-level code the kernel needs before its ``def`` (sub-functions it calls; identical pieces of
        several instructions are emitted once)."""
        return []

    def emit(self, ctx: "Context", index: int) -> "Emitted":
        raise CodegenError(f"no NKI template for instruction {self.opcode}")

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        raise CodegenError(f"the reference VM has no implementation of {self.opcode}")


def base_name(ins: Instruction) -> str:
    """``L<layer>.<module tail>.<opcode>`` (``top`` outside the layers)."""
    parts = [p for p in (ins.module or ins.opcode).split(".") if not p.isdigit()]
    tail = parts[-1] if parts else ins.opcode
    prefix = f"L{ins.layer}" if ins.layer is not None else "top"
    return f"{prefix}.{tail}.{ins.opcode}"


def assign_names(instructions: list[Instruction]) -> None:
    """Give every instruction a unique name: the two RoPEs of a layer become ``...rope`` and ``...rope2``."""
    seen: dict[str, int] = {}
    for ins in instructions:
        base = base_name(ins)
        seen[base] = seen.get(base, 0) + 1
        ins.name = base if seen[base] == 1 else f"{base}{seen[base]}"


@dataclass
class KernelProgram:
    """What one megakernel computes: instructions in order plus its HBM interface."""

    name: str
    tokens: int
    instructions: list[Instruction]
    inputs: list[Value]  # HBM arguments in signature order (inputs, weights, state)
    outputs: list[Value]  # returned HBM tensors (outputs first, then state returned for in-place writes)
    meta: dict[str, Any] = field(default_factory=dict)

    def layers(self) -> list[int]:
        return sorted({i.layer for i in self.instructions if i.layer is not None})


def __getattr__(name: str) -> Any:
    """``ir.RMSNorm`` etc.: the instruction classes live with their op (one folder per op in fusegraph.patterns)
    and register by name; this resolves them for kernels built by hand (tests, examples). Only class-like names
    are looked up: the import system probes dunders (``__path__``) while ops are still importing this module."""
    cls = instruction_class(name) if name[:1].isupper() else None
    if cls is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return cls
