"""Inline dynamo's ``invoke_subgraph`` calls back into one flat graph, each copy named after its own layer.

With layer reuse (``capture.rewrites.hf_layer_reuse``) dynamo traces decoder layer 0 once and calls the same
subgraph for layers 1..N-1. Everything after capture (program IR, matching, codegen, reports) wants the flat
graph, with every op carrying the module path of the layer it really ran in. The reused body's metadata names
layer 0's modules, so each inlined copy has its module stack re-rooted at the calling layer (the module stack of
the ``invoke_subgraph`` call node names it). torch's own inlining pass does not do that, hence this one.
"""
from __future__ import annotations

import copy
import logging
import operator
from typing import Any

import torch
import torch.fx as fx

log = logging.getLogger(__name__)


def _invoke_target() -> Any:
    return getattr(getattr(torch.ops, "higher_order", None), "invoke_subgraph", None)


def region_bodies(gm: fx.GraphModule) -> set[str]:
    """The distinct subgraph bodies ``gm`` calls (one per layer trace dynamo actually made)."""
    target = _invoke_target()
    if target is None:
        return set()
    return {str(n.args[0].target) for n in gm.graph.nodes if n.op == "call_function" and n.target is target}


def _stack_rerooter(caller: fx.Node, body: fx.GraphModule):
    """A function mapping a body node's nn_module_stack to the caller's modules (None: leave it as is)."""
    outer = list((caller.meta.get("nn_module_stack") or {}).items())
    if not outer:
        return None
    depth = len(outer) - 1  # the caller's innermost module (the decoder layer) sits at this depth in the body
    new_key, (new_path, new_cls) = outer[-1]
    old_path = None
    for n in body.graph.nodes:
        stack = list((n.meta.get("nn_module_stack") or {}).values())
        if len(stack) > depth:
            old_path = stack[depth][0]
            break
    if old_path is None or old_path == new_path:
        return None

    def reroot(stack: dict) -> dict:
        out = {}
        for i, (key, (path, cls)) in enumerate(stack.items()):
            if path == old_path or path.startswith(old_path + ".") or path.startswith(old_path + "["):
                path = new_path + path[len(old_path):]
                if i == depth:
                    key = new_key
            out[key] = (path, cls)
        return out

    return reroot


def inline_regions(gm: fx.GraphModule) -> int:
    """Inline every ``invoke_subgraph`` call of ``gm`` in place (nested ones first); return how many."""
    target = _invoke_target()
    if target is None:
        return 0
    count = 0
    for name, sub in list(gm.named_children()):
        if isinstance(sub, fx.GraphModule):
            count += inline_regions(sub)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]
    for call in calls:
        body_attr, operands = call.args[0], call.args[2:]
        body: fx.GraphModule = getattr(gm, str(body_attr.target))
        if any(isinstance(m, fx.GraphModule) for m in body.children()):
            raise NotImplementedError("a reused region holds further subgraphs (not supported)")
        reroot = _stack_rerooter(call, body)
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        env: dict[fx.Node, Any] = dict(zip(placeholders, operands))
        with gm.graph.inserting_before(call):
            for node in body.graph.nodes:
                if node.op in ("placeholder", "output"):
                    continue
                new = gm.graph.node_copy(node, lambda n: env[n])
                new.meta = copy.copy(node.meta)
                if reroot is not None and node.meta.get("nn_module_stack"):
                    new.meta["nn_module_stack"] = reroot(node.meta["nn_module_stack"])
                env[node] = new
        results = body.graph.output_node().args[0]
        for user in list(call.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(env[results[user.args[1]]] if isinstance(results[user.args[1]], fx.Node)
                                           else results[user.args[1]])
                gm.graph.erase_node(user)
            else:
                raise NotImplementedError(f"region output used directly by {user.op} {user.target}")
        gm.graph.erase_node(call)
        if not body_attr.users:
            gm.graph.erase_node(body_attr)
        count += 1
    if calls:
        for name, sub in list(gm.named_children()):
            if isinstance(sub, fx.GraphModule) and not any(n.op == "get_attr" and n.target == name
                                                           for n in gm.graph.nodes):
                delattr(gm, name)
        gm.graph.lint()
        gm.recompile()
    return count
