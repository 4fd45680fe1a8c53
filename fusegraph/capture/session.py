"""A capture session: every graph dynamo hands fusegraph for one compiled callable, linked into one program.

Dynamo calls the backend once per graph; when a step is split by graph breaks the graphs arrive one by one,
interleaved with execution. Linking is done by tensor flow: each compiled graph records the tensors it returns;
when a later graph is compiled, its (real) example inputs are looked up among them. A match by object identity
with an unchanged version counter means no Python glue computed on the tensor between the graphs.
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from ..program import GraphBreak, InputKind, Link, Program, Ref
from ..program.sources import layer_index
from ..settings import Settings
from .compile_context import current_compiler_fn, current_frame_compile, current_recompile_reason
from .paths import ModelPaths
from .recompiles import RecompileWatch

log = logging.getLogger(__name__)


def version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter, or None for an inference tensor (made under ``torch.inference_mode()``), which
    has none. Linking uses the counter to prove no Python glue wrote the tensor between two graphs; an inference
    tensor can still be written in place inside inference mode, so without a counter nothing is proven and the
    link is not glue-free (a conservative answer: a region is then not fused across that break)."""
    if t.is_inference():
        return None
    return t._version


@dataclass
class Refusal:
    """A graph fusegraph did not take (it runs eagerly): its reason and the size of what it left uncovered.

    ``ops`` counts the graph's dynamo operations (calls), ``decoder_ops`` those inside a decoder layer: a refused
    graph is never lowered to ATen, so these are the closest measure of what the report must count as uncovered
    (a coverage of 1.0 over the 0 ops of a step whose only graph was refused would be wrong)."""

    graph_index: int
    reason: str
    ops: int = 0
    decoder_ops: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"graph": self.graph_index, "reason": self.reason, "ops": self.ops, "decoder_ops": self.decoder_ops}


def refusal_of(graph_index: int, reason: str, gm: Any = None) -> Refusal:
    """The :class:`Refusal` of dynamo graph ``gm``, with its operations counted (by their module stack: those
    under a numbered module, ``model.layers.3...``, are decoder-layer ops)."""
    ops = decoder = 0
    for node in getattr(getattr(gm, "graph", None), "nodes", ()):
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        ops += 1
        stack = node.meta.get("nn_module_stack") or {}
        if any(layer_index(path) is not None for path, _ in stack.values()):
            decoder += 1
    return Refusal(graph_index, reason, ops, decoder)


@dataclass
class StepVersion:
    """An earlier version of the step, replaced when dynamo recompiled one of its frames. Its graphs' runners
    still use this program (dynamo keeps the old compiled code for inputs that pass its old guards)."""

    program: Program
    refusals: list[Refusal]


