"""Jinja2 rendering of the NKI templates, from a search path of template directories.

The kernel's frame (header, signature, weight-chunk DMAs) and the templates every op shares (loads, stores,
guards, expressions) live in ``codegen/templates``; each op, built-in or plugin, adds its own folder's
``templates/`` (:func:`add_template_dir`, or ``register_lowering(..., template_dir=...)``). Directories are
searched in that order (the built-in op folders load before entry-point plugins), so a plugin cannot silently
replace a built-in template (a shadowed name is logged). :func:`fusegraph.codegen.registry.templates_hash` covers every
directory and the code of every lowering, so the kernel cache follows a plugin's templates and code too.
"""
from __future__ import annotations

import hashlib
import logging
import textwrap
import threading
from pathlib import Path
from typing import Any

import jinja2
import torch

from fusegraph.matching.activations import ALIASES, TABLE

log = logging.getLogger(__name__)

CODEGEN_DIR = Path(__file__).parent
TEMPLATE_DIR = CODEGEN_DIR / "templates"  # the kernel's frame and the shared templates
BUILTIN_DIRS = (TEMPLATE_DIR,)

NL_DTYPES = {
    torch.float32: "nl.float32",
    torch.bfloat16: "nl.bfloat16",
    torch.float16: "nl.float16",
    torch.int32: "nl.int32",
    torch.int16: "nl.int16",
    torch.int8: "nl.int8",
    torch.uint8: "nl.uint8",
}

#: slot activation name -> NKI function (from the one activation table, :mod:`fusegraph.matching.activations`)
ACTIVATIONS = {a.name: f"nl.{a.nki}" for a in TABLE if a.slot}
ACTIVATIONS.update({alias: ACTIVATIONS[name] for alias, name in ALIASES.items()})

_LOCK = threading.Lock()
_PLUGIN_DIRS: list[Path] = []
_ENV: dict[tuple[Path, ...], jinja2.Environment] = {}


def template_dirs() -> tuple[Path, ...]:
    """The search path: the core directory, then the ops' directories in registration order."""
    return BUILTIN_DIRS + tuple(_PLUGIN_DIRS)


def add_template_dir(path: Path) -> None:
    """Append an op's template directory to the search path (idempotent). A template name that an earlier
    directory already has is shadowed by it (logged)."""
    path = Path(path).resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"template directory {path} does not exist")
    with _LOCK:
        if path in _PLUGIN_DIRS or path in BUILTIN_DIRS:
            return
        known = {p.name for d in template_dirs() for p in d.glob("*.j2")}
        for p in sorted(path.glob("*.j2")):
            if p.name in known:
                log.warning("template %s in %s is shadowed by an earlier template directory", p.name, path)
        _PLUGIN_DIRS.append(path)


def environment() -> jinja2.Environment:
    dirs = template_dirs()
    env = _ENV.get(dirs)
    if env is None:
        env = jinja2.Environment(
            loader=jinja2.FileSystemLoader([str(d) for d in dirs]),
            trim_blocks=True,
            lstrip_blocks=True,
            keep_trailing_newline=True,
            undefined=jinja2.StrictUndefined,
        )
        _ENV[dirs] = env
    return env


def render(template: str, indent: int = 0, **ctx: Any) -> str:
    text = environment().get_template(template).render(**ctx)
    return textwrap.indent(text, " " * indent) if indent else text


def expr(template: str, macro: str, **ctx: Any) -> str:
    """An NKI expression (an access pattern, a slice) from a macro of ``template`` (e.g. ``exprs.j2``)."""
    return str(getattr(environment().get_template(template).module, macro)(**ctx))


def nl_dtype(dtype: torch.dtype) -> str:
    try:
        return NL_DTYPES[dtype]
    except KeyError:
        from .errors import CodegenError

        raise CodegenError(f"dtype {dtype} has no NKI equivalent in the templates") from None
