"""The per-graph compile pipeline behind the backend: check -> lower to ATen -> program -> executor.

Every failure ends in a warning and the eager path (unless ``pass_through_build_failures``), so a user's
forward never raises because of fusegraph.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .capture.inline_regions import inline_regions, region_bodies
from .capture.lower import on_local_shards, to_aten
from .capture.checks import (CaptureRefused, check_capturable, check_collectives, check_complex,
                             check_static_shapes, dynamo_input_sources)
from .capture.rewrites import install_rewrites
from .capture.rewrites.hf_layer_reuse import allow_region_fallback
from .capture.paths import current_frame_modules
from .capture.quantized import warn_quantized
from .capture.session import CaptureSession, refusal_of, session_for
from .capture.summary import summarize
from .executors import available_executors, get_executor
from .executors.rank_agreement import agree_or_eager
from .program.build import DynamoInput, add_graph
from .program.complex_pairs import pair_boundary
from .settings import Settings
from .warnings import one_line, warn

log = logging.getLogger(__name__)


def resolve_executor_name(settings: Settings) -> str:
    name = settings.executor
    if settings.dryrun:
        return "eager"
    if name == "auto":
        for candidate in ("neuron", "nkisim"):
            if candidate in available_executors():
                return candidate
        return "eager"
    return name


def _dynamo_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[DynamoInput]:
    sources = dynamo_input_sources(gm)
    return [
        DynamoInput(source=s, is_tensor=isinstance(v, torch.Tensor), is_parameter=isinstance(v, torch.nn.Parameter))
        for s, v in zip(sources, example_inputs)
    ]


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], settings: Settings) -> Callable:
    """Compile one dynamo graph for fusegraph; returns the callable dynamo will run for it."""
    session = session_for(settings)
    session.begin_graph()
    index = session.reserve_index()
    t0 = time.perf_counter()
    allow_region_fallback(False)  # dynamo's own default again once tracing for fusegraph is over
    try:
        bodies = region_bodies(gm)
        if bodies:  # layer reuse: dynamo traced a layer once and called the trace N times; flatten again
            session.layer_traces[index] = (inline_regions(gm), len(bodies))
            log.debug("graph %d: %d layer calls from %d dynamo trace(s), inlined", index, *session.layer_traces[index])
        check_capturable(gm, example_inputs)
        producers = session.find_producers(example_inputs)
        dyn_inputs = _dynamo_inputs(gm, example_inputs)
        reason = getattr(gm, "compile_subgraph_reason", None)
        session.paths.register(index, current_frame_modules())
        dynamo_nodes = sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output"))

        aten_gm = to_aten(gm, example_inputs)
        check_static_shapes(aten_gm)
        check_collectives(aten_gm)
        check_complex(aten_gm)
        add_graph(session.program, aten_gm, index, dyn_inputs, dynamo_nodes)
        session.paths.refresh(session.program)
        session.add_links(index, producers)
        session.add_break(index, reason)
        warn_quantized(session, index)
        runner = on_local_shards(aten_gm, _make_runner(session, index, settings))  # DTensors: local shards
        compiled = lambda *args: runner(args)  # noqa: E731
    except CaptureRefused as refused:
        session.refusals.append(refusal_of(index, str(refused), gm))
        warn(f"graph {index}: {refused}; running it eagerly")
        compiled = gm.forward
    except Exception as e:  # noqa: BLE001 - any capture failure must leave the user's step working
        if settings.pass_through_build_failures:
            raise
        session.refusals.append(refusal_of(index, f"{type(e).__name__}: {e}", gm))
        warn(f"graph {index}: capture failed ({one_line(e)}); running it eagerly")
        log.debug("capture failure", exc_info=True)
        compiled = gm.forward
    session.compile_seconds += time.perf_counter() - t0
    if settings.report or settings.dryrun:
        _report(session, settings)
    return _recording(session, index, compiled)


def _report(session: CaptureSession, settings: Settings) -> None:
    """The fused-region report after each graph (so it always covers the whole step so far): logged in dryrun,
    written as JSON to ``settings.report``. A report failure never breaks the compile."""
    data = None
    try:
        from .report import report_for_session  # inside the try: a report that cannot even load is contained

        report = report_for_session(session)
        data = report.to_dict()
        if settings.dryrun:
            log.info("fusegraph dryrun: fused-region report\n%s", report.format())
    except Exception as e:  # noqa: BLE001
        if settings.pass_through_build_failures:
            raise
        warn(f"the fused-region report failed ({type(e).__name__}: {e}); the report has the capture summary only")
        log.debug("report failure", exc_info=True)
    if not settings.report:
        return
    try:
        with open(settings.report, "w") as f:
            json.dump(data if data is not None else summarize(session), f, indent=2, default=str)
    except OSError as e:
        warn(f"could not write the report to {settings.report}: {e}")


def _make_runner(session: CaptureSession, index: int, settings: Settings) -> Callable:
    name = resolve_executor_name(settings)
    try:
        # dynamo calls backends under its FakeTensorMode; codegen computes real constants
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            runner = get_executor(name).compile(session.program, index, settings)
    except Exception as e:  # noqa: BLE001
        if settings.pass_through_build_failures or name == "eager":
            raise
        warn(f"graph {index}: executor {name!r} could not build ({type(e).__name__}: {e}); using the eager executor")
        name = "eager"
        runner = get_executor("eager").compile(session.program, index, settings)
    # TP: every rank of the graph's collective groups runs it alike (same executor, settings, kernels) or eagerly
    name, runner = agree_or_eager(session.program, index, settings, name, runner)
    session.executors[index] = name
    return pair_boundary(session.program.captured(index), runner)  # complex inputs/outputs as real pairs


def compile_program(session: CaptureSession, index: int, settings: Settings) -> Callable:
    """The executor's runner for graph ``index`` already added to ``session.program`` by a frontend that does not
    come from dynamo (the JAX/StableHLO frontend): same executor choice and eager fallback as the backend, and
    the fused-region report when ``report``/``dryrun`` ask for it."""
    runner = _make_runner(session, index, settings)
    if settings.report or settings.dryrun:
        _report(session, settings)
    return runner


def _recording(session: CaptureSession, index: int, compiled: Callable) -> Callable:
    first = [True]

    def run(*args: Any) -> Any:
        if first[0]:
            # model classes imported after the backend get their capture-rewrite dispatcher now, outside any
            # trace (patching a class while dynamo compiles a frame that uses it trips dynamo's guards)
            first[0] = False
            install_rewrites()
        out = compiled(*args)
        session.record_outputs(index, out)
        return out

    run._fusegraph_graph_index = index  # type: ignore[attr-defined]
    return run
