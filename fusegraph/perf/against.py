"""``fusegraph bench --against``: a third-party NKI kernel through the same interpreter and cost model as the
generated one, side by side per layer and per engine.

The published comparison kernels (the hand-written Qwen3-30B-A3B megakernel, nki-library's TKG kernels) are not
part of the project; a *spec* says how to call one shape-only: the kernel, its arguments (``nkisim.Abstract``
shapes), launch grid, target, and optionally which Python variable of the kernel is the layer loop index
(``layer_var="function:variable"``) and which fusegraph regions it corresponds to.  The kernel runs in
``fusegraph.nkisim`` with the per-instruction trace on; program 0 of rank 0 (one physical core) is costed by
:mod:`fusegraph.perf.costmodel` exactly as a generated kernel is -- the same per-instruction costs and the same
list scheduler, with dependencies from the tensors each instruction actually read and wrote
(:func:`kernelview.view_from_trace`), so a kernel split across files and helper functions is attributed line by
line in every file.  fusegraph's own kernel for the same model (one core's shard when the spec says the kernel is
one rank of a tensor-parallel deployment) is built by the pipeline and costed beside it
(:mod:`fusegraph.modelperf.against`: the build captures, so it sits above the API).

Why per layer: the published figures are per layer (wall, Sync engine, DMA active, Tensor engine, CC); with a
``layer_var`` every instruction is attributed to its layer, otherwise the whole kernel is divided by the layers
it runs (reported as such).
"""
from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import inspect
import logging
import os
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .costmodel import Estimate, collectives_report, estimate_kernel
from .kernelview import view_from_trace
from .params import SOURCED, load_params

log = logging.getLogger(__name__)

#: nki.collectives operations (costed as ring collectives on the collective engine: costmodel.collective_time)
COLLECTIVE_OPS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_v",
                            "collective_permute", "collective_permute_implicit"})
#: the per-engine rows of the comparison (key in a Breakdown's ``busy``, label)
#: "DMA active" is what a hardware profile calls it -- time with any DMA in flight (the union of the DMAs' windows
#: from trigger to last byte, ``Schedule.dma_active``); the bandwidth occupancy (bytes / the core's DMA bandwidth at
#: the transfer's efficiency, ``busy["dma"]``) is another quantity and has its own row
ENGINE_ROWS = (("sync", "Sync (DMA issue)"), ("dma_active", "DMA active (any DMA in flight)"),
               ("dma_occupancy", "DMA bandwidth occupancy"), ("tensor", "Tensor"), ("vector", "Vector"),
               ("scalar", "Scalar"), ("gpsimd", "GpSimd"))
_LAYER_PREFIX = re.compile(r"^L\d+\.")


@dataclass
class KernelSpec:
    """How to run a third-party kernel shape-only (what a spec file or factory returns)."""

    kernel: Any  # an @nki.jit kernel, a plain kernel function, or "module:attr" resolved inside as_nki()
    args: Sequence[Any] = ()  # positional arguments (nkisim.Abstract shapes, or arrays whose contents are ignored)
    kwargs: dict[str, Any] = field(default_factory=dict)
    lnc: int = 1
    target: str = "trn3"
    layers: int = 1  # decoder layers (or layer parts) the kernel runs
    layer_var: str | None = None  # "function:variable" holding the layer index while a layer runs
    shard: tuple[int, int] | None = None  # (tp, lnc): the kernel is one rank of TP x LNC (compare per core)
    model: str | None = None  # the bundled fusegraph model it implements (default for --models)
    cache_len: int | None = None  # KV positions the spec's arguments use (the generated side uses the same)
    generated_regions: Sequence[str] | None = None  # fnmatch patterns of fusegraph regions it covers (no "L<i>.")
    assume: Any = None  # nkisim shape-only assumptions for data-dependent indices
    sys_path: Sequence[str] = ()  # directories to import the kernel from
    nki_api: str = "0.3.0"  # the NKI semantics it is run under (fusegraph.nkisim.apiversion)
    name: str = ""
    notes: str = ""


# ---- loading a spec -------------------------------------------------------------------------------------------------
def _split_ref(ref: str) -> tuple[str, str | None]:
    """``pkg.mod:attr`` / ``path/file.py:attr`` / ``path/file.py`` -> (module or file, attr)."""
    if ref.endswith(".py"):
        return ref, None
    head, sep, attr = ref.rpartition(":")
    if sep and head and not (len(head) == 1 and head.isalpha()):  # not a Windows drive letter
        return head, attr or None
    return ref, None


