"""``fusegraph bench --against``: a third-party kernel beside the kernel the pipeline builds for the same model.

Loading, running and costing the third-party kernel is the cost model's (:mod:`fusegraph.perf.against`);
fusegraph's side is built through :mod:`fusegraph.api`, so the comparison sits above the API.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Sequence

from ..perf.against import (Side, collective_figures, compare, cost_spec, format_comparison, line_figures,
                            load_spec, per_layer_figures)
from ..perf.analysis import model_config, shard_overrides
from ..perf.costmodel import estimate_kernel
from ..perf.params import SOURCED, check_parameter_set, load_params
from .analysis import NotRun, build_kernel

log = logging.getLogger(__name__)


def cost_generated(model: str, target: str, *, layers: int | None, cache_len: int, shard: tuple[int, int] | None,
                   regions: Sequence[str] | None = None, progress: Any = None,
                   parameter_set: str = SOURCED) -> Side | str:
    """fusegraph's kernel for ``model`` (one core's shard of ``shard`` = (tp, lnc) when given), costed with the
    cost model's ``parameter_set``; a string with the reason where the pipeline builds none."""
    overrides = None
    label = f"fusegraph {model}"
    if shard:
        cores = shard[0] * shard[1]
        try:
            config = model_config(model)
        except KeyError as e:  # a spec naming a model fusegraph does not bundle: their side alone
            return f"not run: {e.args[0] if e.args else e}"
        overrides = shard_overrides(config, cores)
        label += f" (one core of TP={shard[0]} x LNC={shard[1]})"
    b = build_kernel(model, target, layers=layers, cache_len=cache_len, overrides=overrides, progress=progress)
    if isinstance(b, NotRun):
        return f"not run: {b.reason}"
    hw = load_params(target, parameter_set)
    est = estimate_kernel(b.view, hw, label=label)
    n_layers = len(b.generated.program.layers())
    per, attributed = per_layer_figures(est, n_layers, regions)
    files = [b.view.filename] * len(b.view.lines)
    return Side(label, est, n_layers, attributed, per, collective_figures(est, n_layers),
                line_figures(est, files, [ln.line for ln in b.view.lines]),
                {"instructions": b.profile.get("instructions", 0), "hbm_read_bytes": b.profile.get("hbm_read_bytes", 0),
                 "regions": list(regions) if regions else None, "cache_len": cache_len,
                 "parameter_set": hw.parameter_set})


def run_against(ref: str, args_ref: str | None = None, *, models: Sequence[str] | None = None,
                targets: Sequence[str] | None = None, layers: int | None = None, cache_len: int = 640,
                paths: Sequence[str] = (), json_path: str | None = None, progress: Any = None,
                parameter_set: str = SOURCED) -> list[dict[str, Any]]:
    """Cost the spec's kernel and fusegraph's kernel of each model/target with the same cost-model
    ``parameter_set``; print the tables (each names the set), write the JSON."""
    spec = load_spec(ref, args_ref, layers=layers, paths=paths)
    models = list(models or ([spec.model] if spec.model else []))
    targets = list(targets or [spec.target])
    check_parameter_set(parameter_set, sorted({spec.target, *targets}))  # before any costing
    theirs = cost_spec(spec, parameter_set=parameter_set)
    results = []
    for model in models or [None]:
        for target in targets:
            if target != spec.target:
                log.warning("the spec runs its kernel on %s; fusegraph's side is built for %s", spec.target, target)
            ours: Side | str = "no fusegraph model given (--models or the spec's model)"
            if model:
                ours = cost_generated(model, target, layers=layers, cache_len=spec.cache_len or cache_len,
                                      shard=spec.shard, regions=spec.generated_regions, progress=progress,
                                      parameter_set=parameter_set)
            res = {"model": model, "target": target, "parameter_set": parameter_set, "shard": spec.shard,
                   "layer_var": spec.layer_var,
                   "notes": spec.notes, "theirs": theirs.to_dict(),
                   "fusegraph": ours.to_dict() if isinstance(ours, Side) else ours,
                   "comparison": compare(ours, theirs)}
            print(format_comparison(res))
            print()
            results.append(res)
    if json_path:
        os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
        with open(json_path, "w") as f:
            json.dump({"against": spec.name, "parameter_set": parameter_set, "results": results}, f, indent=1,
                  default=str)
        print(f"wrote {json_path}")
    return results
