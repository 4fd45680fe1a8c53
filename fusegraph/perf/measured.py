"""The kernels measured on Trainium that the cost model is fitted to and cross-validated on.

Why a registry: every speed claim of fusegraph is modeled, and a model is worth what its error on kernels it was
not fitted to says (:mod:`fusegraph.perf.crossval`). Each entry pairs a public kernel the interpreter runs
unmodified (a spec in :mod:`fusegraph.perf.against_specs` / :mod:`~fusegraph.perf.against_specs_gpt_oss`, read from
the user's checkout) with the figures its author measured on hardware, per decoder layer of one core:

* ``qwen3-30b-a3b O1`` -- the hand-written Qwen3-30B-A3B megakernel (TP=4 x LNC=2), its README's Neuron Explorer
  per-layer wall / Sync / DMA active / Tensor (perf_anchors.md §2.1 O1; the data file's published figures);
* the hand-written GPT-OSS-20B megakernel's profiles (TP=8 x LNC=1): figures and sources in
  ``data/measured_kernels.json`` (points where the profile gives the like quantity, upper bounds where a
  whole-profile figure also holds the LM head and sampling).

A kernel whose checkout is not set up is skipped with its reason (:func:`available`), never faked.
"""
from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .crossval import MeasuredKernel
from .fit import O1_SOURCES, Measured, o1_targets

log = logging.getLogger(__name__)

US = 1e-6
DATA = os.path.join(os.path.dirname(__file__), "data", "measured_kernels.json")


@dataclass(frozen=True)
class Entry:
    """One measured kernel: how to run it and what was measured (seconds per layer)."""

    name: str
    spec: str  # "module:factory" of a KernelSpec factory f(layers=..., **spec_kwargs)
    targets: Mapping[str, Measured]
    sources: Mapping[str, str]
    spec_kwargs: Mapping[str, Any] = field(default_factory=dict)
    layers: int = 4  # layers traced for the fit (per-layer figures barely move with the count: the fit re-costs it)
    about: str = ""
    deployment: Mapping[str, Any] = field(default_factory=dict)  # see crossval.MeasuredKernel.deployment
    group: str = ""  # profiles of one kernel's variants: left out together (crossval.leave_one_out)


def _figure(d: Mapping[str, Any]) -> Measured:
    if "value" in d:
        return float(d["value"]) * US
    return (0.0, float(d["upper"]) * US)


@functools.lru_cache(maxsize=1)
def _data() -> dict[str, Any]:
    with open(DATA) as f:
        return json.load(f)


def entries() -> list[Entry]:
    """Every measured kernel the project knows (whether or not its checkout is here)."""
    out = [Entry("qwen3-30b-a3b O1", "fusegraph.perf.against_specs:qwen3_megakernel", o1_targets(), dict(O1_SOURCES),
                 about="hand-written Qwen3-30B-A3B megakernel, TP=4 x LNC=2, trn3, 640 positions (perf_anchors.md O1)")]
    for name, k in _data()["kernels"].items():
        figs = k["figures"]
        out.append(Entry(name, k["spec"], {f: _figure(d) for f, d in figs.items()},
                         {f: f"{d['source']}; {d.get('derived', 'measured')}" for f, d in figs.items()},
                         dict(k.get("spec_kwargs", {})), about=f"{k['repository']} @{k['kernel_tree']}; {k['deployment']}",
                         layers=int(k.get("layers_traced", 4)),
                         deployment={p: d["value"] for p, d in k.get("deployment_params", {}).items()},
                         group=k.get("group", "")))
    return out


def load(entry: Entry, layers: int | None = None) -> MeasuredKernel:
    """Run ``entry``'s kernel shape-only in the interpreter (traced, program 0 of rank 0) and return it as a
    :class:`~fusegraph.perf.crossval.MeasuredKernel`. Raises ``RuntimeError`` naming the missing checkout."""
    from fusegraph import nkisim

    from .against import resolve, run_spec
    from .kernelview import view_from_trace

    n = layers or entry.layers
    with nkisim.as_nki():
        factory: Callable[..., Any] = resolve(entry.spec, ())
        spec = factory(layers=n, **entry.spec_kwargs)
    prof = run_spec(spec)
    view = view_from_trace(prof.trace[(0, 0)], filename=spec.name)
    return MeasuredKernel(entry.name, view, dict(entry.targets), dict(entry.sources), layers=n,
                          deployment=dict(entry.deployment), group=entry.group)


def available(layers: int | None = None) -> tuple[list[MeasuredKernel], dict[str, str]]:
    """The measured kernels whose checkouts are set up here, and the one-line reason for each that is not."""
    got, missing = [], {}
    for e in entries():
        try:
            got.append(load(e, layers))
        except (RuntimeError, ImportError, TypeError, ValueError) as err:
            log.info("measured kernel %s not loaded: %s", e.name, err)
            missing[e.name] = str(err).splitlines()[0]
    return got, missing


def validation() -> dict[str, Any]:
    """The recorded cross-validation (``bench_crossval.py``'s result at a commit): the largest per-layer errors of
    each parameter set over the measured kernels."""
    return dict(_data().get("validation", {}))


def band_note(parameter_set: str, target: str | None = None) -> str:
    """One line quoted with every modeled time: how far this parameter set's per-layer figures were from the
    measured kernels (largest error), and the cross-validated fit's error on kernels left out of it. Why: a modeled
    time is worth the error the model makes on kernels it was not fitted to (issue 28)."""
    v = validation()
    walls = v.get("wall_error_max", {})
    if not walls:
        return "model error: not cross-validated"
    n = len(v.get("kernels", ()))
    own = walls.get(parameter_set)
    held = walls.get("left out")
    fitted = "fitted to none of them" if parameter_set == "sourced" else "fitted to some of them"
    mine = (f"this set ({parameter_set}, {fitted}) within {own:.0%} per layer" if own is not None
            else f"this set ({parameter_set}) not cross-validated")
    other = (f"; no measured kernel on {target}: the {v.get('target')} error is all there is"
             if target and target != v.get("target") else "")
    return (f"model error on {n} measured hand-written kernels ({v.get('target')}, {v.get('date')}): {mine}; "
            f"a fit within {held:.0%} on kernels left out of it (per engine up to "
            f"{v.get('engine_error_max', {}).get(parameter_set, float('nan')):.0%}){other}; MODELED, not measured")
