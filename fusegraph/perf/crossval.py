"""A joint fit over every measured kernel, and leave-one-out cross-validation of it.

Why: a parameter set fitted to one kernel's profile reproduces that profile and says nothing about a kernel it
did not see (issue 28: fitted on the hand-written Qwen3-30B-A3B megakernel, the model was 23-38% off the
hand-written GPT-OSS-20B megakernel's measured kernel time). Only an error measured on a kernel left out of the
fit says how far to trust a modeled number. So: every kernel with a measured profile is a
:class:`MeasuredKernel` (its interpreter trace as a :class:`~fusegraph.perf.kernelview.KernelView`, the figures
measured on hardware, their sources); :func:`fit_joint` fits the low-confidence parameters to all of them at once
(each kernel weighs the same, whatever its number of figures), and :func:`leave_one_out` fits once per kernel
without it and reports that kernel's errors under the others' fit -- the band printed beside modeled times.

The fit itself (bounds with physical meaning, the pattern search, the pull towards the sourced values) is
:func:`fusegraph.perf.fit.search`'s; nothing here adds a free parameter.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .costmodel import Estimate, estimate_kernel
from .fit import FitResult, Measured, layer_figures, relative_errors, search
from .kernelview import KernelView
from .params import FITTABLE, HardwareParams

log = logging.getLogger(__name__)

#: figure keys of a joint fit: ``<kernel name>:<figure>``
SEP = ":"


@dataclass(eq=False)
class MeasuredKernel:
    """A kernel whose figures were measured on hardware, as the cost model sees it.

    ``targets`` are seconds (or ``(low, high)`` where the source bounds the figure) keyed by the names ``figures`` returns (default: :func:`~fusegraph.perf.fit.layer_figures`
    -- per-layer wall, per-engine busy time, DMA active); ``sources`` names the published figure behind each;
    ``weights`` weigh figures within the kernel (a kernel's figures together weigh 1 in a joint fit)."""

    name: str
    view: KernelView
    targets: Mapping[str, Measured]
    sources: Mapping[str, str]
    layers: int | None = None
    weights: Mapping[str, float] = field(default_factory=dict)
    figures: Callable[[Estimate, int | None], dict[str, float]] | None = None
    #: parameters that are facts of this kernel's deployment, not of the hardware (which engine the compiler's own
    #: DMA choice triggers on, set by the compiler flags of its driver): applied before any fitted value
    deployment: Mapping[str, Any] = field(default_factory=dict)
    #: kernels of one group are left out together (profiles of one kernel's variants: leaving one out while its
    #: siblings stay in would test the model on what it was fitted to); default: the kernel alone
    group: str = ""

    @property
    def family(self) -> str:
        return self.group or self.name

    def modeled(self, hw: HardwareParams, values: Mapping[str, float] | None = None) -> dict[str, float]:
        """This kernel's figures costed with ``hw`` (``values`` replacing some of its parameters)."""
        merged = {**self.deployment, **dict(values or {})}
        trial = hw.what_if(f"cross-validation trial ({self.name})", **merged) if merged else hw
        est = estimate_kernel(self.view, trial, label=self.name)
        return (self.figures or layer_figures)(est, self.layers)

    def errors(self, modeled: Mapping[str, float]) -> dict[str, float]:
        """Relative error (modeled - measured) / measured of each measured figure (0 inside a bounding interval)."""
        return relative_errors(modeled, self.targets)


def _key(kernel: str, figure: str) -> str:
    return f"{kernel}{SEP}{figure}"


def fit_joint(kernels: Sequence[MeasuredKernel], hw: HardwareParams, *, params: Sequence[str] = FITTABLE,
              evaluators: Mapping[str, Callable[[Mapping[str, float]], dict[str, float]]] | None = None,
              **kw: Any) -> FitResult:
    """Fit ``params`` to every kernel's measured figures at once. The result's targets and modeled figures are
    keyed ``<kernel>:<figure>``. ``evaluators`` (by kernel name) replace the re-costing (tests); ``kw`` go to
    :func:`~fusegraph.perf.fit.search` (prior, max_evaluations, min_step, bounds)."""
    if not kernels:
        raise ValueError("a joint fit needs at least one measured kernel")
    names = [k.name for k in kernels]
    if len(set(names)) != len(names):
        raise ValueError(f"measured kernels need distinct names: {names}")
    targets: dict[str, float] = {}
    weights: dict[str, float] = {}
    sources: dict[str, str] = {}
    for k in kernels:
        total = sum(k.weights.get(f, 1.0) for f in k.targets)
        for f, v in k.targets.items():
            targets[_key(k.name, f)] = v
            weights[_key(k.name, f)] = k.weights.get(f, 1.0) / total
            if f in k.sources:
                sources[_key(k.name, f)] = k.sources[f]
    evaluators = dict(evaluators or {})

    def evaluate_at(values: Mapping[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for k in kernels:
            figs = evaluators[k.name](values) if k.name in evaluators else k.modeled(hw, values)
            out.update({_key(k.name, f): v for f, v in figs.items()})
        return out

    return search(evaluate_at, hw, targets, params=params, weights=weights, sources=sources, **kw)


def split(result: FitResult, kernel: str) -> dict[str, float]:
    """One kernel's modeled figures out of a joint fit's (keys without the kernel prefix)."""
    pre = kernel + SEP
    return {k[len(pre):]: v for k, v in result.modeled.items() if k.startswith(pre)}


@dataclass
class HeldOutKernel:
    """One round of leave-one-out: the fit on the other kernels and the left-out kernel's figures under it."""

    kernel: str
    fit: FitResult  # on every kernel but this one
    measured: dict[str, Measured]
    modeled: dict[str, float]  # under the others' fit (every figure the kernel's ``figures`` gives)
    sourced: dict[str, float]  # under the sourced parameters, for comparison

    def errors(self, modeled: Mapping[str, float] | None = None) -> dict[str, float]:
        return relative_errors(self.modeled if modeled is None else modeled, self.measured)

    def max_error(self) -> float:
        return max(abs(e) for e in self.errors().values())

    def to_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "fit": self.fit.to_dict(), "measured_s": self.measured,
                "modeled_s": self.modeled, "sourced_s": self.sourced, "errors": self.errors(),
                "sourced_errors": self.errors(self.sourced)}


def leave_one_out(kernels: Sequence[MeasuredKernel], hw: HardwareParams, *, params: Sequence[str] = FITTABLE,
                  evaluators: Mapping[str, Callable[[Mapping[str, float]], dict[str, float]]] | None = None,
                  **kw: Any) -> list[HeldOutKernel]:
    """For each group of kernels (:attr:`MeasuredKernel.group`; a kernel alone by default): fit jointly on all the
    other groups (from ``hw``), then cost each left-out kernel with that fit. Needs two groups or more. The errors
    are what the model is worth on a kernel it was not fitted to; one round per kernel, in ``kernels``' order."""
    groups = list(dict.fromkeys(k.family for k in kernels))
    if len(groups) < 2:
        raise ValueError("leave-one-out needs two measured kernels or more (in two groups or more)")
    evaluators = dict(evaluators or {})
    fits = {g: fit_joint([o for o in kernels if o.family != g], hw, params=params, evaluators=evaluators, **kw)
            for g in groups}
    out = []
    for k in kernels:
        res = fits[k.family]
        ev = evaluators.get(k.name)
        modeled = ev(res.values) if ev else k.modeled(hw, res.values)
        sourced = ev({}) if ev else k.modeled(hw)
        log.info("leave-one-out %s: max error %.1f%%", k.name, 100 * max(map(abs, k.errors(modeled).values())))
        out.append(HeldOutKernel(k.name, res, dict(k.targets), modeled, sourced))
    return out


def band(rounds: Sequence[HeldOutKernel], figure: str = "wall") -> float | None:
    """The largest absolute left-out error of ``figure`` over the rounds that measured it (None: none did) -- what
    "the model is within x% on kernels it was not fitted to" quotes."""
    errs = [abs(r.errors()[figure]) for r in rounds if figure in r.measured]
    return max(errs) if errs else None
