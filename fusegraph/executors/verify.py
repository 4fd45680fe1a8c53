"""A kernel's first call checked against eager: its outputs and the state it wrote, against the region's ATen ops
run on the same inputs (what ``Settings.verify`` turns on); any difference past the tolerance disables it."""
from __future__ import annotations

from typing import Any

import torch

from ..settings import Settings
from .kernels import KernelPlan


def verification_problems(plan: KernelPlan, results: dict, state_copies: dict, env: dict,
                          settings: Settings) -> list[str]:
    """What differs between the kernel's run (``results``; state written into ``state_copies``) and the eager
    region's (``env``, after it ran); empty when it verified."""
    problems = []
    for name, node in plan.lowered.outputs.items():
        problems += compare(f"output {node}", results[name], env[node], settings)
    for name, copy in state_copies.items():
        node = plan.lowered.args[name].node
        problems += compare(f"state {node}", copy, env[node], settings)
    return problems


def compare(what: str, got: torch.Tensor, expected: torch.Tensor, settings: Settings) -> list[str]:
    """One tensor against eager's: relative to eager's largest magnitude, ``verify_tolerance`` for fp32 and at
    least 2e-2 for 16-bit values (one rounding step); non-finite values where eager has none always differ."""
    e = expected.detach().float().reshape(-1)
    g = got.detach().float().reshape(-1)
    if g.numel() != e.numel():
        return [f"{what}: {g.numel()} elements, expected {e.numel()}"]
    if not torch.isfinite(g).all() and torch.isfinite(e).all():
        return [f"{what}: non-finite values"]
    tol = settings.verify_tolerance if expected.dtype == torch.float32 else max(settings.verify_tolerance, 2e-2)
    scale = max(e.abs().max().item(), 1e-6)
    err = (g - e).abs().max().item()
    return [] if err <= tol * scale else [f"{what}: max |diff| {err:.3g} > {tol:g} x {scale:.3g}"]


def state_copies(plan: KernelPlan, env: dict) -> dict[str, Any]:
    """Copies of the state arguments, for the kernel to write while the eager region writes the real state."""
    return {name: env[src.node].clone() for name, src in plan.lowered.args.items() if src.kind == "state"}
