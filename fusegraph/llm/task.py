"""What the LLM kernel writer is asked to write: a region as a torch reference plus its tensor interface.

A :class:`KernelTask` is self-contained: the reference exists twice, as source text (what the model reads, and
part of the cache key) and as a callable (what verification compares against, run only in the trusted main
process). The kernel contract the model is held to is fixed by the task: one ``@nki.jit`` function taking the
inputs as HBM tensors in ``inputs`` order and returning ``outputs`` in order, each a fresh ``nl.shared_hbm``
tensor, or the input named by ``alias_of`` for state written in place (a KV cache).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

CASES: tuple[str, ...] = ("random", "zeros", "negative", "large")
"""Input value cases every kernel is verified on (see :mod:`fusegraph.llm.inputs`)."""


@dataclass(frozen=True)
class TensorSpec:
    """One kernel input or output.

    ``value_range``: for floats the range of the ``random`` case (default ``(-4, 4)``); for integer ``index``
    tensors the half-open range ``[lo, hi)`` of valid indices. ``fixed``: a constant passed unchanged in every
    case (an identity, a rotation matrix). ``edge_values=False`` keeps an input on random values in the edge
    cases (weights whose scale the region assumes). Outputs only: ``alias_of`` names the input this output is
    (written in place and returned), ``atol``/``rtol`` override the per-dtype tolerances.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    value_range: tuple[float, float] | None = None
    index: bool = False
    fixed: torch.Tensor | None = field(default=None, compare=False)
    edge_values: bool = True
    description: str = ""
    alias_of: str | None = None
    atol: float | None = None
    rtol: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if self.value_range is not None:
            object.__setattr__(self, "value_range", (float(self.value_range[0]), float(self.value_range[1])))

    @property
    def kernel_dtype(self) -> torch.dtype:
        """The dtype the kernel sees: NKI has no 64-bit types, so int64 indices arrive as int32."""
        return torch.int32 if self.dtype == torch.int64 else self.dtype

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point

    def key(self) -> dict[str, Any]:
        """The parts of the spec that decide which kernel is correct (for the cache key)."""
        d: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "dtype": str(self.dtype),
                             "range": list(self.value_range) if self.value_range else None, "index": self.index,
                             "alias_of": self.alias_of}
        if self.fixed is not None:
            import hashlib

            t = self.fixed.detach().to("cpu").contiguous()
            data = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
            d["fixed"] = hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]
        return d


@dataclass
class KernelTask:
    """A region for the LLM to write as one NKI kernel (see the module docstring for the contract).

    ``model``: the model being compiled (context for the prompt and the report; the *LLM's* model name comes
    from settings and is what the cache is keyed on). ``structure``: a canonical description of the region
    (e.g. its ATen op graph) for the cache key; empty means "the reference source". ``cases``: the input cases
    to verify on (drop ``zeros`` for regions whose reference is ill-defined on them, e.g. top-k with ties).
    ``data_movement_only``: the region only moves data (a transpose, a gather), so the "computes with NKI
    instructions" check is waived. ``lnc``: the launch grid, 1 (``kernel(...)``) or 2 (``kernel[2](...)``: two
    programs, ``nl.program_id(0)`` 0 and 1, sharing the HBM tensors); verification launches the kernel so.
    """

    name: str
    reference_source: str
    reference: Callable[..., Any]
    inputs: Sequence[TensorSpec]
    outputs: Sequence[TensorSpec]
    model: str = ""
    context: str = ""
    structure: str = ""
    cases: tuple[str, ...] = CASES
    data_movement_only: bool = False
    lnc: int = 1

    def __post_init__(self) -> None:
        self.inputs = tuple(self.inputs)
        self.outputs = tuple(self.outputs)
        self.cases = tuple(self.cases)

    @property
    def kernel_name(self) -> str:
        """An identifier derived from ``name``, suggested to the model as the kernel's function name."""
        ident = re.sub(r"\W+", "_", self.name).strip("_") or "kernel"
        return ident if not ident[0].isdigit() else f"k_{ident}"

    def input_index(self, name: str) -> int:
        return [s.name for s in self.inputs].index(name)

    def problems(self) -> list[str]:
        """What is wrong with the task itself (a caller bug, reported instead of asking the model)."""
        out = []
        names = [s.name for s in self.inputs]
        if len(set(names)) != len(names):
            out.append(f"duplicate input names {names}")
        if not self.outputs:
            out.append("the task has no outputs")
        for o in self.outputs:
            if o.alias_of is not None and o.alias_of not in names:
                out.append(f"output {o.name!r} aliases unknown input {o.alias_of!r}")
        for c in self.cases:
            if c not in CASES:
                out.append(f"unknown verification case {c!r} (known: {', '.join(CASES)})")
        if "random" not in self.cases:
            out.append("verification needs the 'random' case")
        if self.lnc not in (1, 2):
            out.append(f"lnc must be 1 or 2, got {self.lnc!r}")
        if not callable(self.reference):
            out.append("the reference is not callable")
        return out
