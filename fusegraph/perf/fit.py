"""Fit the cost model's low-confidence parameters to a kernel's measured per-layer hardware profile.

Why: the model's per-instruction and per-DMA constants marked ``L`` in ``data/trainium.json`` (the matmul
initiation interval, the fixed cost of an engine instruction, the cross-engine semaphore, the DMA fixed latency and
how much of it overlaps, the efficiency by bytes per descriptor, the hardware-DGE issue cost:
:data:`fusegraph.perf.params.FITTABLE`) are extrapolations or placeholders. A kernel whose source is public and
whose per-layer engine times were measured on hardware (the hand-written Qwen3-30B-A3B megakernel on trn3,
perf_anchors.md §2.1 O1) is a measurement-derived source for exactly those, and for nothing else.

How: the kernel runs once in the interpreter (shape-only, with the per-instruction trace); its
:class:`~fusegraph.perf.kernelview.KernelView` is re-costed by :func:`costmodel.estimate_kernel` for each parameter
vector (the interpreter never re-runs). A small bounded pattern search in normalized coordinates (log scale for
the positive parameters) minimizes the squared log-errors of the fitted figures, plus a weak pull towards the
sourced values so parameters the figures do not determine stay where their sources put them. Compared like for
like: ``wall`` is the critical-path time of a layer, ``sync`` the Sync engine's busy time, ``dma_active`` the time
with any DMA in flight (:meth:`costmodel.Schedule.dma_active`, not the bandwidth occupancy), ``tensor`` the
Tensor engine's busy time, all means over the kernel's layers.
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .costmodel import Estimate, estimate_kernel
from .kernelview import KernelView
from .params import FITTABLE, FITTABLE_JOINT, HardwareParams

log = logging.getLogger(__name__)

#: per-layer quantities :func:`layer_figures` reports (seconds); the first four are what O1 measures
FIGURES = ("wall", "sync", "dma_active", "tensor", "cc", "dma_occupancy", "vector", "scalar", "gpsimd")
#: the figures a fit to O1 uses: wall, Sync, DMA active, Tensor (CC is not a function of a fittable parameter)
O1_FIGURES = ("wall", "sync", "dma_active", "tensor")


@dataclass(frozen=True)
class Bound:
    """The range a fit may move one parameter in, and why that range."""

    name: str
    lo: float
    hi: float
    log_scale: bool
    why: str


#: bounds of every fittable parameter: physically meaningful ranges around the sourced values
BOUNDS: dict[str, Bound] = {b.name: b for b in (
    Bound("pe_min_cycles", 32.0, 512.0, True,
          "O8's 64-cycle floor halved .. the largest moving free size (512): a matmul can issue no faster than half "
          "the documented floor and its stationary load is at most a full 128-column load per instruction"),
    Bound("engine_fixed_cycles", 25.0, 400.0, True, "O9's ~100 cycles, /4 .. x4"),
    Bound("semaphore_cross_engine", 0.02e-6, 0.6e-6, True, "§6 placeholder 0.1-0.2 us, /5 .. x3"),
    Bound("dma_fixed_latency", 0.3e-6, 3.0e-6, True, "O4's ~1.3 us, /4 .. x2.3"),
    Bound("dma_latency_overlap", 0.0, 1.0, False, "a fraction: none .. all of the latency hides behind transfers"),
    Bound("dma_efficiency_s0", 64.0, 4096.0, True,
          "§6 s0 ~ 512 B (range 256-1024) widened /8 .. x8 (O4's '32 KiB for ideal bandwidth' allows large s0)"),
    Bound("dma_issue_hwdge", 0.2e-6, 1.2e-6, True, "C16 0.6 us / O7 0.538 us, /2.7 .. x2"),
    Bound("cc_step_latency", 0.1e-6, 3.0e-6, True,
          "O4's ~1.3 us DMA semaphore-to-start taken for one ring step, /13 .. x2.3: a step of a small collective "
          "between cores of one chip may be one SBUF-to-SBUF write and a semaphore (nki-library's sb2sb "
          "all-reduce), far below a full DMA's fixed latency; no published per-step figure"),
)}


def layer_figures(est: Estimate, layers: int | None = None) -> dict[str, float]:
    """Mean per-layer figures (seconds) over the decoder layers of ``est``: ``wall`` (critical-path exposure),
    busy time per engine (with the layer's share of kernel-boundary Sync time in baselines), ``dma_active`` (time
    with any decoder layer's DMA in flight, per layer), ``dma_occupancy`` (bandwidth occupancy) and ``cc`` (collective
    engine). Without layer attribution, the whole kernel divided by ``layers``."""
    s = est.schedule
    keys = [k for k in est.layers if isinstance(k, int)]
    blocks = [est.layers[k] for k in keys] if keys else [est.total]
    dmas: dict[Any, list[int]] = defaultdict(list)
    for i, w in enumerate(s.works):
        if w.kind == "dma" and (not keys or isinstance(w.layer, int)):
            dmas[w.layer if keys else 0].append(i)
    n = len(blocks) if keys else max(1, layers or 1)
    out = {k: 0.0 for k in FIGURES}
    for b in blocks:
        out["wall"] += b.wall
        out["dma_occupancy"] += b.dma_occupancy
        for e in ("sync", "tensor", "vector", "scalar", "gpsimd", "cc"):
            out[e] += b.busy.get(e, 0.0)
    # the union over all the layers' DMAs, per layer: a layer's weights prefetched while the previous layer
    # computes are in flight once, not once per layer they are attributed to
    out["dma_active"] = s.dma_active([i for idx in dmas.values() for i in idx])
    return {k: v / n for k, v in out.items()}


def evaluate(view: KernelView, hw: HardwareParams, values: Mapping[str, float] | None = None,
             layers: int | None = None) -> dict[str, float]:
    """Per-layer figures of ``view`` costed with ``hw`` (``values`` replacing some of its parameters)."""
    trial = hw.what_if("calibration trial", **dict(values)) if values else hw
    return layer_figures(estimate_kernel(view, trial, label="calibration"), layers)


#: a measured figure: a value, or ``(low, high)`` where the source bounds the like quantity (a whole-profile engine
#: time that also holds work outside the kernel is an upper bound per layer: ``(0.0, bound)``)
Measured = float | tuple[float, float]


def nearest(modeled: float, measured: Measured) -> float:
    """The measured value ``modeled`` is compared with: the value itself, or the nearest end of an interval
    (``modeled`` itself when inside it, so its error is 0)."""
    if isinstance(measured, (tuple, list)):
        lo, hi = measured
        return min(max(modeled, lo), hi)
    return measured


def relative_error(modeled: float, measured: Measured) -> float:
    """(modeled - measured) / measured, against the nearest end of an interval (0 inside it)."""
    ref = nearest(modeled, measured)
    return (modeled - ref) / ref if ref else 0.0


def relative_errors(modeled: Mapping[str, float], measured: Mapping[str, Measured]) -> dict[str, float]:
    """:func:`relative_error` of every measured figure (a fit's targets, a left-out kernel's figures)."""
    return {k: relative_error(modeled[k], v) for k, v in measured.items()}


def log_error(modeled: float, measured: Measured) -> float:
    ref = nearest(modeled, measured)
    return math.log(max(modeled, 1e-15) / max(ref, 1e-15))


@dataclass
class FitResult:
    """A fit: the values found, where it started, the figures fitted and the model's figures before and after."""

    values: dict[str, float]
    start: dict[str, float]
    bounds: dict[str, Bound]
    targets: dict[str, Measured]  # measured figures fitted (seconds; an interval where the source bounds one)
    modeled: dict[str, float]  # per-layer figures at the fitted values (all of FIGURES)
    start_modeled: dict[str, float]
    evaluations: int
    objective: float
    at_bound: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # fitted figure -> the published figure it is
    converged: bool = True  # the step fell below ``min_step`` (else the evaluation budget ran out)

    def used(self) -> set[str]:
        """Names of the published figures this fit used (a held-out figure must not be one of them)."""
        return set(self.sources.values()) | set(self.targets)

    def errors(self, modeled: Mapping[str, float] | None = None) -> dict[str, float]:
        """Relative error (modeled - measured) / measured of every fitted figure."""
        return relative_errors(self.modeled if modeled is None else modeled, self.targets)

    def max_error(self) -> float:
        return max(abs(e) for e in self.errors().values())

    def to_dict(self) -> dict[str, Any]:
        return {"values": self.values, "start": self.start, "targets_s": self.targets, "modeled_s": self.modeled,
                "start_modeled_s": self.start_modeled, "errors": self.errors(),
                "start_errors": self.errors(self.start_modeled), "evaluations": self.evaluations,
                "objective": self.objective, "at_bound": self.at_bound, "sources": self.sources,
                "converged": self.converged,
                "bounds": {k: asdict(b) for k, b in self.bounds.items()}}


