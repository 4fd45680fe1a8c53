"""Name every op and input by its module path in the *model*, even inside graphs that resume after a break.

Dynamo names things relative to the frame it traced (``L['self'].down_proj`` in a frame resumed inside an MLP's
forward), and after a graph break the outer frames (where the whole model is visible) may compile last or not
at all. So fusegraph keeps, per graph, the frame's module objects (weakly) and each node's frame-relative path,
and resolves paths once more whenever a graph is added: roots are the outermost modules seen in any frame, and
a path is named through the deepest module on it that belongs to a root.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from ..program import Program
from ..program.sources import layer_index, relative_path

log = logging.getLogger(__name__)


def current_frame_modules() -> dict[str, Any]:
    """Weak references to the nn.Modules of the frame dynamo is compiling (and modules one attribute deep)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        items = list(tx.f_locals.items())
    except Exception:
        return {}
    out: dict[str, Any] = {}
    for name, obj in items:
        if isinstance(obj, torch.nn.Module):
            out[name] = weakref.ref(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            for attr, val in list(vars(obj).items()):
                if isinstance(val, torch.nn.Module):
                    out[f"{name}.{attr}"] = weakref.ref(val)
    return out


class ModelPaths:
    """Per-session frame records and the module -> qualified-name map derived from them."""

    def __init__(self) -> None:
        self.frames: dict[int, dict[str, Any]] = {}

    def register(self, graph_index: int, frame_modules: dict[str, Any]) -> None:
        self.frames[graph_index] = frame_modules

    def _names(self) -> dict[int, str]:
        candidates = {}
        for frame in self.frames.values():
            for ref in frame.values():
                m = ref()
                if m is not None:
                    candidates[id(m)] = m
        contained: set[int] = set()
        for m in candidates.values():
            for sub in m.modules():
                if sub is not m:
                    contained.add(id(sub))
        names: dict[int, str] = {}
        for mid, m in candidates.items():
            if mid in contained:
                continue
            for name, sub in m.named_modules(remove_duplicate=False):
                names.setdefault(id(sub), name)
        return names

    def _resolve(self, names: dict[int, str], frame: dict[str, Any], path: str) -> str | None:
        parts = path.split(".")
        for cut in range(len(parts), 0, -1):  # longest frame-variable prefix that is a recorded module
            ref = frame.get(".".join(parts[:cut]))
            if ref is None:
                continue
            obj = ref()
            if obj is None:
                return None
            best_name, best_at = names.get(id(obj)), cut
            for i in range(cut, len(parts)):
                sub = obj._modules.get(parts[i]) if isinstance(obj, torch.nn.Module) else None
                if sub is None:
                    break
                obj = sub
                if id(obj) in names:
                    best_name, best_at = names[id(obj)], i + 1
            if best_name is None:
                return None
            tail = ".".join(parts[best_at:])
            return ".".join(x for x in (best_name, tail) if x)
        return None

    def refresh(self, program: Program) -> None:
        """Re-resolve the ``module``/``layer`` of every node from its frame path."""
        names = self._names()
        if not names:
            return
        for _, d in program.graph.nodes(data=True):
            raw = d.get("frame_path")
            frame = self.frames.get(d["graph"])
            if raw is None or frame is None:
                continue
            resolved = self._resolve(names, frame, raw)
            if resolved is not None:
                d["module"] = resolved or None
                d["layer"] = layer_index(resolved)
        for g in program.graphs:
            frame = self.frames.get(g.index)
            for pin in g.inputs:
                raw = program.graph.nodes[pin.node].get("frame_path")
                if frame is None or raw is None:
                    continue
                resolved = self._resolve(names, frame, raw)
                if resolved:
                    pin.module = resolved
                    program.graph.nodes[pin.node]["module"] = resolved


def fallback_path(path: str, outermost: str | None) -> str:
    return relative_path(path, outermost)
