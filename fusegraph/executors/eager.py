"""Run a captured graph op by op through PyTorch: the reference semantics every other executor must match."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from ..program import Program, Ref
from ..settings import Settings
from .base import Runner, register_executor


def _resolver(template: Any) -> Callable[[dict], Any]:
    """Compile an args template (with Refs) into a function of the value environment, once, ahead of time."""
    if isinstance(template, Ref):
        name = template.node
        return lambda env: env[name]
    if isinstance(template, (list, tuple)):
        if not any(_has_ref(t) for t in template):
            return lambda env: template
        parts = [_resolver(t) for t in template]
        kind = type(template)
        return lambda env: kind(p(env) for p in parts)
    if isinstance(template, dict):
        items = [(k, _resolver(v)) for k, v in template.items()]
        return lambda env: {k: p(env) for k, p in items}
    return lambda env: template


def _has_ref(t: Any) -> bool:
    if isinstance(t, Ref):
        return True
    if isinstance(t, (list, tuple)):
        return any(_has_ref(x) for x in t)
    if isinstance(t, dict):
        return any(_has_ref(x) for x in t.values())
    return False


def build_plan(program: Program, nodes: Sequence[str]) -> list[tuple[str, Callable, Callable, Callable]]:
    """(node, target, args resolver, kwargs resolver) for each op node, in the given order."""
    plan = []
    for n in nodes:
        d = program.graph.nodes[n]
        if d["kind"] != "op":
            continue
        plan.append((n, d["target"], _resolver(tuple(d["args"])), _resolver(dict(d["kwargs"]))))
    return plan


def run_plan(plan: list, env: dict) -> dict:
    for n, target, args, kwargs in plan:
        env[n] = target(*args(env), **kwargs(env))
    return env


class EagerExecutor:
    name = "eager"

    def compile(self, program: Program, graph_index: int, settings: Settings) -> Runner:
        captured = program.captured(graph_index)
        plan = build_plan(program, program.topo_order(graph_index))
        input_ids = [i.node for i in captured.inputs]
        outputs = [_resolver(o) for o in captured.outputs]

        def run(args: Sequence[Any]) -> list:
            env = run_plan(plan, dict(zip(input_ids, args)))
            return [o(env) for o in outputs]

        return run


@register_executor("eager")
def _make() -> EagerExecutor:
    return EagerExecutor()