def _import(where: str) -> Any:
    if where.endswith(".py") or os.sep in where or os.path.exists(where):
        path = os.path.abspath(where)
        name = "fusegraph_against_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {where!r}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod
    return importlib.import_module(where)


def resolve(ref: str, default_attrs: Sequence[str] = ("spec",)) -> Any:
    """The object ``ref`` names (imported with ``nki`` bound to the interpreter)."""
    where, attr = _split_ref(ref)
    mod = _import(where)
    if attr is None:
        for a in default_attrs:
            if hasattr(mod, a):
                attr = a
                break
        else:
            raise AttributeError(f"{where} defines none of {', '.join(default_attrs)}; name one as {where}:NAME")
    obj = mod
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _call_factory(fn: Callable[..., Any], layers: int | None) -> Any:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    return fn(layers=layers) if "layers" in params else fn()


def _is_kernel(obj: Any) -> bool:
    from fusegraph.nkisim.jit import Kernel, Launcher

    return isinstance(obj, (Kernel, Launcher))


def load_spec(ref: str, args_ref: str | None = None, *, layers: int | None = None,
              paths: Sequence[str] = ()) -> KernelSpec:
    """The :class:`KernelSpec` of ``--against REF [--against-args ARGS]``.

    ``REF`` names a spec (a :class:`KernelSpec` or a factory ``f(layers=None) -> KernelSpec``), or -- with
    ``ARGS`` -- the kernel itself, ``ARGS`` then naming the spec of its arguments (a ``KernelSpec`` whose ``kernel``
    is filled in, a factory returning one, or returning ``(args, kwargs)``). Both are imported inside
    ``nkisim.as_nki()`` with ``paths`` on ``sys.path``."""
    from fusegraph import nkisim

    for p in reversed([os.path.abspath(os.path.expanduser(x)) for x in paths]):
        if p not in sys.path:
            sys.path.insert(0, p)
    with nkisim.as_nki():
        obj = resolve(ref, ("spec", "SPEC", "kernel"))
        kernel = None
        if args_ref is not None:
            kernel, obj = obj, resolve(args_ref, ("spec", "SPEC", "args"))
        if callable(obj) and not isinstance(obj, KernelSpec) and not _is_kernel(obj):
            obj = _call_factory(obj, layers)
        if isinstance(obj, tuple) and kernel is not None:
            args, kwargs = (obj + ({},))[:2] if len(obj) in (1, 2) else (obj, {})
            obj = KernelSpec(kernel=kernel, args=tuple(args), kwargs=dict(kwargs))
        if not isinstance(obj, KernelSpec):
            raise TypeError(f"{args_ref or ref} gave a {type(obj).__name__}, not a fusegraph.perf.against.KernelSpec "
                            f"(or a factory returning one)")
        if kernel is not None:
            obj.kernel = kernel
        for p in obj.sys_path:
            if p and p not in sys.path:
                sys.path.insert(0, p)
        if isinstance(obj.kernel, str):
            obj.kernel = resolve(obj.kernel, ("kernel",))
    if not obj.name:
        k = getattr(obj.kernel, "func", obj.kernel)
        obj.name = f"{getattr(k, '__module__', '?')}:{getattr(k, '__qualname__', repr(k))}"
    return obj


# ---- running and costing it -----------------------------------------------------------------------------------------
@dataclass
class Side:
    """One kernel's modeled figures: the estimate, per-layer figures, and where the time goes by source line."""

    label: str
    estimate: Estimate
    layers: int
    attributed: bool  # per-layer figures from the layer of every instruction (else whole kernel / layers)
    per_layer: dict[str, float]  # "wall" and the engine keys of ENGINE_ROWS, seconds
    collectives: dict[str, float]  # per layer: count, bytes, modeled_s
    lines: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "seconds": self.estimate.seconds, "layers": self.layers,
                "per_layer_attributed": self.attributed, "per_layer_s": self.per_layer,
                "collectives_per_layer": self.collectives, "bound": self.estimate.total.bound(),
                "top_lines": self.lines, **self.info}


