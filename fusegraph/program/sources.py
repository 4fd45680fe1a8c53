"""Turn dynamo's names for things into user-facing paths.

Dynamo names graph inputs by how it reached them from the frame (``G['m']._modules['model']._parameters['w']``)
and records the module stack of each op (``G['m'].model.layers.0.self_attn``). Reports should say
``model.layers.0.self_attn.q_proj.weight`` and "layer 0", so this module normalizes both.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_ROOT = re.compile(r"^(?:[LG]\[(['\"])(?P<root>[^'\"]*)\1\])")
_TOKEN = re.compile(
    r"\._(?:modules|parameters|buffers)\[(['\"])(?P<key>[^'\"]*)\1\]"  # ._modules['x']
    r"|\.(?P<attr>[A-Za-z_][A-Za-z0-9_]*)"  # .attr
    r"|\[(?P<idx>-?\d+)\]"  # [3]
    r"|\[(['\"])(?P<skey>[^'\"]*)\6\]"  # ['key']
)
_INT = re.compile(r"^\d+$")


@dataclass(frozen=True)
class SourceInfo:
    root: str
    path: str  # full dotted path from the frame variable (``self.model.model.layers.0.mlp.gate.weight``)
    is_parameter: bool
    is_buffer: bool
    is_local_arg: bool  # a plain argument of the compiled frame (``L['tok']``)


def parse_source(name: str) -> SourceInfo:
    """Parse a dynamo source name such as ``L['self'].model._modules['model']._parameters['weight']``."""
    m = _ROOT.match(name)
    if not m:
        return SourceInfo(root="", path=name, is_parameter=False, is_buffer=False, is_local_arg=False)
    root = m.group("root")
    rest = name[m.end():]
    parts: list[str] = [root]
    pos = 0
    while pos < len(rest):
        t = _TOKEN.match(rest, pos)
        if not t:  # unknown syntax (e.g. a call in the source); keep the remainder verbatim
            parts.append(rest[pos:].lstrip("."))
            break
        parts.append(t.group("key") or t.group("attr") or t.group("idx") or t.group("skey") or "")
        pos = t.end()
    return SourceInfo(
        root=root,
        path=".".join(p for p in parts if p),
        is_parameter="._parameters[" in rest,
        is_buffer="._buffers[" in rest,
        is_local_arg=not rest,
    )


#: a module reached through a wrapper's closure holding its original bound method (HF's tensor-parallel hooks replace
#: ``module.forward`` by a function closing over ``original_forward``): ``self_attn.forward.__closure__[2]
#: .cell_contents.__self__.o_proj`` is ``self_attn.o_proj``
_CLOSURE_SELF = re.compile(r"\.[A-Za-z_][A-Za-z0-9_]*\.__closure__\.\d+\.cell_contents\.__self__(?=\.|$)")


def stack_path(stack_key: str) -> str:
    """Full dotted path of an ``nn_module_stack`` key (``L['self'].model.layers[0]`` -> ``self.model.layers.0``)."""
    m = _ROOT.match(stack_key)
    if not m:
        return stack_key
    rest = re.sub(r"\[(\d+)\]", r".\1", stack_key[m.end():]).lstrip(".")
    rest = _CLOSURE_SELF.sub("", rest)
    return f"{m.group('root')}.{rest}" if rest else m.group("root")


def relative_path(path: str, model_root: str | None) -> str:
    """Express ``path`` relative to the model (``model.layers.0.mlp``); other objects keep their attribute path
    without the frame-variable name (``cache.layers.0.keys``)."""
    if model_root:
        if path == model_root:
            return ""
        if path.startswith(model_root + "."):
            return path[len(model_root) + 1:]
    head, _, tail = path.partition(".")
    return tail if tail else head


def layer_index(path: str | None) -> int | None:
    """Decoder layer index of a module path: the first integer component (``model.layers.3.mlp`` -> 3)."""
    if not path:
        return None
    for part in path.split("."):
        if _INT.match(part):
            return int(part)
    return None
