"""The lowering registry: which function lowers a pattern's matches to kernel instructions, by template name.

A pattern names a ``template`` (``register_pattern(..., template="rmsnorm")``); a *lowering* registered for that
name turns each match into instructions (:class:`~.lowering.Lowerer` is its API). Built-in ops register here
exactly like a plugin does, from their own folder ``fusegraph.patterns.<op>`` (docs/patterns.md), given the
pattern objects they lower (so the names a lowering reads are checked at import, :mod:`.contract`)::

    @register_lowering(l2norm_pattern, template_dir=Path(__file__).parent / "templates")
    def lower(L, m):
        x = L.act(L.input(m, "x"), L.views(m, "x"))
        L.emit(L2Norm(x=x, weight=L.hbm(L.input(m, "weight")), out=L.new_act(L.output(m), L.label(m))), m)

Options: ``host_side=True`` (the matches stay on the eager path and feed the kernel as per-step inputs: rotary
tables, masks, cache positions), ``tokens=fn(match, graph)`` (how a match sizes the decode step: tokens per
step, or None), ``check=fn(match, graph, tokens)`` (a cheap, match-local lowerability test run at region
formation: True/None accepts, a string refuses with that reason), ``template_dir`` (Jinja2 templates of the
op, added to the search path), ``instructions`` (the instruction classes it emits, for tooling).

A template without a lowering is lowered *generically* (its traced body: elementwise chains, feature reductions,
LayerNorm without affine) when every op of the match is supported; :func:`check` is the hook region formation
calls (``analyze(program, settings, lowerable=check)``) so a match that cannot be lowered is refused there, with
its reason, instead of sending its whole region to the eager path at codegen time.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import logging
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from fusegraph.matching.pattern import REGISTRY

from . import render
from .contract import check_contract
from .errors import CodegenError

log = logging.getLogger(__name__)

CheckResult = bool | str | None


@dataclass
class Lowering:
    """One registered lowering (see the module docstring)."""

    templates: tuple[str, ...]
    lower: Callable[[Any, Any], None]
    host_side: bool = False
    tokens: Callable[[Any, Any], int | None] | None = None
    check: Callable[[Any, Any, int | None], CheckResult] | None = None
    instructions: tuple[type, ...] = ()
    template_dir: Path | None = None
    source: str = ""  # the module that registered it
    patterns: tuple[Any, ...] = ()  # the pattern objects it was registered with (the typed contract)

    def refusal(self, match: Any, graph: Any, tokens: int | None) -> str | None:
        """Why this lowering cannot take ``match`` (None: it can, as far as a match-local check tells)."""
        if self.check is None:
            return None
        result = self.check(match, graph, tokens)
        if result is True or result is None:
            return None
        return str(result) if result is not False else f"{self.source} refuses this match"


_LOCK = threading.RLock()
_LOWERINGS: dict[str, Lowering] = {}
_INSTRUCTIONS: dict[str, type] = {}
_BUILTINS_LOADED = False


def ensure_builtins() -> None:
    """Import the built-in ops (each module registers itself); idempotent."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    with _LOCK:
        if not _BUILTINS_LOADED:
            _BUILTINS_LOADED = True
            # by name, not by import statement: the built-in ops import this module (they register here exactly
            # like a plugin does), so the core never depends on them; the generic (body) lowering is core
            for name in BUILTIN_MODULES:
                importlib.import_module(name)
            REGISTRY.ensure_builtins_loaded()  # the op folders: through matching's loader (patterns and lowerings)


#: what :func:`ensure_builtins` imports before the built-in op folders: the core's generic (body) lowering
BUILTIN_MODULES = ("fusegraph.codegen.elementwise",)
_BODY: list[Lowering] = []  # the lowering of a match whose template has no lowering (its traced body)
_SERVICES: dict[str, Callable[..., Any]] = {}


