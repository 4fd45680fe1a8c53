"""Verification inputs: random values plus the edge cases that expose fake or fragile kernels.

Every kernel is run on several input *cases* (``KernelTask.cases``): ``random`` (uniform in the spec's range),
``zeros``, ``negative`` (the negative part of the range) and ``large`` (magnitudes 16x to 64x the range; a
kernel that saturates, overflows an intermediate dtype or hard-codes a scale fails here). Inputs are never NaN.
Integer ``index`` inputs stay in their ``[lo, hi)`` range (zeros -> ``lo``, large -> ``hi - 1``), ``fixed``
inputs are the same in every case, and ``edge_values=False`` inputs stay random.
"""
from __future__ import annotations

import hashlib

import torch

from .task import KernelTask, TensorSpec

DEFAULT_FLOAT_RANGE = (-4.0, 4.0)
DEFAULT_INT_RANGE = (-100.0, 100.0)
LARGE_FACTOR = 64.0


def _generator(seed: int, *parts: object) -> torch.Generator:
    h = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    g = torch.Generator()
    g.manual_seed(int.from_bytes(h[:8], "little") & (2**63 - 1))
    return g


def _float_case(spec: TensorSpec, case: str, g: torch.Generator) -> torch.Tensor:
    lo, hi = spec.value_range or DEFAULT_FLOAT_RANGE
    u = torch.rand(spec.shape, generator=g, dtype=torch.float64)
    if case == "zeros":
        x = torch.zeros(spec.shape, dtype=torch.float64)
    elif case == "negative" and lo < 0:
        x = lo + u * (min(hi, 0.0) - lo)
    elif case == "large":
        mag = max(abs(lo), abs(hi), 1.0) * LARGE_FACTOR
        limit = torch.finfo(spec.dtype).max / 1e3
        mag = min(mag, limit)
        sign = torch.where(torch.rand(spec.shape, generator=g) < 0.5, -1.0, 1.0).double()
        if lo >= 0:
            sign = sign.abs()
        x = sign * mag * (0.25 + 0.75 * u)
    else:
        x = lo + u * (hi - lo)
    return x.to(spec.dtype)


def _int_case(spec: TensorSpec, case: str, g: torch.Generator) -> torch.Tensor:
    lo, hi = spec.value_range or ((0.0, 2.0) if spec.index else DEFAULT_INT_RANGE)
    lo_i, hi_i = int(lo), int(hi)
    if spec.dtype == torch.bool:
        return torch.rand(spec.shape, generator=g) < 0.5
    if case == "zeros":
        return torch.full(spec.shape, lo_i if spec.index else 0, dtype=spec.dtype)
    if case == "large":
        return torch.full(spec.shape, hi_i - 1, dtype=spec.dtype) if spec.index else torch.where(
            torch.rand(spec.shape, generator=g) < 0.5, lo_i, hi_i - 1).to(spec.dtype)
    if case == "negative" and not spec.index and lo_i < 0:
        return torch.randint(lo_i, min(hi_i, 0), spec.shape, generator=g).to(spec.dtype)
    return torch.randint(lo_i, hi_i, spec.shape, generator=g).to(spec.dtype)


def make_input(spec: TensorSpec, case: str, seed: int = 0, salt: object = "") -> torch.Tensor:
    """The value of one input in one case (deterministic in ``seed`` and ``salt``)."""
    if spec.fixed is not None:
        t = spec.fixed.detach().to("cpu", spec.dtype).clone().contiguous()
        if tuple(t.shape) != spec.shape:
            raise ValueError(f"fixed value of input {spec.name!r} has shape {tuple(t.shape)}, spec says {spec.shape}")
        return t
    effective = case if spec.edge_values else "random"
    g = _generator(seed, salt, spec.name, case)
    if spec.is_float:
        return _float_case(spec, effective, g)
    return _int_case(spec, effective, g)


def make_cases(task: KernelTask, seed: int = 0) -> list[tuple[str, list[torch.Tensor]]]:
    """``[(case name, [one tensor per input])]`` for every case of the task."""
    return [(case, [make_input(s, case, seed, salt=task.name) for s in task.inputs]) for case in task.cases]
