"""Jinja2 rendering of the NKI templates in ``templates/`` (one per instruction kind)."""
from __future__ import annotations

import hashlib
import textwrap
from functools import lru_cache
from pathlib import Path

import jinja2
import torch

TEMPLATE_DIR = Path(__file__).parent / "templates"

NL_DTYPES = {
    torch.float32: "nl.float32",
    torch.bfloat16: "nl.bfloat16",
    torch.float16: "nl.float16",
    torch.int32: "nl.int32",
    torch.int16: "nl.int16",
    torch.int8: "nl.int8",
    torch.uint8: "nl.uint8",
}

ACTIVATIONS = {
    "silu": "nl.silu",
    "gelu": "nl.gelu",
    "gelu_tanh": "nl.gelu_apprx_tanh",
    "gelu_pytorch_tanh": "nl.gelu_apprx_tanh",
    "relu": "nl.relu",
    "sigmoid": "nl.sigmoid",
    "tanh": "nl.tanh",
}


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )


def render(template: str, indent: int = 0, **ctx) -> str:
    text = environment().get_template(template).render(**ctx)
    return textwrap.indent(text, " " * indent) if indent else text


def nl_dtype(dtype: torch.dtype) -> str:
    try:
        return NL_DTYPES[dtype]
    except KeyError:
        from .errors import CodegenError

        raise CodegenError(f"dtype {dtype} has no NKI equivalent in the templates") from None


def templates_hash() -> str:
    """Hash of every template file: part of the kernel cache key (a template change invalidates the cache)."""
    h = hashlib.sha256()
    for p in sorted(TEMPLATE_DIR.glob("*.j2")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    for p in sorted(Path(__file__).parent.glob("*.py")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]
