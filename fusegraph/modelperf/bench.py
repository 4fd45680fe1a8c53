"""The performance benchmark: models x targets through the cost model, as rows, tables and JSON.

Shared by ``benchmarks/bench_perf.py`` and ``fusegraph bench`` (the library formats, the callers print).
Every modeled figure that has a published counterpart is shown beside it with the error; the others say so.
A row is modeled only from a kernel the pipeline builds; where the pipeline refuses (the kernel does not fit
SBUF at that cache length, a codegen or capture error), the row says ``not run: <reason>`` and the other rows go
on.
"""
from __future__ import annotations

import platform
import time
from typing import Any, Sequence

from ..perf.measured import band_note
from ..perf.params import SOURCED
from ..perf.progress import Progress
from .analysis import ModelPerf, NotRun, analyze_model
from .html import write_perf

DEFAULT_MODELS = ("qwen3-30b-a3b", "llama3-8b")
DEFAULT_TARGETS = ("trn2", "trn3")
STRATEGY_ORDER = ("per_op", "xla_nki_moe", "hybrid", "megakernel")
SHORT = {"per_op": "(a) per-op", "xla_nki_moe": "(b') XLA+NKI MoE", "hybrid": "(b) hybrid", "megakernel": "(c) megakernel"}


def row_of(perf: ModelPerf) -> dict[str, Any]:
    """One benchmark row (one model on one target, one core, whole model)."""
    d = perf.to_dict(top_lines=10)
    k = d["kernel"]
    s = d["strategies"]
    t = d["timings"]
    row: dict[str, Any] = {
        "model": d["model"], "target": d["target"], "layers": d["layers"], "status": "run",
        "capture_s": t.get("capture_s"), "match_s": t.get("match_s"), "codegen_s": t.get("codegen_s"),
        "profile_s": t.get("profile_s"), "cost_model_s": t.get("cost_model_s"),
        "hbm_gb_per_token": k["hbm_read_bytes"] / 1e9, "min_gb_per_token": d["limit"]["total_bytes"] / 1e9,
        "hbm_vs_min": d["hbm_bytes_vs_minimum"], "dma_count": k["dma_count"],
        "mean_bytes_per_partition": k["mean_bytes_per_partition"],
        "sbuf_peak_kib": k["sbuf_peak_bytes_per_partition"] / 1024,
        "sbuf_kib": k["sbuf_bytes_per_partition"] / 1024,
        "limit_chip_ms": d["limit"]["seconds_per_token"] * 1e3,
        "limit_core_ms": d["limit"]["one_core_seconds_per_token"] * 1e3,
    }
    for key in STRATEGY_ORDER:
        if key in s:
            row[f"{key}_ms"] = s[key]["seconds_per_token"] * 1e3
            row[f"{key}_us_layer"] = s[key]["seconds_per_layer"] * 1e6
            row[f"{key}_launches"] = s[key]["launches_per_step"]
            row[f"{key}_bound"] = s[key]["bound"]
    mk = row.get("megakernel_ms")
    for key in ("per_op", "xla_nki_moe", "hybrid"):
        if mk and row.get(f"{key}_ms"):
            row[f"speedup_vs_{key}"] = row[f"{key}_ms"] / mk
    row["megakernel_vs_core_limit"] = row["limit_core_ms"] / mk if mk else None
    row["notes"] = d["notes"]
    row["generic_by_cost"] = d.get("generic_by_cost", [])
    return row


def not_run_row(nr: NotRun) -> dict[str, Any]:
    """The row of a model/target the pipeline builds no kernel for: the one-line reason, no figures."""
    return {**nr.to_dict(), "layers": nr.config.get("num_hidden_layers")}


def _lfl_entry(model: str, target: str, l: dict[str, Any]) -> dict[str, Any]:
    if l.get("status") == "not run":
        return {"model": model, "target": target, **l}
    return {"model": model, "target": target, **{k: l[k] for k in (
        "cores", "tp", "lnc", "shard_overrides", "status", "timings", "kernel", "strategies", "calibration", "goal",
        "what_if", "sensitivity")}, "top_lines": l["megakernel"]["top_lines"], "regions": l["megakernel"]["regions"],
        "layers_detail": l["megakernel"]["layers"]}


