"""The cost model's hardware parameters and the published figures, loaded from one sourced data file.

Why a data file: every number that turns counted work into time must be traceable to a public source
(``shared/reference/perf_anchors.md`` and the documents it cites), and must change only when a new source does.
Keeping them in ``data/trainium.json`` — never as literals in the code — makes that auditable: :func:`validate`
rejects a parameter without a unit, a value for each target, a source or a confidence tag, and a test runs it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any, Sequence

TARGETS = ("trn2", "trn3")
CONFIDENCE = ("H", "M", "L")
DATA_FILE = "trainium.json"
#: the low-confidence parameters a calibration may fit (issue 14 item 3): matmul initiation interval (with the
#: stationary load), per-instruction fixed cost, cross-engine semaphore, DMA fixed latency and its overlap,
#: efficiency by bytes per descriptor, hardware-DGE issue cost. Nothing else may be calibrated.
FITTABLE = ("pe_min_cycles", "engine_fixed_cycles", "semaphore_cross_engine", "dma_fixed_latency",
            "dma_latency_overlap", "dma_efficiency_s0", "dma_issue_hwdge")
#: ... and what a fit over several measured kernels may also change (issue 28): the latency of one ring step of a
#: collective. Not fitted to one kernel: the Qwen3 kernel's published CC figure is not a like quantity (it holds the
#: wait for the slowest rank), but every kernel's *wall* depends on it where a collective is on the critical path,
#: and only kernels at different group sizes (TP=4 and TP=8) can separate it from the per-instruction costs.
FITTABLE_JOINT = FITTABLE + ("cc_step_latency",)
#: the sourced parameter set (the default everywhere)
SOURCED = "sourced"


@dataclass(frozen=True)
class Param:
    name: str
    target: str
    value: Any
    unit: str
    source: str
    confidence: str
    note: str = ""


def _per_target(entry: Any, target: str) -> Any:
    return entry.get(target) if isinstance(entry, dict) else entry


@lru_cache(maxsize=None)
def raw_data() -> dict[str, Any]:
    """The parsed data file (cached; treat as read-only)."""
    text = resources.files("fusegraph.perf").joinpath("data").joinpath(DATA_FILE).read_text()
    return json.loads(text)


def validate(data: dict[str, Any] | None = None) -> list[str]:
    """Problems with the data file: a parameter or published figure missing a unit, value, source or confidence."""
    data = raw_data() if data is None else data
    problems: list[str] = []
    targets = data.get("targets") or list(TARGETS)
    for name, p in data.get("parameters", {}).items():
        if not isinstance(p, dict):
            problems.append(f"parameter {name}: not an object")
            continue
        if not str(p.get("unit", "")).strip():
            problems.append(f"parameter {name}: no unit")
        values = p.get("values")
        if not isinstance(values, dict):
            problems.append(f"parameter {name}: no per-target values")
            continue
        for t in targets:
            if t not in values:
                problems.append(f"parameter {name}: no value for {t}")
            src = _per_target(p.get("source"), t)
            if not isinstance(src, str) or len(src.strip()) < 10:
                problems.append(f"parameter {name}: no source for {t}")
            conf = _per_target(p.get("confidence"), t)
            if conf not in CONFIDENCE:
                problems.append(f"parameter {name}: confidence for {t} is {conf!r}, expected one of {CONFIDENCE}")
    for name, f in data.get("published", {}).get("figures", {}).items():
        if not isinstance(f, dict) or not isinstance(f.get("value"), (int, float)):
            problems.append(f"published figure {name}: no numeric value")
            continue
        if not str(f.get("unit", "")).strip():
            problems.append(f"published figure {name}: no unit")
        if not isinstance(f.get("source"), str) or len(f["source"].strip()) < 10:
            problems.append(f"published figure {name}: no source")
        if f.get("confidence") not in CONFIDENCE:
            problems.append(f"published figure {name}: bad confidence {f.get('confidence')!r}")
    params = data.get("parameters", {})
    for name, c in (data.get("calibrations") or {}).items():
        if not isinstance(c, dict):
            problems.append(f"calibration {name}: not an object")
            continue
        if c.get("target") not in targets:
            problems.append(f"calibration {name}: unknown target {c.get('target')!r}")
        for key in ("date", "kernel", "method", "source"):
            if not isinstance(c.get(key), str) or not c[key].strip():
                problems.append(f"calibration {name}: no {key}")
        if not isinstance(c.get("figures"), dict) or not c["figures"]:
            problems.append(f"calibration {name}: no fitted figures")
        values = c.get("values")
        if not isinstance(values, dict) or not values:
            problems.append(f"calibration {name}: no values")
            continue
        for k, v in values.items():
            if k not in FITTABLE_JOINT:
                problems.append(f"calibration {name}: {k} is not a low-confidence parameter a fit may change")
            elif k not in params:
                problems.append(f"calibration {name}: no parameter {k}")
            if not isinstance(v, (int, float)):
                problems.append(f"calibration {name}: {k} is not a number")
    return problems


class HardwareParams:
    """The parameters of one target; attribute access returns the value (``hw.dma_bandwidth_core``)."""

    def __init__(self, target: str, params: dict[str, Param], parameter_set: str = SOURCED) -> None:
        self.target = target
        self._params = params
        self.parameter_set = parameter_set

    def __getattr__(self, name: str) -> Any:
        params = self.__dict__.get("_params", {})
        if name in params:
            return params[name].value
        raise AttributeError(f"no cost-model parameter {name!r} for {self.__dict__.get('target')}")

    def param(self, name: str) -> Param:
        return self._params[name]

    def names(self) -> list[str]:
        return list(self._params)

    def what_if(self, reason: str, **values: Any) -> "HardwareParams":
        """A copy with some values replaced, each marked as a what-if (for sensitivity studies, never defaults)."""
        params = dict(self._params)
        for k, v in values.items():
            p = params[k]
            params[k] = Param(k, self.target, v, p.unit, f"what-if: {reason} (data file: {p.value})", "L", p.note)
        return HardwareParams(self.target, params, self.parameter_set)

    def table(self) -> list[dict[str, Any]]:
        """Rows for reports: name, value, unit, confidence, source."""
        return [{"name": p.name, "value": p.value, "unit": p.unit, "confidence": p.confidence, "source": p.source,
                 "note": p.note} for p in self._params.values()]


@lru_cache(maxsize=None)
def load_params(target: str, parameter_set: str = SOURCED) -> HardwareParams:
    """The parameters of ``target`` (``trn2`` or ``trn3``); raises if the data file does not validate.

    ``parameter_set``: ``"sourced"`` (the default: every value from its public source) or the name of a
    calibration in the data file (``calibrations``), whose fitted values replace the low-confidence ones, each
    with the calibration as its source. Why selectable and never the default: a fit to one kernel's profile is a
    measurement-derived source for a few parameters, not a vendor figure; reports say which set they use."""
    data = raw_data()
    if target not in data.get("targets", TARGETS):
        raise ValueError(f"unknown target {target!r}; the cost model knows {', '.join(data.get('targets', TARGETS))}")
    problems = validate(data)
    if problems:
        raise ValueError("cost-model data file is invalid: " + "; ".join(problems[:5]))
    params = {}
    for name, p in data["parameters"].items():
        params[name] = Param(name, target, p["values"][target], p["unit"], _per_target(p["source"], target),
                             _per_target(p["confidence"], target), p.get("note", ""))
    if parameter_set != SOURCED:
        cal = (data.get("calibrations") or {}).get(parameter_set)
        if cal is None:
            known = ", ".join([SOURCED, *sorted(data.get("calibrations") or {})])
            raise ValueError(f"unknown parameter set {parameter_set!r}; the data file has {known}")
        if cal["target"] != target:
            raise ValueError(f"calibration {parameter_set!r} is for {cal['target']}, not {target}")
        for name, v in cal["values"].items():
            p = params[name]
            params[name] = Param(name, target, v, p.unit,
                                 f"calibration {parameter_set} ({cal['date']}): {cal['source']}; sourced value "
                                 f"{p.value} ({p.source})", "M", p.note)
    return HardwareParams(target, params, parameter_set)


class ParameterSetError(ValueError):
    """An unknown parameter set, or one without values for a requested target."""


def parameter_set_targets(parameter_set: str) -> tuple[str, ...]:
    """The targets ``parameter_set`` has values for: every target for ``"sourced"``, the calibration's own target
    for a calibration (a fit to one chip's profile says nothing about another chip); raises
    :class:`ParameterSetError` naming the known sets for an unknown name."""
    if parameter_set == SOURCED:
        return tuple(raw_data().get("targets", TARGETS))
    cal = (raw_data().get("calibrations") or {}).get(parameter_set)
    if cal is None:
        known = ", ".join([SOURCED, *sorted(raw_data().get("calibrations") or {})])
        raise ParameterSetError(f"unknown parameter set {parameter_set!r}; the data file has {known}")
    return (cal["target"],)


def check_parameter_set(parameter_set: str, targets: Sequence[str]) -> None:
    """Raise :class:`ParameterSetError` (one line, what to choose instead) unless ``parameter_set`` has values for
    every one of ``targets``. Why: commands that take ``--parameters`` check before any work, so a mismatch is one
    clear message instead of a failure half-way through a benchmark."""
    covered = parameter_set_targets(parameter_set)
    bad = [t for t in targets if t not in covered]
    if bad:
        raise ParameterSetError(f"parameter set {parameter_set!r} has values for {', '.join(covered)} only, not "
                                f"{', '.join(bad)}; choose --parameters {SOURCED} or a target it covers")


def calibrations(target: str | None = None) -> dict[str, dict[str, Any]]:
    """The calibrated parameter sets of the data file (of ``target`` when given), by name."""
    cals = raw_data().get("calibrations") or {}
    return {k: v for k, v in cals.items() if target is None or v.get("target") == target}


@dataclass(frozen=True)
class Figure:
    name: str
    value: float
    unit: str
    source: str
    confidence: str


def published() -> dict[str, Any]:
    """The published configuration (model, target, tp, lnc, ...) with ``figures`` as :class:`Figure` objects."""
    pub = dict(raw_data()["published"])
    pub["figures"] = {k: Figure(k, float(v["value"]), v["unit"], v["source"], v["confidence"])
                      for k, v in pub["figures"].items()}
    return pub
