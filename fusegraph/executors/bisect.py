"""Bisect the kernels of a graph the NKI executor ran, on the inputs of its latest call.

The search itself (:func:`fusegraph.codegen.bisect.first_divergence`) knows kernel programs only; this is the
executor side of it: take the graph's latest inputs from its execution record, recompute every node eagerly,
and hand each kernel the arguments the executor would give it.
"""
from __future__ import annotations

from typing import Any

import torch

from ..codegen.bisect import Divergence, first_divergence
from ..program import Program
from .eager import build_plan, run_plan
from .kernel_cache import codegen_options
from .kernel_args import kernel_args as args_of, marshal_input


def _cloned(args: list) -> list:
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def bisect_graph(program: Program, graph_index: int = 0, **kw: Any) -> list[Divergence]:
    """Bisect every kernel of a graph compiled by the NKI executor, on the inputs of its latest call.

    Re-runs the graph eagerly (on clones of its state) to get every node's eager value, then bisects each
    kernel. Returns one :class:`Divergence` per kernel that diverges (empty when all agree).
    """
    record = program.execution.get(graph_index)
    run = record.run if record is not None else None
    if run is None or run.last_args is None:
        raise ValueError("graph was not run by the NKI executor yet (call the compiled step once first)")
    env = dict(zip(run.input_ids, _cloned(run.last_args)))
    run_plan(build_plan(program, program.topo_order(graph_index)), env)
    G = program.graph
    tolerance = kw.pop("tolerance", 1e-4)
    found = []
    for plan in run.plans:
        # eager values for everything the kernel reads, but the state as it was before the step
        kargs_env = dict(env)
        kargs_env.update(zip(run.input_ids, _cloned(run.last_args)))
        kernel_args = args_of(plan, kargs_env)
        ref_env = {name: (marshal_input(src, plan.generated.specs[name].dtype, kargs_env[src.node])
                          if src.kind == "input" else src.value(kargs_env[src.node]))
                   for name, src in plan.lowered.args.items()}
        with codegen_options(run.settings):  # prefixes rebuilt with the switches the kernel was built with
            d = first_divergence(plan.lowered.program, kernel_args, lambda n: env[n],
                                 lambda nodes: sorted({G.nodes[n].get("op", "?") for n in nodes}),
                                 tolerance=tolerance, target=run.settings.target,
                                 reference_env=ref_env, layouts=plan.generated.layouts,
                                 chunk_bytes=run.settings.weight_chunk_kib * 1024, ring=run.settings.weight_buffers,
                                 **kw)
        if d is not None:
            found.append(d)
    return found
