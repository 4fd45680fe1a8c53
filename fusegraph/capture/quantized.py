"""Say which dynamically quantized modules a step leaves to PyTorch: one warning per cause, naming the modules.

fusegraph has no int8 kernels. With the capture rewrite (:mod:`.rewrites.quantized_linear`) each
``torch.ao.nn.quantized.dynamic.Linear`` call is one opaque op inside the graph: it runs in PyTorch and the rest
of the step is fused around it. Without it (``capture_rewrites`` off, or a module the rewrite does not take) dynamo
breaks the graph at every call. Either way the user gets one line naming what happens, not one warning per graph
(or per fused region next to a break) that never mentions the quantized modules.
"""
from __future__ import annotations

import logging
import re
import weakref
from typing import Any

from ..warnings import warn
from .rewrites.quantized_linear import OP_NAME, module_of

log = logging.getLogger(__name__)

CLASS_NAME = "torch.ao.nn.quantized.dynamic.Linear"
#: where dynamo reports a graph break inside the quantized Linear's forward
_BREAK_FILE = "torch/ao/nn/quantized/dynamic/modules/linear.py"
_LAYER = re.compile(r"(?<=\.)\d+(?=\.)")
_DTYPES = {"qint8": "int8", "float16": "fp16"}

#: per capture session (by id, checked against a weak reference): module paths and causes already warned about
_warned: dict[int, tuple[weakref.ref, set[str]]] = {}


def _seen(session: Any) -> set[str]:
    entry = _warned.get(id(session))
    if entry is None or entry[0]() is not session:
        for key in [k for k, (ref, _) in _warned.items() if ref() is None]:  # sessions gone since
            del _warned[key]
        entry = (weakref.ref(session), set())
        _warned[id(session)] = entry
    return entry[1]


def quantized_linears(program: Any, graph_index: int) -> dict[str, str]:
    """{module path: weight dtype ("int8" / "fp16")} of the quantized Linear ops graph ``graph_index`` runs."""
    found: dict[str, str] = {}
    for _, d in program.graph.nodes(data=True):
        if d.get("graph") != graph_index or d.get("op") != OP_NAME:
            continue
        consts = d.get("consts") or ()
        module = module_of(consts[0]) if consts else None
        dtype = str(getattr(getattr(module, "_packed_params", None), "dtype", "")).replace("torch.", "")
        found[d.get("module") or "the step"] = _DTYPES.get(dtype, dtype or "quantized")
    return found


def compact_paths(paths: list[str]) -> list[str]:
    """Module paths with the layer index folded (``model.layers.*.mlp.up_proj``) when several layers share one."""
    groups: dict[str, list[str]] = {}
    for p in paths:
        groups.setdefault(_LAYER.sub("*", p, count=1), []).append(p)
    return [key if len(members) > 1 else members[0] for key, members in groups.items()]


def linear_message(paths: list[str], dtype: str) -> str:
    """The one-line warning for quantized Linear modules that run in PyTorch inside the graph."""
    if len(paths) == 1:
        return (f"{paths[0]}: a dynamically quantized {dtype} Linear ({CLASS_NAME}) is not fused; it runs in "
                "PyTorch, inside the same graph (no graph break)")
    return (f"{', '.join(compact_paths(paths))}: {len(paths)} dynamically quantized {dtype} Linear modules "
            f"({CLASS_NAME}) are not fused; they run in PyTorch, inside the same graph (no graph breaks)")


def break_message(rewrites_on: bool) -> str:
    why = ("fusegraph's capture rewrite does not apply to it" if rewrites_on
           else "capture_rewrites is off")
    return (f"a dynamically quantized Linear ({CLASS_NAME}) breaks the graph at every call (dynamo cannot trace its "
            f"packed weights; {why}); each runs in PyTorch and the step is split into several graphs")


def warn_quantized(session: Any, graph_index: int) -> None:
    """Warn, once per session and cause, about the quantized modules graph ``graph_index`` leaves to PyTorch."""
    seen = _seen(session)
    by_dtype: dict[str, list[str]] = {}
    for path, dtype in quantized_linears(session.program, graph_index).items():
        if path not in seen:
            seen.add(path)
            by_dtype.setdefault(dtype, []).append(path)
    for dtype, paths in by_dtype.items():
        warn(linear_message(paths, dtype))
    for b in session.program.breaks:
        if b.after_graph == graph_index and _BREAK_FILE in (b.user_frame or "").replace("\\", "/"):
            if "break" not in seen:
                seen.add("break")
                warn(break_message(bool(getattr(session.settings, "capture_rewrites", True))))