def run(models: Sequence[str] = DEFAULT_MODELS, targets: Sequence[str] = DEFAULT_TARGETS, *, layers: int | None = None,
        cache_len: int = 640, per_op: bool = True, progress: Progress | None = None,
        keep: bool = False, parameter_set: str = SOURCED) -> dict[str, Any]:
    """Analyze every model on every target with the cost model's ``parameter_set`` (``"sourced"`` or a calibration
    of the data file); returns the JSON-ready result (``keep``: also the ModelPerf objects under ``"_perf"``, for
    the HTML report). Rows the pipeline refuses are ``status: not run`` with the reason."""
    progress = progress or Progress(None)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    lfl: list[dict[str, Any]] = []
    details: dict[str, Any] = {}
    kept: dict[str, ModelPerf] = {}
    for i, model in enumerate(models):
        progress.note(f"model {i + 1}/{len(models)}: {model} on {', '.join(targets)}")
        perfs = analyze_model(model, targets, layers=layers, cache_len=cache_len, per_op=per_op, progress=progress,
                              parameter_set=parameter_set)
        for target, perf in perfs.items():
            if isinstance(perf, NotRun):
                rows.append(not_run_row(perf))
                if perf.like_for_like:
                    lfl.append(_lfl_entry(model, target, perf.like_for_like))
                continue
            rows.append(row_of(perf))
            d = perf.to_dict(top_lines=15)
            details[f"{model}@{target}"] = {k: d[k] for k in ("strategies", "limit", "kernel", "speedup", "timings",
                                                              "notes")} | {"top_lines": d["megakernel"]["top_lines"],
                                                                           "layers_detail": d["megakernel"]["layers"]}
            if d["like_for_like"]:
                lfl.append(_lfl_entry(model, target, d["like_for_like"]))
            if keep:
                kept[f"{model}@{target}"] = perf
    out = {"benchmark": "perf", "models": list(models), "targets": list(targets), "cache_len": cache_len,
           "layers": layers, "parameter_set": parameter_set, "host": platform.node(), "python": platform.python_version(),
           "seconds": time.perf_counter() - t0, "rows": rows, "like_for_like": lfl, "details": details}
    if keep:
        out["_perf"] = kept
    return out


# ---- text ---------------------------------------------------------------------------------------------------------
def _f(v: Any, fmt: str = "{:.3g}") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return fmt.format(v)
    return str(v)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widths; a row shorter than the header ends in one cell that spans the rest (a
    ``not run: <reason>`` row) and does not widen the columns."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    full = [r for r in cells if len(r) == len(headers)]
    widths = [max(len(r[i]) for r in full + [r for r in cells if len(r) > i + 1]) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cells[0], widths)), "  ".join("-" * w for w in widths)]
    for r in cells[1:]:
        if len(r) == len(headers):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        else:
            lines.append("  ".join([c.ljust(w) for c, w in zip(r[:-1], widths)] + [r[-1]]))
    return "\n".join(lines)


def _not_run_cell(r: dict[str, Any]) -> str:
    return f'not run: {r["reason"]}'