def _to_unit(b: Bound, v: float) -> float:
    v = min(max(v, b.lo), b.hi)
    if b.log_scale:
        return math.log(v / b.lo) / math.log(b.hi / b.lo)
    return (v - b.lo) / (b.hi - b.lo)


def _from_unit(b: Bound, u: float) -> float:
    u = min(max(u, 0.0), 1.0)
    if b.log_scale:
        return b.lo * (b.hi / b.lo) ** u
    return b.lo + u * (b.hi - b.lo)


def fit(view: KernelView, hw: HardwareParams, targets: Mapping[str, Measured], *,
        params: Sequence[str] = FITTABLE, bounds: Mapping[str, Bound] | None = None,
        weights: Mapping[str, float] | None = None, prior: float = 1e-3, max_evaluations: int = 1500,
        min_step: float = 1.0 / 256, layers: int | None = None,
        evaluator: Callable[[Mapping[str, float]], dict[str, float]] | None = None,
        sources: Mapping[str, str] | None = None) -> FitResult:
    """Fit ``params`` (a subset of :data:`FITTABLE`) so that ``view``'s per-layer figures match ``targets``.

    ``targets``: measured per-layer figures in seconds, keyed like :data:`FIGURES`. Objective: the weighted sum
    of squared log-errors plus ``prior`` x the squared distance from the start (``hw``'s values) in normalized
    coordinates. Bounded coordinate pattern search: each parameter tried one step up and down (clipped to its
    bound), the step halved when no move improves, until ``min_step`` or ``max_evaluations``.
    ``evaluator`` replaces the re-costing (tests); ``sources`` names the published figure behind each target
    (so :func:`held_out` can refuse to "validate" on a figure the fit used)."""
    unknown = [k for k in targets if k not in FIGURES]
    if unknown:
        raise ValueError(f"unknown figures {unknown}; known: {FIGURES}")
    return search(evaluator or (lambda values: evaluate(view, hw, values, layers)), hw, targets, params=params,
                  bounds=bounds, weights=weights, prior=prior, max_evaluations=max_evaluations, min_step=min_step,
                  sources=sources)