def run_spec(spec: KernelSpec) -> Any:
    """Run the spec's kernel shape-only with the trace on; returns the interpreter's profile."""
    from fusegraph import nkisim
    from fusegraph.nkisim.apiversion import use_api_version

    with nkisim.as_nki(target=spec.target), use_api_version(spec.nki_api):
        nkisim.run(spec.kernel, *spec.args, lnc=spec.lnc, target=spec.target, shape_only=True, assume=spec.assume,
                   trace=True, trace_layer=spec.layer_var, **spec.kwargs)
    return nkisim.last_profile()


def _region_matches(region: str, patterns: Sequence[str] | None) -> bool:
    if not patterns:
        return True
    base = _LAYER_PREFIX.sub("", region)
    return any(fnmatch.fnmatch(base, p) for p in patterns)


def per_layer_figures(est: Estimate, layers: int,
                      regions: Sequence[str] | None = None) -> tuple[dict[str, float], bool]:
    """Mean per-layer wall and engine busy time over the works attributed to a layer (and to ``regions`` when
    given); without layer attribution, the whole kernel divided by ``layers``.

    ``dma_active`` is the time with any of those DMAs in flight (the union of their windows, once over all the
    layers' DMAs and divided by the layer count, as :func:`fusegraph.perf.fit.layer_figures` compares it with a
    profile: a layer's weights prefetched during the previous layer are in flight once); ``dma_occupancy`` the
    bandwidth the same DMAs occupy (the sum of bytes / bandwidth, overlapping transfers counted each). Both also
    per issuing engine, as ``dma_active:<engine>`` / ``dma_occupancy:<engine>`` (the DMAs triggered from the Sync,
    Scalar or GpSimd queue), for the engines that issue any."""
    s = est.schedule
    by_layer: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    total: dict[str, float] = defaultdict(float)
    layer_dmas: list[int] = []
    all_dmas: list[int] = []
    for i, w in enumerate(s.works):
        if not _region_matches(w.region, regions):
            continue
        if w.kind == "dma":
            all_dmas.append(i)
            if isinstance(w.layer, int):
                layer_dmas.append(i)
                by_layer[w.layer][f"dma_occupancy:{w.engine}"] += w.occupancy
            total[f"dma_occupancy:{w.engine}"] += w.occupancy
        for acc in ([by_layer[w.layer]] if isinstance(w.layer, int) else []) + [total]:
            acc["wall"] += s.exposure[i]
            acc[w.engine] += w.busy
            if w.kind == "dma":
                acc["dma_occupancy"] += w.occupancy
    engines = sorted({s.works[i].engine for i in all_dmas})
    keys = ["wall"] + [k for k, _ in ENGINE_ROWS] + [f"dma_occupancy:{e}" for e in engines]
    attributed = bool(by_layer)
    dmas = layer_dmas if attributed else all_dmas
    n = len(by_layer) if attributed else max(1, layers)
    out = ({k: sum(d.get(k, 0.0) for d in by_layer.values()) / n for k in keys} if attributed
           else {k: total.get(k, 0.0) / n for k in keys})
    out["dma_active"] = s.dma_active(dmas) / n
    for e in engines:
        out[f"dma_active:{e}"] = s.dma_active([i for i in dmas if s.works[i].engine == e]) / n
    return out, attributed


def collective_figures(est: Estimate, layers: int) -> dict[str, float]:
    """Collectives (nki.collectives ops) per layer: count, bytes and the time the model charges them (ring model)."""
    ws = [w for w in est.schedule.works if w.opcode in COLLECTIVE_OPS]
    n_layers = len({w.layer for w in ws if isinstance(w.layer, int)}) or max(1, layers)
    return {"count": sum(w.count for w in ws) / n_layers, "bytes": sum(w.nbytes for w in ws) / n_layers,
            "modeled_s": sum(w.cost for w in ws) / n_layers}


def line_figures(est: Estimate, files: Sequence[str], lines_of: Sequence[int], top: int = 15) -> list[dict[str, Any]]:
    """Per ``(file, line)``: executions, busy/DMA cost and critical-path exposure, largest first, with source text."""

    s = est.schedule
    agg: dict[tuple[str, int], dict[str, Any]] = {}
    for i, w in enumerate(s.works):
        key = (files[i], lines_of[i])
        a = agg.setdefault(key, {"file": key[0], "line": key[1], "opcode": w.opcode, "engine": w.engine, "count": 0,
                                 "cost_s": 0.0, "exposed_s": 0.0, "bytes": 0})
        a["count"] += w.count
        a["cost_s"] += w.cost
        a["exposed_s"] += s.exposure[i]
        a["bytes"] += w.nbytes
    rows = sorted(agg.values(), key=lambda r: -(r["cost_s"] + r["exposed_s"]))[:top]
    for r in rows:
        r["text"] = statement_text(r["file"], r["line"])
    return rows