@dataclass
class CaptureSession:
    settings: Settings
    name: str = ""
    program: Program = field(default_factory=Program)
    refusals: list[Refusal] = field(default_factory=list)
    compile_seconds: float = 0.0
    #: per graph with layer reuse: (decoder-layer calls, distinct dynamo traces of them); inlined before lowering
    layer_traces: dict[int, tuple[int, int]] = field(default_factory=dict)
    executors: dict[int, str] = field(default_factory=dict)
    paths: ModelPaths = field(default_factory=ModelPaths)
    #: earlier versions of the step (see :meth:`begin_graph`); ``program`` is the latest
    superseded: list[StepVersion] = field(default_factory=list)
    #: why dynamo recompiled (guard failures), and the position counters made dynamic (capture/recompiles.py)
    recompiles: RecompileWatch = field(default_factory=RecompileWatch)
    _frames: dict[int, int] = field(default_factory=dict)  # dynamo frame id with a graph in the current version ->
    # how many times the version's entry graph had run when that frame compiled (``_entry_runs``)
    _entry_runs: int = 0  # runs of the current version's first graph: one per step
    _next: Iterator[int] = field(default_factory=itertools.count)
    _last_outputs: dict[int, list] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def reserve_index(self) -> int:
        with self._lock:
            return next(self._next)

    def begin_graph(self) -> None:
        """Note the dynamo frame of the graph being compiled; a recompile of a frame that already has a graph in
        the current version, in a later step, starts a new version of the step (the new graph replaces the old
        one: linking them, or reporting both as parts of one step, would be wrong).

        Why "in a later step": a frame dynamo resumes after a graph break inside a decoder layer is compiled once
        per layer in the same step (its guards name the layer: ``self.layer_idx == 0``); those graphs are parts of
        this step. A step is a run of the version's first graph, so a frame compiled again before that graph ran
        again belongs to the same step."""
        frame = current_frame_compile()
        if frame is None:
            return
        if frame[1] > 0:
            self.recompiles.note(frame[0], current_recompile_reason())
        if frame[1] > 0 and frame[0] in self._frames and self._frames[frame[0]] != self._entry_runs:
            log.debug("frame %d compiled again (compile %d) in a later step: new version of the step", *frame)
            self.superseded.append(StepVersion(self.program, self.refusals))
            self.program, self.refusals, self._frames, self._entry_runs = Program(), [], {}, 0
        elif frame[1] > 0 and frame[0] in self._frames:
            log.debug("frame %d compiled again (compile %d) in the same step (another layer): one more graph", *frame)
        self._frames.setdefault(frame[0], self._entry_runs)

    def current_layer_traces(self) -> dict[int, tuple[int, int]]:
        indices = {g.index for g in self.program.graphs}
        return {i: v for i, v in self.layer_traces.items() if i in indices}

    # ---- tensor-flow linking -----------------------------------------------------------------------------
    def record_outputs(self, graph_index: int, outputs: Any) -> None:
        if self.program.graphs and graph_index == self.program.graphs[0].index:
            self._entry_runs += 1
        outs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        rec = []
        for t in outs:
            if isinstance(t, torch.Tensor):
                rec.append((weakref.ref(t), version_of(t)))
            else:
                rec.append(None)
        self._last_outputs[graph_index] = rec

    def find_producers(self, example_inputs: Sequence[Any]) -> dict[int, tuple[int, int, bool]]:
        """{input position: (producer graph, output index, glue_free)} for inputs produced by earlier graphs."""
        found: dict[int, tuple[int, int, bool]] = {}
        for pos, t in enumerate(example_inputs):
            if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter):
                continue
            for g, rec in self._last_outputs.items():
                for k, r in enumerate(rec):
                    if r is not None and r[0]() is t:
                        found[pos] = (g, k, r[1] is not None and version_of(t) == r[1])
                        break
                if pos in found:
                    break
        return found

    def add_links(self, graph_index: int, producers: dict[int, tuple[int, int, bool]]) -> None:
        prog = self.program
        dst = prog.find(graph_index)
        if dst is None:
            return
        for pos, (g, k, glue_free) in producers.items():
            src = prog.find(g)
            if src is None or pos >= len(dst.inputs):
                continue
            out = src.outputs[k] if k < len(src.outputs) else None
            if not isinstance(out, Ref):
                continue
            pin = dst.inputs[pos]
            if pin.kind in (InputKind.WEIGHT, InputKind.BUFFER):
                continue
            link = Link(src_graph=g, src_output=k, src_node=out.node, dst_graph=graph_index, dst_input=pos,
                        dst_node=pin.node, glue_free=glue_free)
            prog.links.append(link)
            if pin.kind != InputKind.STATE:
                pin.kind = InputKind.LINKED
                prog.graph.nodes[pin.node]["input_kind"] = InputKind.LINKED
            prog.graph.add_edge(out.node, pin.node, link=True, glue_free=glue_free)

    def add_break(self, graph_index: int, reason: Any) -> None:
        if reason is None or not getattr(reason, "graph_break", False):
            return
        frame = None
        stack = getattr(reason, "user_stack", None) or []
        if stack:
            f = stack[-1]
            frame = f"{f.filename}:{f.lineno} in {f.name}"
        text = " ".join(t.strip() for t in str(getattr(reason, "reason", reason)).strip().splitlines() if t.strip())
        self.program.breaks.append(GraphBreak(after_graph=graph_index, reason=text, user_frame=frame))
        for g in self.program.graphs:
            if g.index == graph_index:
                g.break_reason = text


# ---- which session does a backend call belong to ---------------------------------------------------------
_explicit: contextvars.ContextVar[CaptureSession | None] = contextvars.ContextVar("fusegraph_session", default=None)
_by_compile: dict[int, tuple[Any, CaptureSession]] = {}
_last: list[CaptureSession] = []


@contextlib.contextmanager
def explicit_session(session: CaptureSession) -> Iterator[CaptureSession]:
    """Route every graph compiled inside the block to ``session`` (used by :func:`fusegraph.capture`)."""
    token = _explicit.set(session)
    try:
        yield session
    finally:
        _explicit.reset(token)


def session_for(settings: Settings) -> CaptureSession:
    """The session of the compile in progress: explicit if set, else one per ``torch.compile`` call."""
    s = _explicit.get()
    if s is None:
        owner = current_compiler_fn()
        key = id(owner) if owner is not None else None
        if key is not None and key in _by_compile:
            ref, s = _by_compile[key]
            if ref() is not owner:
                s = None
        if s is None:
            s = CaptureSession(settings=settings, name=f"compile-{time.strftime('%H%M%S')}")
            if key is not None:
                try:
                    _by_compile[key] = (weakref.ref(owner), s)
                except TypeError:  # owner not weak-referenceable: one session per graph
                    pass
    _last[:] = [s]
    return s


def last_session() -> CaptureSession | None:
    """The session most recently used by the backend (for users who called torch.compile directly)."""
    return _last[0] if _last else None