def search(evaluate_at: Callable[[Mapping[str, float]], dict[str, float]], hw: HardwareParams,
           targets: Mapping[str, Measured], *, params: Sequence[str] = FITTABLE,
           bounds: Mapping[str, Bound] | None = None, weights: Mapping[str, float] | None = None,
           prior: float = 1e-3, max_evaluations: int = 1500, min_step: float = 1.0 / 256,
           sources: Mapping[str, str] | None = None) -> FitResult:
    """The fit itself, for any figures: ``evaluate_at(values)`` returns modeled figures keyed like ``targets``
    (one kernel's per-layer figures for :func:`fit`; several kernels' figures, keyed ``kernel:figure``, for a joint
    fit). Starts from ``hw``'s values of ``params``; see :func:`fit` for the objective."""
    bad = [p for p in params if p not in FITTABLE_JOINT]
    if bad:
        raise ValueError(f"not low-confidence parameters a fit may change: {', '.join(bad)}")
    bounds = {p: (bounds or BOUNDS)[p] for p in params}
    weights = dict(weights or {})
    start = {p: float(getattr(hw, p)) for p in params}
    u0 = [_to_unit(bounds[p], start[p]) for p in params]
    cache: dict[tuple[float, ...], tuple[float, dict[str, float]]] = {}

    def objective(u: Sequence[float]) -> tuple[float, dict[str, float]]:
        key = tuple(round(x, 9) for x in u)
        if key not in cache:
            values = {p: _from_unit(bounds[p], x) for p, x in zip(params, u)}
            figs = evaluate_at(values)
            f = sum(weights.get(k, 1.0) * log_error(figs[k], v) ** 2 for k, v in targets.items())
            f += prior * sum((x - x0) ** 2 for x, x0 in zip(u, u0))
            cache[key] = (f, figs)
        return cache[key]

    u, best, best_figs, start_figs, step = _pattern_search(objective, u0, min_step, max_evaluations,
                                                           lambda: len(cache))
    values = {p: _from_unit(bounds[p], x) for p, x in zip(params, u)}
    at_bound = [p for p, x in zip(params, u) if x <= 1e-9 or x >= 1 - 1e-9]
    log.info("fit: %d evaluations, objective %.4g, values %s", len(cache), best, values)
    if step >= min_step:
        log.warning("fit: stopped after %d evaluations before converging (step %.3g)", len(cache), step)
    return FitResult(values, start, bounds, dict(targets), best_figs, start_figs, len(cache), best, at_bound,
                     dict(sources or {}), step < min_step)


