"""Cross-validate the cost model on every measured kernel available here (issue 28 items 2 and 4).

Why above the perf package: it runs third-party kernels from the user's checkouts and prints a report; the fit
and the rounds are :mod:`fusegraph.perf.crossval`'s, the kernels and their measured figures
:mod:`fusegraph.perf.measured`'s. One run: every kernel traced once; the sourced parameters, the recorded
single-kernel calibration, a joint fit over all kernels and one leave-one-out round per kernel, each kernel's
figures under each; the band (largest left-out error) is what a modeled time is quoted with.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Sequence

from ..perf.crossval import MeasuredKernel, band, fit_joint, leave_one_out, split
from ..perf.fit import nearest
from ..perf.measured import available
from ..perf.params import FITTABLE_JOINT, calibrations, load_params
from .calibrate import text_table

log = logging.getLogger(__name__)

TARGET = "trn3"
RECORDED = "o1_hand_megakernel"


def run(layers: int | None = None, params: Sequence[str] = FITTABLE_JOINT, max_evaluations: int = 1500,
        kernels: Sequence[MeasuredKernel] | None = None) -> dict[str, Any]:
    """Everything ``benchmarks/bench_crossval.py`` prints (see the module docstring)."""
    t0 = time.perf_counter()
    missing: dict[str, str] = {}
    if kernels is None:
        kernels, missing = available(layers)
    timings = {"trace_s": time.perf_counter() - t0}
    if len(kernels) < 2:
        raise RuntimeError("cross-validation needs two measured kernels or more; available: "
                           f"{[k.name for k in kernels]}; missing: {missing}")
    sourced = load_params(TARGET)
    sets = {"sourced": sourced}
    if RECORDED in calibrations(TARGET):
        sets[RECORDED] = load_params(TARGET, RECORDED)
    t0 = time.perf_counter()
    joint = fit_joint(kernels, sourced, params=params, max_evaluations=max_evaluations)
    timings["joint_fit_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    rounds = leave_one_out(kernels, sourced, params=params, max_evaluations=max_evaluations)
    timings["leave_one_out_s"] = time.perf_counter() - t0
    fits = {k.family: r.fit for k, r in zip(kernels, rounds)}
    per_kernel = {}
    for k in kernels:
        rnd = next(r for r in rounds if r.kernel == k.name)
        under = {name: rnd.sourced if name == "sourced" else k.modeled(hw) for name, hw in sets.items()}
        under["joint fit"] = split(joint, k.name)
        under["left out"] = rnd.modeled
        per_kernel[k.name] = {"measured_s": dict(k.targets), "sources": dict(k.sources), "layers": k.layers,
                              "modeled_s": under,
                              "errors": {name: k.errors(m) for name, m in under.items()}}
    figures = sorted({f for k in kernels for f in k.targets})
    return {
        "target": TARGET, "kernels": [k.name for k in kernels], "missing": missing,
        "parameters": {"sourced": {p: float(getattr(sourced, p)) for p in params},
                       **({RECORDED: {p: float(getattr(sets[RECORDED], p)) for p in params}} if RECORDED in sets
                          else {}),
                       "joint fit": joint.values, **{f"without {g}": f.values for g, f in fits.items()}},
        "at_bound": {"joint fit": joint.at_bound, **{f"without {g}": f.at_bound for g, f in fits.items()}},
        "groups": {k.name: k.family for k in kernels},
        "bounds": {p: (joint.bounds[p].lo, joint.bounds[p].hi) for p in params},
        "joint": joint.to_dict(), "rounds": [r.to_dict() for r in rounds], "per_kernel": per_kernel,
        "band": {f: band(rounds, f) for f in figures},
        "timings": timings,
    }


def _us(v: Any) -> str:
    if isinstance(v, (tuple, list)):
        return f"<= {v[1] * 1e6:,.1f}" if v[0] == 0 else f"{v[0] * 1e6:,.1f}..{v[1] * 1e6:,.1f}"
    return f"{v * 1e6:,.2f}"


def format_report(r: Mapping[str, Any]) -> str:
    """The text tables of :func:`run`."""
    lines = [f"Cost model cross-validation on {len(r['kernels'])} measured kernels ({r['target']}; MODELED against "
             f"MEASURED per decoder layer of one core, us)"]
    for name, why in r["missing"].items():
        lines.append(f"  not here: {name}: {why}")
    for name, k in r["per_kernel"].items():
        lines.append("")
        lines.append(f"{name} ({k['layers']} layers traced)")
        sets = list(k["modeled_s"])
        rows = [["figure", "measured"] + [f"{s}" for s in sets]]
        for f, m in k["measured_s"].items():
            row = [f, _us(m)]
            for s in sets:
                v = k["modeled_s"][s][f]
                e = k["errors"][s][f]
                row.append(f"{_us(v)} ({e:+.0%})" if nearest(v, m) != v or not isinstance(m, (tuple, list))
                           else f"{_us(v)} (ok)")
            rows.append(row)
        lines += text_table(rows)
    lines.append("")
    lines.append("Parameters (the fit moves only these low-confidence ones; '*' at a bound of its physical range)")
    ps = r["parameters"]
    cols = list(ps)
    rows = [["parameter", "range"] + cols]
    for p, (lo, hi) in r["bounds"].items():
        rows.append([p, f"{lo:.3g}..{hi:.3g}"] + [f"{ps[c][p]:.4g}" + ("*" if p in r["at_bound"].get(c, ()) else "")
                                                   for c in cols])
    lines += text_table(rows)
    lines.append("")
    lines.append("Band (largest error of a figure on a kernel left out of the fit): "
                 + ", ".join(f"{f} {b:.0%}" for f, b in r["band"].items() if b is not None))
    return "\n".join(lines)


