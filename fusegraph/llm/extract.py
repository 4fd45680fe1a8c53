"""Pull the kernel source out of a chat answer.

Models are asked for exactly one fenced ```python block. Answers in the wild add prose, several blocks, or
reasoning in ``<think>`` tags; the block that defines an ``@nki.jit`` function wins. An unfenced answer is only
accepted when the whole text is Python that mentions ``nki.jit`` (a model that forgot the fence), so prose
never reaches the parser as "code".
"""
from __future__ import annotations

import ast
import re

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.S)
_THINK = re.compile(r"<think>.*?</think>", re.S | re.I)


def extract_code(answer: str) -> str | None:
    """The kernel source in ``answer``, or None when it holds no code block."""
    text = _THINK.sub("", answer or "")
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(text)]
    blocks = [(lang, body) for lang, body in blocks if lang in ("", "python", "py", "python3") and body.strip()]
    if blocks:
        with_jit = [body for _, body in blocks if "nki.jit" in body]
        chosen = with_jit[0] if with_jit else max((body for _, body in blocks), key=len)
        return chosen.strip("\n") + "\n"
    stripped = text.strip()
    if "nki.jit" in stripped:
        try:
            ast.parse(stripped)
        except (SyntaxError, ValueError):
            return None
        return stripped + "\n"
    return None
