"""What the built-in op modules share: their template directory and the common ``tokens``/``check`` helpers."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import CodegenError

TEMPLATES = Path(__file__).parent / "templates"


def x_tokens(m: Any, graph: Any) -> int | None:
    """Tokens per step from the match's ``x`` input (``[B, 1, H]`` or ``[T, H]``); raises for a prefill step."""
    if "x" not in m.inputs:
        return None
    shape = graph.nodes[m.inputs["x"]]["shape"]
    if len(shape) == 3 and shape[1] != 1:
        raise CodegenError(f"a step over {shape[1]} positions is not a decode step (prefill runs eagerly)")
    return int(shape[0]) if len(shape) >= 2 else 1


def numel(shape: Any) -> int:
    n = 1
    for s in shape or ():
        n *= int(s)
    return n


def per_token_features(graph: Any, node: str, tokens: int | None) -> int | None:
    """Features per token of a program value, when the step's token count is known."""
    shape = graph.nodes[node].get("shape")
    if tokens is None or not isinstance(shape, tuple) or not shape:
        return None
    n = numel(shape)
    return n // tokens if n % tokens == 0 else None