def format_tables(result: dict[str, Any]) -> str:
    """The benchmark's text output: whole-model table, like-for-like calibration table, goal lines."""
    out = []
    ps = f'[cost-model parameters: {result.get("parameter_set", SOURCED)}]'
    out.append("Whole model on ONE core: what fusegraph emits today (no published figure corresponds: the "
               f"published runs use 8 cores; see the like-for-like table) {ps}")
    hdr = ["model", "target", "capture s", "match s", "codegen s", "profile s", "launches a/b'/b/c",
           "HBM GB/token (min)", "DMAs", "mean B/partition", "SBUF peak/size KiB"]
    rows = []
    for r in result["rows"]:
        if r.get("status") == "not run":
            rows.append([r["model"], r["target"], _not_run_cell(r)])
            continue
        launches = "/".join(_f(r.get(f"{k}_launches")) for k in STRATEGY_ORDER)
        shared = "shared" if r["capture_s"] is None else None
        rows.append([r["model"], r["target"], shared or _f(r["capture_s"], "{:.1f}"),
                     shared or _f(r["match_s"], "{:.1f}"),
                     _f(r["codegen_s"], "{:.1f}"), _f(r["profile_s"], "{:.1f}"), launches,
                     f'{r["hbm_gb_per_token"]:.2f} ({r["min_gb_per_token"]:.2f})', r["dma_count"],
                     f'{r["mean_bytes_per_partition"]:,.0f}', f'{r["sbuf_peak_kib"]:.0f}/{r["sbuf_kib"]:.0f}'])
    out.append(_table(hdr, rows))
    out.append("")
    out.append(f"Modeled time per decode step, one core, by strategy {ps}")
    hdr = ["model", "target", "(a) per-op ms", "(b') XLA+NKI MoE ms", "(b) hybrid ms", "(c) megakernel ms",
           "(c) us/layer", "(c) bound", "limit ms: core DMA / chip HBM", "(c) speedup over a / b", "published"]
    rows = []
    for r in result["rows"]:
        if r.get("status") == "not run":
            rows.append([r["model"], r["target"], _not_run_cell(r)])
            continue
        rows.append([r["model"], r["target"], _f(r.get("per_op_ms"), "{:.2f}"), _f(r.get("xla_nki_moe_ms"), "{:.2f}"),
                     _f(r.get("hybrid_ms"), "{:.2f}"), _f(r.get("megakernel_ms"), "{:.2f}"),
                     _f(r.get("megakernel_us_layer"), "{:.1f}"), r.get("megakernel_bound", "-"),
                     f'{r["limit_core_ms"]:.2f} / {r["limit_chip_ms"]:.2f}',
                     f'{_f(r.get("speedup_vs_per_op"), "{:.2f}")}x / {_f(r.get("speedup_vs_hybrid"), "{:.2f}")}x',
                     "none (1 core)"])
    out.append(_table(hdr, rows))
    generic = [r for r in result["rows"] if r.get("generic_by_cost")]
    if generic:
        out.append("")
        out.append("Ops in the megakernel through generic lowering (no pattern), by modeled time they expose: the next "
                   "patterns to write")
        for r in generic:
            out.append(f'  {r["model"]} {r["target"]}: ' + "; ".join(
                f'{g["region"]} ({g["op"]}) {g["ms"]:.3f} ms ({g["share"] * 100:.1f}%)' for g in r["generic_by_cost"]))
    for l in result["like_for_like"]:
        out.append("")
        out.append(f'Like for like: {l["model"]} on {l["target"]}, one core\'s shard of TP={l["tp"]} x LNC={l["lnc"]} '
                   f'({l["cores"]} physical cores), per layer and per core {ps}')
        if l.get("status") == "not run":
            out.append(_not_run_cell(l))
            continue
        crow = []
        for c in l["calibration"]:
            err = c.get("error")
            crow.append([c["quantity"], c["strategy"], f'{c["modeled"]:,.2f} {c["unit"]}',
                         f'{c["published"]:,.2f} {c["unit"]}' if c.get("published") is not None else "-",
                         f"{err * 100:+.0f}%" if err is not None else "-", c["note"].split(";")[0]])
        out.append(_table(["quantity", "strategy", "modeled", "published", "error", "comparison"], crow))
        g = l["goal"]
        verdict = "MET" if g["met_with_cc"] else ("met without CC, missed with it" if g["met"] else "MISSED")
        margin = g["target_us_per_layer"] / g["modeled_us_per_layer_with_cc"] - 1
        out.append(f'goal: megakernel per layer {g["modeled_us_per_layer"]:.1f} us (+ measured AllReduce '
                   f'{g["modeled_us_per_layer_with_cc"]:.1f} us) vs hand-written {g["target_us_per_layer"]:.2f} us '
                   f'-> {verdict} (MODELED, margin {margin:+.0%}; weigh it against the model error at the end and the '
                   f'published-figure errors of this table)')
        out.append(f'distance to the physical limit (chip HBM): {g["distance_to_limit_ms_per_token"]:.3f} ms/token '
                   f'({g["modeled_ms_per_token"]:.3f} vs {g["limit_ms_per_token"]:.3f} ms, '
                   f'{g["fraction_of_limit"] * 100:.0f}% of the limit\'s speed); per layer '
                   f'{g["distance_to_limit_us_per_layer"]:.1f} us ({g["layer_fraction_of_limit"] * 100:.0f}%)')
        for w in l.get("what_if") or []:
            out.append(f'what-if (not a calibration): {w["what_if"]} (x{w["factor"]:.2f}) -> '
                       f'{w["seconds_per_layer"] * 1e6:.1f} us/layer, {w["bound"]}-bound '
                       f'({"still meets" if w["met"] else "misses"} {g["target_us_per_layer"]:.2f} us)')
        sens = l.get("sensitivity") or []
        if sens:
            parts = [f'{r["parameter"]}={r["value"]:.3g}: {r["seconds_per_layer"] * 1e6:.1f}' for r in sens]
            out.append("sensitivity of (c) us/layer to the sourced parameter ranges: " + "; ".join(parts))
    out.append("")
    out.append(band_note(result.get("parameter_set", SOURCED)))
    return "\n".join(out)


def run_and_write(models: list[str], targets: list[str], *, layers: int | None = None, cache_len: int = 640,
                  per_op: bool = True, json_path: str | None = None, html_dir: str | None = None,
                  parameter_set: str = SOURCED, progress: Progress | None = None) -> dict:
    """Run the benchmark with the cost model's ``parameter_set``, print its tables (each names the set), write the
    JSON and (optionally) one HTML report per model/target."""
    import json
    import os

    result = run(models, targets, layers=layers, cache_len=cache_len, per_op=per_op, keep=bool(html_dir),
                 parameter_set=parameter_set, progress=progress)
    perfs = result.pop("_perf", {})
    if progress is not None:
        progress.finish()
    print(format_tables(result))
    if json_path:
        os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"wrote {json_path}")
    if html_dir:
        os.makedirs(html_dir, exist_ok=True)
        for key, perf in perfs.items():
            path = os.path.join(html_dir, f"perf-{key.replace('@', '-')}.html")
            write_perf(path, perf)
            print(f"wrote {path}")
    return result