def statement_text(file: str, line: int, max_lines: int = 8) -> str:
    """The source statement starting at ``file:line`` on one line (a call spread over lines, joined)."""
    import linecache

    parts: list[str] = []
    depth = 0
    for i in range(line, line + max_lines):
        text = linecache.getline(file, i)
        if not text:
            break
        code = text.split("#", 1)[0].strip()
        parts.append(code)
        depth += code.count("(") + code.count("[") - code.count(")") - code.count("]")
        if depth <= 0:
            break
    return re.sub(r"\s+", " ", " ".join(parts)).replace("( ", "(").replace(" )", ")")


def cost_spec(spec: KernelSpec, profile: Any = None, parameter_set: str = SOURCED) -> Side:
    """Run (unless ``profile`` is given) and cost one physical core of the spec's kernel with the cost model's
    ``parameter_set`` (``"sourced"`` or a calibration of the data file, :func:`params.load_params`)."""
    t0 = time.perf_counter()
    profile = profile if profile is not None else run_spec(spec)
    run_s = time.perf_counter() - t0
    events = (profile.trace or {}).get((0, 0))
    if not events:
        raise RuntimeError("the kernel run recorded no instruction trace (it issued no instructions?)")
    view = view_from_trace(events, filename=spec.name)
    hw = load_params(spec.target, parameter_set)
    t1 = time.perf_counter()
    est = estimate_kernel(view, hw, label=spec.name)
    per, attributed = per_layer_figures(est, spec.layers)
    other = _other_programs_collectives(profile, hw, spec.layers)
    files = [ln.file for ln in view.lines]
    line_nos = [ln.line for ln in view.lines]
    info = {"instructions": len(events), "files": sorted({os.path.basename(f) for f in files}),
            "hbm_read_bytes": profile.hbm_read_bytes, "run_s": run_s, "cost_model_s": time.perf_counter() - t1,
            "programs": profile.lnc, "kernel": spec.name, "parameter_set": hw.parameter_set,
            "collectives_other_programs_per_layer": other}
    return Side(spec.name, est, spec.layers, attributed, per, collective_figures(est, spec.layers),
                line_figures(est, files, line_nos), info)


def _other_programs_collectives(profile: Any, hw: Any, layers: int) -> dict[str, float]:
    """Per layer, the collectives rank 0's other programs (the LNC partner core) issue, by the same ring model on
    their own (not scheduled: only program 0 is). Why reported: a profile's CC figure for a logical core may sum
    both cores' collectives, so a reader needs both counts to compare like with like."""
    if not getattr(profile, "collectives", None):
        return {"count": 0, "bytes": 0, "modeled_s": 0.0}
    rows = [r for r in collectives_report(profile, hw)["rows"] if r["rank"] == 0 and r["program"] != 0]
    n = max(1, layers)
    return {"count": sum(r["count"] for r in rows) / n, "bytes": sum(r["bytes"] for r in rows) / n,
            "modeled_s": sum(r["seconds"] for r in rows) / n}


# ---- the comparison -------------------------------------------------------------------------------------------------
def compare(ours: Side | str, theirs: Side) -> dict[str, Any]:
    """Rows of the side-by-side table: per layer, ours / theirs / theirs over ours."""
    rows = []
    for key, label in (("wall", "wall"),) + ENGINE_ROWS:
        a = ours.per_layer.get(key) if isinstance(ours, Side) else None
        b = theirs.per_layer.get(key, 0.0)
        rows.append({"quantity": label, "fusegraph_s": a, "theirs_s": b, "ratio": (b / a) if a else None})
    c_b = theirs.collectives
    c_a = ours.collectives if isinstance(ours, Side) else None
    rows.append({"quantity": "collectives", "fusegraph_s": c_a["modeled_s"] if c_a else None,
                 "theirs_s": c_b["modeled_s"], "ratio": None,
                 "fusegraph_count": c_a["count"] if c_a else None, "theirs_count": c_b["count"],
                 "fusegraph_bytes": c_a["bytes"] if c_a else None, "theirs_bytes": c_b["bytes"]})
    return {"rows": rows,
            "whole_kernel": {"fusegraph_s": ours.estimate.seconds if isinstance(ours, Side) else None,
                             "theirs_s": theirs.estimate.seconds}}


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e6:,.2f} us"