def _pattern_search(objective: Callable[[Sequence[float]], tuple[float, dict[str, float]]], u0: Sequence[float],
                    min_step: float, max_evaluations: int,
                    evaluations: Callable[[], int]) -> tuple[list[float], float, dict[str, float], dict[str, float],
                                                             float]:
    """Bounded coordinate pattern search in unit coordinates from ``u0``: each coordinate tried one step up and
    down (clipped to [0, 1]), the first improving move taken, the step halved when none improves, until
    ``min_step`` or ``max_evaluations`` (``evaluations()``: distinct points costed so far).

    Returns ``(u, objective, figures at u, figures at u0, final step)``."""
    u = list(u0)
    best, best_figs = objective(u)
    start_figs = best_figs
    step = 0.25
    while step >= min_step and evaluations() < max_evaluations:
        improved = False
        for j in range(len(u)):
            for sign in (1.0, -1.0):
                trial = list(u)
                trial[j] = min(1.0, max(0.0, u[j] + sign * step))
                if trial[j] == u[j]:
                    continue
                f, figs = objective(trial)
                if f < best - 1e-12:
                    u, best, best_figs, improved = trial, f, figs, True
                    break
            if evaluations() >= max_evaluations:
                break
        if not improved:
            step /= 2
    return u, best, best_figs, start_figs, step


@dataclass
class HeldOut:
    """A published figure the fit did not use, the calibrated model's figure for it, and why they compare.

    ``measured`` is a value, or ``(low, high)`` when the source bounds the comparable quantity (a per-token
    figure that includes an unknown time outside the kernel); the error is then the distance to the interval."""

    figure: str  # the published figure's name (data file ``published.figures``) or a label
    modeled: float
    measured: float | tuple[float, float]
    unit: str
    source: str
    comparable: str  # why the modeled quantity is the measured one

    @property
    def error(self) -> float:
        return relative_error(self.modeled, self.measured)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["error"] = self.error
        return d


def held_out(result: FitResult, rows: Sequence[HeldOut]) -> list[HeldOut]:
    """``rows`` checked to be figures ``result`` did not fit (a ``ValueError`` names any it did)."""
    used = result.used()
    bad = [r.figure for r in rows if r.figure in used]
    if bad:
        raise ValueError(f"not held out: the fit used {', '.join(bad)}")
    return list(rows)


#: the published figure (data file) behind each O1 target
O1_SOURCES = {"wall": "megakernel_us_per_layer", "sync": "megakernel_sync_us_per_layer",
              "dma_active": "megakernel_dma_us_per_layer", "tensor": "megakernel_tensor_us_per_layer"}


def o1_targets() -> dict[str, float]:
    """The hand-written Qwen3-30B-A3B megakernel's measured per-layer figures on trn3 (perf_anchors.md §2.1 O1),
    in seconds: wall, Sync, DMA active, Tensor -- the figures a calibration on it fits (its CC time is not a
    function of any fittable parameter: reported, not fitted)."""
    from .params import published

    f = published()["figures"]
    return {"wall": f["megakernel_us_per_layer"].value * 1e-6, "sync": f["megakernel_sync_us_per_layer"].value * 1e-6,
            "dma_active": f["megakernel_dma_us_per_layer"].value * 1e-6,
            "tensor": f["megakernel_tensor_us_per_layer"].value * 1e-6}


def sensitivity(view: KernelView, hw: HardwareParams, params: Sequence[str] = FITTABLE,
                factors: Sequence[float] = (0.5, 1.5), layers: int | None = None,
                measure: Callable[[dict[str, float]], float] | None = None) -> list[dict[str, Any]]:
    """Per-layer figures of ``view`` with each parameter scaled by each factor in turn (clipped to [0, 1] for
    fractions); ``measure`` maps the figures to one number (default: the wall)."""
    measure = measure or (lambda f: f["wall"])
    rows = []
    for p in params:
        base = float(getattr(hw, p))
        for k in factors:
            v = base * k
            if BOUNDS.get(p) is not None and not BOUNDS[p].log_scale:
                v = min(max(v, BOUNDS[p].lo), BOUNDS[p].hi)
            figs = evaluate(view, hw, {p: v}, layers)
            rows.append({"parameter": p, "factor": k, "value": v, "figures_s": figs, "measure": measure(figs)})
    return rows