def register_body_lowering(lower: Callable[[Any, Any], None], *, tokens: Callable[[Any, Any], int | None],
                           check: Callable[[Any, Any, int | None], CheckResult]) -> None:
    """Register what lowers a match whose template has no lowering (the core's generic body lowering registers
    itself here, so the registry, the region lowering and the lowerability check need not import it)."""
    with _LOCK:
        _BODY[:] = [Lowering(templates=(), lower=lower, tokens=tokens, check=check,
                             source=getattr(lower, "__module__", "") or "")]


def body_lowering() -> Lowering:
    """The generic lowering of a match's traced body (see :func:`register_body_lowering`)."""
    ensure_builtins()
    if not _BODY:
        raise CodegenError("no body lowering is registered (fusegraph.codegen.elementwise did not load)")
    return _BODY[0]


_OPTIONS: dict[str, Callable[[Any], contextlib.AbstractContextManager]] = {}


def register_codegen_options(name: str, enter: Callable[[Any], contextlib.AbstractContextManager]) -> None:
    """An op's codegen options: ``enter(settings)`` is a context manager under which kernels are generated with
    the op's settings-derived switches (attention's ``attn_*``). The executors enter every registered one around a
    build (:func:`codegen_options`) without knowing which ops have options."""
    with _LOCK:
        _OPTIONS[name] = enter


@contextlib.contextmanager
def codegen_options(settings: Any) -> Iterator[None]:
    """Inside the ``with``, kernels are generated with every op's options taken from ``settings``."""
    ensure_builtins()
    with _LOCK:
        entries = list(_OPTIONS.values())
    with contextlib.ExitStack() as stack:
        for enter in entries:
            stack.enter_context(enter(settings))
        yield


def provide(service: str, fn: Callable[..., Any]) -> None:
    """An op offers ``fn`` as ``service`` to the core's generic lowering, which names what it needs ("projection":
    a matmul of an activation by a weight), never the op that provides it."""
    with _LOCK:
        _SERVICES[service] = fn


def service(name: str) -> Callable[..., Any]:
    """The function an op provides as ``name``; raises :class:`CodegenError` when no loaded op provides it."""
    ensure_builtins()
    fn = _SERVICES.get(name)
    if fn is None:
        raise CodegenError(f"no loaded op provides {name!r}")
    return fn