def format_comparison(result: dict[str, Any]) -> str:
    """The text table of one model/target."""
    t = result["theirs"]
    o = result["fusegraph"]
    head = (f"{result['model']} on {result['target']}: fusegraph vs {t['label']} -- per layer"
            f"{', one physical core' if result.get('shard') else ''}"
            + (f" (theirs: one rank of TP={result['shard'][0]} x LNC={result['shard'][1]}, program 0)"
               if result.get("shard") else ""))
    head += f" [cost-model parameters: {result.get('parameter_set', SOURCED)}]"
    from .measured import band_note  # the data file's recorded cross-validation (measured imports this module lazily)

    head += "\n" + band_note(result.get("parameter_set", SOURCED), result.get("target"))
    rows = [["quantity", "fusegraph", "theirs", "theirs / fusegraph"]]
    for r in result["comparison"]["rows"]:
        if r["quantity"] == "collectives":
            fc = ("-" if r["fusegraph_count"] is None
                  else f'{r["fusegraph_count"]:.0f} ops, {r["fusegraph_bytes"]:,.0f} B')
            rows.append(["collectives (modeled)", fc,
                         f'{r["theirs_count"]:.0f} ops, {r["theirs_bytes"]:,.0f} B, {_us(r["theirs_s"])}', "-"])
            continue
        rows.append([r["quantity"], _us(r["fusegraph_s"]), _us(r["theirs_s"]),
                     "-" if r["ratio"] is None else f'{r["ratio"]:.2f}x'])
    w = result["comparison"]["whole_kernel"]
    partial = not isinstance(o, str) and bool(o.get("regions"))  # theirs is part of a layer: totals differ in scope
    rows.append(["whole kernel (all layers)", _us(w["fusegraph_s"]), _us(w["theirs_s"]),
                 "-" if not w["fusegraph_s"] or partial else f'{w["theirs_s"] / w["fusegraph_s"]:.2f}x'])
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [head, "  ".join(c.ljust(wd) for c, wd in zip(rows[0], widths)), "  ".join("-" * wd for wd in widths)]
    lines += ["  ".join(c.ljust(wd) for c, wd in zip(r, widths)) for r in rows[1:]]
    if isinstance(o, str):
        lines.append(f"fusegraph: {o}")
    else:
        note = "" if o["per_layer_attributed"] else " (whole kernel / layers)"
        regs = f"; regions {', '.join(o['regions'])}" if o.get("regions") else ""
        lines.append(f"fusegraph: {o['layers']} layers, {o['instructions']} instructions, per layer from instruction "
                     f"names{note}{regs}")
    how = (f"layer of every instruction from {result['layer_var']}" if t["per_layer_attributed"]
           else f"whole kernel / {t['layers']} layer(s)")
    lines.append(f"theirs: {t['layers']} layer(s), {t['instructions']} instructions on program 0, files "
                 f"{', '.join(t['files'])}; per layer: {how}")
    lines.append("theirs, top lines (file:line, executions, modeled cost + critical-path exposure):")
    for r in t["top_lines"][:10]:
        lines.append(f"  {os.path.basename(r['file'])}:{r['line']:<5d} {r['opcode']:<16s} x{r['count']:<5d} "
                     f"{_us(r['cost_s'])} + {_us(r['exposed_s'])}  {r['text'][:110]}")
    for label, side in (("fusegraph", None if isinstance(o, str) else o), ("theirs", t)):
        if side is None:
            continue
        per = side["per_layer_s"]
        parts = [f"{k.split(':', 1)[1]} {_us(per[k])} / {_us(per.get('dma_occupancy:' + k.split(':', 1)[1]))}"
                 for k in sorted(per) if k.startswith("dma_active:")]
        if parts:
            lines.append(f"{label}: DMA by issuing engine, per layer (in flight / bandwidth occupancy): "
                         + "; ".join(parts))
    other = t.get("collectives_other_programs_per_layer") or {}
    if other.get("count"):
        lines.append(f"theirs: rank 0's other program(s) issue {other['count']:g} more collective(s) per layer "
                     f"({other['bytes']:,.0f} B, {_us(other['modeled_s'])} by the same ring model, not scheduled: "
                     "only program 0 is); a logical core's measured CC time may count them")
    if result.get("notes"):
        lines.append(f"note: {result['notes']}")
    return "\n".join(lines)
