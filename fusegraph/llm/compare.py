"""Compare a kernel's output with the torch reference and say *how* it differs.

The repair prompt is only as good as this message: it names the output and the input case, the largest
absolute difference with its index and both values, how many elements are outside the tolerance, and
non-finite mismatches. Tolerances are per dtype (the interpreter computes in fp32 and rounds on write, like the
hardware; low-precision outputs round differently from torch's op-by-op rounding) unless the spec overrides.
An element passes when ``|kernel - reference| <= atol * max(1, max|reference|) + rtol * |reference|``: the
absolute part scales with the output's magnitude, because summation-order noise on an element that cancels to
near zero is as large as on its biggest neighbours.
"""
from __future__ import annotations

import torch

from .task import TensorSpec

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
"""(atol, rtol) per output dtype; integer and bool outputs must match exactly."""


def tolerance(spec: TensorSpec) -> tuple[float, float]:
    atol, rtol = TOLERANCES.get(spec.dtype, (0.0, 0.0))
    return (spec.atol if spec.atol is not None else atol, spec.rtol if spec.rtol is not None else rtol)


def _index(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for s in reversed(shape):
        out.append(flat % s if s else 0)
        flat = flat // s if s else 0
    return tuple(reversed(out))


def compare(got: torch.Tensor, ref: torch.Tensor, spec: TensorSpec, case: str) -> tuple[str | None, float]:
    """``(None, max_abs_diff)`` when ``got`` matches ``ref`` within tolerance, else ``(message, max_abs_diff)``."""
    where = f"output '{spec.name}' (input case '{case}')"
    if tuple(got.shape) != tuple(ref.shape):
        return f"{where}: the kernel returned shape {tuple(got.shape)}, expected {tuple(ref.shape)}", float("inf")
    if got.numel() == 0:
        return None, 0.0
    g, r = got.double(), ref.double()
    atol, rtol = tolerance(spec)
    g_fin, r_fin = torch.isfinite(g), torch.isfinite(r)
    nonfinite_bad = (g_fin != r_fin) | (~g_fin & ~r_fin & (g != r) & ~(torch.isnan(g) & torch.isnan(r)))
    if bool(nonfinite_bad.any()):
        i = int(nonfinite_bad.reshape(-1).nonzero()[0])
        idx = _index(i, tuple(got.shape))
        n = int(nonfinite_bad.sum())
        unwritten = int((torch.isnan(g) & r_fin).sum())
        hint = (f"; {unwritten} of them NaN where the reference is finite: fresh memory holds NaN, so the kernel "
                f"probably never wrote those elements (every element of an output must be written)"
                if unwritten else "")
        return (f"{where}: {n} element(s) non-finite where the reference is not (or the reverse), first at {idx}: "
                f"kernel {g.reshape(-1)[i].item():.6g}, reference {r.reshape(-1)[i].item():.6g}{hint}"), float("inf")
    both = g_fin & r_fin
    diff = torch.where(both, (g - r).abs(), torch.zeros_like(g))
    max_diff = float(diff.max())
    scale = max(1.0, float(torch.where(both, r.abs(), torch.zeros_like(r)).max()))
    bad = both & (diff > atol * scale + rtol * r.abs())
    if not bool(bad.any()):
        return None, max_diff
    i = int(diff.reshape(-1).argmax())
    idx = _index(i, tuple(got.shape))
    n = int(bad.sum())
    return (f"{where} differs from the reference: max |kernel - reference| = {max_diff:.6g} at index {idx} "
            f"(kernel {g.reshape(-1)[i].item():.6g}, reference {r.reshape(-1)[i].item():.6g}); {n} of {got.numel()} "
            f"element(s) exceed atol {atol:g}*{scale:.4g} + rtol {rtol:g}*|reference| (the atol scales with the "
            f"largest reference magnitude)"), max_diff


def within(got: torch.Tensor, ref: torch.Tensor, spec: TensorSpec, factor: float) -> bool:
    """Whether ``got`` matches ``ref`` with the tolerance scaled by ``factor`` (a near miss, for the reward)."""
    if tuple(got.shape) != tuple(ref.shape):
        return False
    if got.numel() == 0:
        return True
    g, r = got.double(), ref.double()
    atol, rtol = tolerance(spec)
    g_fin, r_fin = torch.isfinite(g), torch.isfinite(r)
    if bool(((g_fin != r_fin) | (~g_fin & ~r_fin & (g != r) & ~(torch.isnan(g) & torch.isnan(r)))).any()):
        return False
    both = g_fin & r_fin
    diff = torch.where(both, (g - r).abs(), torch.zeros_like(g))
    scale = max(1.0, float(torch.where(both, r.abs(), torch.zeros_like(r)).max()))
    return not bool((both & (diff > factor * (atol * scale + rtol * r.abs()))).any())