def register_lowering(*targets: Any, host_side: bool = False,
                      tokens: Callable[[Any, Any], int | None] | None = None,
                      check: Callable[[Any, Any, int | None], CheckResult] | None = None,
                      template_dir: str | Path | None = None, instructions: Iterable[type] = (),
                      replace: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: register ``lower(L, match)`` for ``targets``: the pattern objects it lowers (their templates;
    the names the lowering, ``check`` and ``tokens`` read from a match are checked against what the patterns
    declare, now, by :func:`~.contract.check_contract`) or bare template names (not checked; see the module doc).

    A template already lowered by another module is kept (one warning) unless ``replace=True``; the same module
    registering again (a plugin re-imported) replaces its own entry. Returns the function unchanged, so several
    decorators may stack on one function (with different ``tokens``/``check`` per template)."""
    if not targets:
        raise TypeError("register_lowering needs at least one pattern (or template name)")
    patterns = [t for t in targets if not isinstance(t, str)]
    bad = [t for t in patterns if not isinstance(getattr(t, "template", None), str) or not t.template]
    if bad:
        raise TypeError(f"register_lowering takes patterns (with a template) or template names, not {bad[0]!r}")
    templates = tuple(dict.fromkeys(t if isinstance(t, str) else t.template for t in targets))
    if template_dir is not None:
        add_template_dir(template_dir)
    classes = tuple(instructions)

    def deco(fn: Callable) -> Callable:
        source = getattr(fn, "__module__", "") or ""
        if patterns:  # the typed contract: what the lowering reads, checked now (at import), not per decode step
            check_contract((fn, check, tokens), patterns)
        entry = Lowering(templates=tuple(templates), lower=fn, host_side=host_side, tokens=tokens, check=check,
                         instructions=classes, template_dir=Path(template_dir) if template_dir else None,
                         source=source, patterns=tuple(patterns))
        with _LOCK:
            for t in templates:
                old = _LOWERINGS.get(t)
                if old is not None and old.source != source and not replace:
                    from fusegraph.warnings import warn

                    warn(f"lowering of template {t!r} from {source} ignored: {old.source} already lowers it "
                         "(pass replace=True to override)")
                    continue
                _LOWERINGS[t] = entry
                log.debug("registered lowering %s (%s)", t, source)
            for cls in classes:
                register_instruction(cls)
        return fn

    return deco


def register_instruction(cls: type) -> type:
    """Record an instruction class by name (``ir.<Name>`` resolves it; tooling lists every op). Decorator."""
    with _LOCK:
        _INSTRUCTIONS[cls.__name__] = cls
    return cls


def unregister_lowering(template: str) -> Lowering | None:
    """Forget the lowering of ``template`` (and its instruction classes once no template uses it)."""
    with _LOCK:
        low = _LOWERINGS.pop(template, None)
        if low is not None and all(other is not low for other in _LOWERINGS.values()):
            for cls in low.instructions:
                if _INSTRUCTIONS.get(cls.__name__) is cls:
                    del _INSTRUCTIONS[cls.__name__]
        return low


def lowering_for(template: str) -> Lowering | None:
    """The lowering registered for ``template`` (None: the match is lowered generically, if it can be)."""
    ensure_builtins()
    return _LOWERINGS.get(template)


def lowerings() -> dict[str, Lowering]:
    """Template name -> lowering, for every registered template."""
    ensure_builtins()
    with _LOCK:
        return dict(_LOWERINGS)


def instruction_class(name: str) -> type | None:
    ensure_builtins()
    return _INSTRUCTIONS.get(name)


def instruction_classes() -> dict[str, type]:
    ensure_builtins()
    with _LOCK:
        return dict(_INSTRUCTIONS)


def is_host_side(template: str) -> bool:
    """Do matches of ``template`` stay on the eager path by design (rotary tables, masks, positions)?"""
    low = lowering_for(template)
    return bool(low and low.host_side)


def host_side_templates() -> set[str]:
    return {t for t, low in lowerings().items() if low.host_side}


def supported_templates() -> set[str]:
    return set(lowerings())


class NotADecodeStep(CodegenError):
    """Nothing in the matches sizes a decode step (no embedding, norm or projection): bare arithmetic."""


def sized_tokens(matches: Iterable[Any], graph: Any) -> int | None:
    """Tokens per step from the first of ``matches`` whose lowering sizes it; None when none does (a graph of
    bare arithmetic is not a decode step). Raises :class:`CodegenError` where a sizer finds the step is not a
    one-position decode step."""
    for m in matches:
        low = lowering_for(m.pattern.template)
        # a match lowered from its body sizes the step from its first activation input
        sizer = (body_lowering() if low is None else low).tokens
        t = sizer(m, graph) if sizer is not None else None
        if t is not None:
            return int(t)
    return None


def step_tokens(matches: Iterable[Any], graph: Any) -> int:
    """Tokens per step (the batch of a decode step), from the first match whose lowering sizes it (``tokens=``; a
    match lowered from its body: its first activation input); raises :class:`CodegenError` when none does or the
    step is not a one-position decode step."""
    matches = list(matches)
    t = sized_tokens(matches, graph)
    if t is not None:
        return t
    names = ", ".join(sorted({m.pattern.name.split(".")[-1] for m in matches}))
    raise NotADecodeStep(f"a fragment without an embedding, norm or projection to size the decode step from "
                       f"({names}) is not lowered")


# ---- the lowerability hook region formation calls -----------------------------------------------------------
_TOKENS_HINT: "weakref.WeakKeyDictionary[Any, tuple[int, int | None]]" = weakref.WeakKeyDictionary()


def tokens_hint(graph: Any) -> int | None:
    """The decode step's tokens as far as the graph alone tells (an embedding's ``[B, 1]`` indices), for
    match-local checks before any region exists; None when it does not tell."""
    size = graph.number_of_nodes()
    cached = _TOKENS_HINT.get(graph)
    if cached is not None and cached[0] == size:
        return cached[1]
    found: int | None = None
    for _, d in graph.nodes(data=True):
        if d.get("op") == "aten.embedding.default":
            idx = d["args"][1] if len(d.get("args", ())) > 1 else None
            shape = graph.nodes[idx.node].get("shape") if hasattr(idx, "node") else None
            if isinstance(shape, tuple) and len(shape) == 2 and int(shape[1]) == 1:
                found = int(shape[0])
            break
    _TOKENS_HINT[graph] = (size, found)
    return found


def check(match: Any, program: Any) -> str | None:
    """The lowerability hook for ``analyze(..., lowerable=check)``: None when codegen can lower ``match``, else
    why not. A registered lowering answers with its own ``check``; a template nobody lowers is accepted when its
    body can be lowered generically."""
    graph = program.graph
    low = lowering_for(match.pattern.template)
    tokens = tokens_hint(graph)
    if low is not None:
        try:
            return low.refusal(match, graph, tokens)
        except Exception as e:  # noqa: BLE001 - a buggy plugin check refuses its match, it does not break analysis
            from fusegraph.warnings import one_line

            return f"the lowering's check raised {one_line(e)}"
    why = body_lowering().refusal(match, graph, tokens)
    if why is None:
        return None
    return (f"no lowering is registered for template {match.pattern.template!r} and its body cannot be lowered "
            f"generically: {why}")


def add_template_dir(path: str | Path) -> None:
    """Add a directory of Jinja2 templates to the search path (built-in directories are searched first)."""
    render.add_template_dir(Path(path))


def templates_hash() -> str:
    """Hash of every template file of the search path, the codegen modules, the built-in op folders and the
    plugins' lowering code: part of the kernel cache key (a template or lowering change invalidates the cache)."""
    h = hashlib.sha256()
    for d in render.template_dirs():
        for p in sorted(d.glob("*.j2")):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    roots = [render.CODEGEN_DIR] + builtin_op_dirs()
    for root in roots:
        for p in sorted(root.rglob("*.py")):
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    for p in lowering_sources():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def builtin_op_dirs() -> list[Path]:
    """The folders of the built-in ops (``fusegraph.patterns``, found by name: the core does not import them)."""
    spec = importlib.util.find_spec("fusegraph.patterns")
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []


def lowering_sources() -> list[Path]:
    """Source files of every registered lowering and instruction outside this package (plugins): part of the
    kernel cache key, so a plugin's code change invalidates its cached kernels."""
    here = Path(__file__).resolve().parent
    files: set[Path] = set()
    for obj in [low.lower for low in lowerings().values()] + list(instruction_classes().values()):
        try:
            f = inspect.getsourcefile(obj)
        except (TypeError, OSError):
            f = None
        if f and here not in Path(f).resolve().parents:
            files.add(Path(f).resolve())
    return sorted(files)


__all__ = [
    "Lowering", "add_template_dir", "body_lowering", "builtin_op_dirs", "check", "codegen_options",
    "ensure_builtins", "host_side_templates", "instruction_class", "instruction_classes", "is_host_side",
    "lowering_for", "lowering_sources", "lowerings", "provide", "register_body_lowering",
    "register_codegen_options", "register_instruction", "register_lowering", "service", "sized_tokens", "step_tokens", "NotADecodeStep",
    "supported_templates", "templates_hash", "tokens_hint", "unregister_lowering",
]
