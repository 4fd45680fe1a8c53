"""``analyze(program, settings)``: canonicalize, match every registered pattern, form regions, explain the rest.

Deterministic for a given program and pattern set: every iteration is over sorted or topologically ordered nodes.
The program is never modified (matching runs on the canonical copy), so executors are unaffected.

``lowerable``: the caller's answer to "can this match be lowered?" (codegen's registry check,
:func:`fusegraph.codegen.registry.check`; matching never imports codegen). A match it refuses is logged as
``refuse_match`` with the reason and left out before regions form, so its ops fall back and the rest of its
region stays fused, in the dry-run report as in the executor, which passes the same hook.
"""
from __future__ import annotations

import gc
import logging
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from ..program import Program
from ..settings import Settings
from ..warnings import warn
from .canonicalize import LAYOUT_OPS, CanonicalView, canonicalize, is_glue
from .debug import closest_miss, explain_target
from .matcher import Candidate, Refusal, find_candidates, resolve_overlaps, to_match
from .pattern import REGISTRY, Pattern
from .reach import Reach, build_reach
from .regions import form_regions
from .results import Decision, Match, Region, Unmatched
from .trace import CompiledVariant, PatternTraceError, compile_pattern

log = logging.getLogger(__name__)
debug_log = logging.getLogger("fusegraph.matching.debug")


@dataclass
class Analysis:
    """Everything matching and region formation found for one program (see ``docs/report.md``)."""

    program: Program
    settings: Settings
    matches: list[Match]
    regions: list[Region]
    decisions: list[Decision]
    unmatched: list[Unmatched]
    region_of: dict[str, int]
    coverage: float  # fraction of the decoder layers' ATen ops inside regions
    coverage_by_layer: dict[int, float]
    coverage_all: float  # fraction of all ATen ops inside regions
    patterns: list[Pattern]
    pattern_errors: dict[str, str]
    disabled_patterns: dict[str, str]
    debug: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    view: CanonicalView | None = None
    reach: Reach | None = None
    variants: list[CompiledVariant] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)  # the accepted candidates (canonical node terms)
    refusals: list[Refusal] = field(default_factory=list)

    # ---- queries ----------------------------------------------------------------------------------------
    def pattern_counts(self, layer: int | None | str = "all") -> dict[str, int]:
        """Accepted matches per pattern, for one layer (``None``: outside layers) or all of them."""
        c = Counter(m.pattern.name for m in self.matches if layer == "all" or m.layer == layer)
        return dict(sorted(c.items()))

    def matches_of(self, pattern: str) -> list[Match]:
        return [m for m in self.matches if m.pattern.name == pattern]

    def region_of_node(self, node: str) -> Region | None:
        rid = self.region_of.get(node)
        return self.regions[rid] if rid is not None else None

    def fallback_segments(self) -> int:
        """Connected groups of ops outside regions (each is at least one launch on the fallback path)."""
        G = self.program.graph
        outside = [n for n, d in G.nodes(data=True) if d["kind"] == "op" and n not in self.region_of
                   and d["op"] not in ("aten.alias.default",)]
        if not outside:
            return 0
        import networkx as nx

        sub = G.subgraph(outside).to_undirected(as_view=True)
        return nx.number_connected_components(sub)

    @property
    def region_launches(self) -> int:
        """Kernels the regions take per step: one per graph each spans (fusegraph runs each graph of a step by
        itself, so a region across a graph break is cut there, :func:`fusegraph.matching.carve.in_graph`)."""
        return sum(max(1, len(r.graphs)) for r in self.regions)

    @property
    def boundaries_per_step(self) -> int:
        return self.region_launches + self.fallback_segments()

    def explain(self, target: str) -> list[str]:
        """Why ``target`` (a pattern name or a program node id) did or did not match."""
        if self.view is None or self.reach is None:
            return []
        return explain_target(self.view, self.reach, self.variants, target, self.candidates, self.refusals,
                              frozenset(self.settings.fallback_ops))


def program_float_dtypes(program: Program) -> set[str]:
    """The float dtypes a program computes in, plus float32 (bf16/fp16 models still have fp32 masks and tables)."""
    found = {"float32"}
    for _, d in program.graph.nodes(data=True):
        dt = d.get("dtype")
        for x in dt if isinstance(dt, tuple) else (dt,):
            if x in ("bfloat16", "float16"):
                found.add(x)
    return found


def _compile_all(patterns: list[Pattern], cache_dir: str = "off",
                 dtypes: set[str] | None = None) -> tuple[list[CompiledVariant], dict[str, str]]:
    variants: list[CompiledVariant] = []
    errors: dict[str, str] = {}
    for p in patterns:
        if p.disabled_reason:
            errors[p.name] = p.disabled_reason
            continue
        try:
            variants += compile_pattern(p, cache_dir, dtypes)
        except PatternTraceError as e:
            p.disabled_reason = str(e)
            errors[p.name] = str(e)
            warn(f"pattern {p.name!r} ({p.source}) could not be traced ({e}); continuing without it")
    return variants, errors


#: ``lowerable(match, program)``: None when the match can be lowered, else why not
Lowerable = Callable[[Match, Program], "str | None"]


def analyze(program: Program, settings: Settings | None = None, *, lowerable: Lowerable | None = None) -> Analysis:
    """Match, form regions and explain what is left, for one program (``lowerable``: see the module doc)."""
    # the analysis allocates many small objects and no cycles worth collecting mid-way: pausing the cyclic GC
    # keeps a 48-layer analysis from paying for full collections of everything the process holds
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _analyze(program, settings or Settings.from_options(), lowerable)
    finally:
        if was_enabled:
            gc.enable()


def _analyze(program: Program, settings: Settings, lowerable: Lowerable | None = None) -> Analysis:
    t0 = time.perf_counter()
    patterns = REGISTRY.patterns(settings.disabled_patterns)
    variants, errors = _compile_all(patterns, settings.cache_dir, program_float_dtypes(program))
    t1 = time.perf_counter()
    cv = canonicalize(program)
    reach = build_reach(cv)
    t2 = time.perf_counter()
    fallback = frozenset(settings.fallback_ops)
    disabled: dict[str, str] = {}
    candidates, refusals = find_candidates(cv, reach, variants, fallback, disabled)
    candidates = [c for c in candidates if c.pattern.name not in disabled]
    decisions: list[Decision] = []
    accepted = resolve_overlaps(cv, candidates, decisions)
    matches = [to_match(cv, c) for c in accepted]
    refused: dict[str, str] = {}  # original node -> why its match could not be lowered
    if lowerable is not None:
        keep = _lowerable(program, matches, lowerable, decisions, refused)
        kept = {id(m) for m in keep}
        accepted = [c for c, m in zip(accepted, matches) if id(m) in kept]
        matches = keep
    if settings.generic_lowering and matches:  # generic pieces complete a step the patterns anchor
        from .generic import generic_matches

        generic = generic_matches(program, cv, matches)
        matches += _lowerable(program, generic, lowerable, decisions, refused) if lowerable is not None else generic
    matches = sorted(matches, key=lambda m: (m.order, m.pattern.name))
    for i, m in enumerate(matches):
        m.id = i
    for r in _dedupe_refusals(cv, refusals):
        decisions.append(Decision("refuse_match", f"{r.variant.pattern.name}@{_first(cv, r.nodes)}",
                                  f"[{r.variant.name}] {r.reason}", nodes=tuple(sorted(r.nodes))))
    t3 = time.perf_counter()
    rr = form_regions(cv, reach, matches, settings, decisions)
    t4 = time.perf_counter()
    cov, by_layer, cov_all = _coverage(program, rr.region_of)
    analysis = Analysis(
        program=program, settings=settings, matches=matches, regions=rr.regions, decisions=decisions,
        unmatched=[], region_of=rr.region_of, coverage=cov, coverage_by_layer=by_layer, coverage_all=cov_all,
        patterns=patterns, pattern_errors=errors, disabled_patterns=dict(disabled), view=cv, reach=reach,
        variants=variants, candidates=accepted, refusals=refusals,
    )
    analysis.unmatched = _unmatched(analysis, {**refused, **rr.outside_reason})
    t5 = time.perf_counter()
    target = settings.match_debug or os.environ.get("FUSEGRAPH_MATCH_DEBUG", "")
    if target:
        for t in [x.strip() for x in target.split(",") if x.strip()]:
            lines = analysis.explain(t)
            analysis.debug += lines
            for line in lines:
                debug_log.warning("FUSEGRAPH_MATCH_DEBUG %s", line)
    analysis.timings = {"trace_patterns_s": t1 - t0, "canonicalize_s": t2 - t1, "match_s": t3 - t2,
                        "regions_s": t4 - t3, "explain_s": t5 - t4, "total_s": time.perf_counter() - t0}
    log.info("fusegraph analysis: %d matches, %d regions, coverage %.1f%% (%.2f s)", len(matches), len(rr.regions),
             100 * cov, analysis.timings["total_s"])
    for p, n in analysis.pattern_counts().items():
        log.info("  matched_count %s = %d", p, n)
    return analysis


def _lowerable(program: Program, matches: list[Match], lowerable: Lowerable, decisions: list[Decision],
               refused: dict[str, str]) -> list[Match]:
    """The matches ``lowerable`` accepts; each refusal is a ``refuse_match`` decision and the reason its ops
    carry in the report."""
    G = program.graph
    keep = []
    for m in matches:
        why = lowerable(m, program)
        if why is None:
            keep.append(m)
            continue
        first = min(m.nodes, key=lambda n: G.nodes[n]["order"]) if m.nodes else "?"
        decisions.append(Decision("refuse_match", f"{m.pattern.name}@{first}", f"cannot be lowered: {why}",
                                  nodes=tuple(sorted(m.nodes))))
        log.debug("refused %s@%s: cannot be lowered: %s", m.pattern.name, first, why)
        for n in m.nodes:
            refused.setdefault(n, f"{m.pattern.name} matched here but cannot be lowered: {why}")
    return keep


def _first(cv: CanonicalView, nodes) -> str:
    return min(nodes, key=lambda n: cv.data.nodes[n]["order"]) if nodes else "?"


def _dedupe_refusals(cv: CanonicalView, refusals: list[Refusal]) -> list[Refusal]:
    seen: set = set()
    out = []
    for r in refusals:
        key = (r.variant.pattern.name, r.nodes)
        if key in seen:
            continue
        seen.add(key)
        out.append(r)
    return sorted(out, key=lambda r: (min(cv.data.nodes[n]["order"] for n in r.nodes), r.variant.pattern.name))


def _coverage(program: Program, region_of: dict[str, int]) -> tuple[float, dict[int, float], float]:
    G = program.graph
    per_layer: dict[int, list[int]] = {}
    total = inside = 0
    for n, d in G.nodes(data=True):
        if d["kind"] != "op":
            continue
        total += 1
        hit = n in region_of
        inside += hit
        if d.get("layer") is not None:
            c = per_layer.setdefault(d["layer"], [0, 0])
            c[0] += hit
            c[1] += 1
    layer_in = sum(c[0] for c in per_layer.values())
    layer_total = sum(c[1] for c in per_layer.values())
    cov = layer_in / layer_total if layer_total else (inside / total if total else 1.0)
    return cov, {k: v[0] / v[1] for k, v in sorted(per_layer.items())}, (inside / total if total else 1.0)


_LAYER = re.compile(r"(?<=\.)\d+(?=\.|$)")


def _module_key(module: str | None) -> str | None:
    return _LAYER.sub("*", module) if module else module


def _unmatched(a: Analysis, region_reasons: dict[str, str]) -> list[Unmatched]:
    """Ops outside every region, grouped by (op, module with the layer index as *, reason)."""
    cv = a.view
    assert cv is not None and a.reach is not None
    G = a.program.graph
    fallback = frozenset(a.settings.fallback_ops)
    refused_at: dict[str, Refusal] = {}
    for r in sorted(a.refusals, key=lambda r: (-r.variant.pattern.priority, -len(r.nodes))):
        for n in r.nodes:
            refused_at.setdefault(n, r)
    miss_cache: dict[tuple, str] = {}
    groups: dict[tuple, list[str]] = {}
    for n in a.program.topo_order():
        d = G.nodes[n]
        if d["kind"] != "op" or n in a.region_of:
            continue
        reason = HOST_ARITHMETIC if is_host_arithmetic(d) else region_reasons.get(n)
        if reason is None:
            reason = _reason(a, cv, n, refused_at, miss_cache, fallback)
        key = (d["op"], _module_key(d.get("module")), reason)
        groups.setdefault(key, []).append(n)
    out = []
    for (op, module, reason), nodes in groups.items():
        layers = tuple(sorted({G.nodes[n]["layer"] for n in nodes if G.nodes[n].get("layer") is not None}))
        out.append(Unmatched(op=op, count=len(nodes), module=module, reason=reason, nodes=tuple(nodes), layers=layers))
    out.sort(key=lambda u: (-u.count, u.op, u.module or ""))
    return out


#: the reason of an op on Python numbers (see :func:`is_host_arithmetic`)
HOST_ARITHMETIC = "host arithmetic on Python numbers (a size or a position): no tensor, nothing to fuse"


def is_host_arithmetic(d: dict) -> bool:
    """An op of Python numbers (``_operator.add`` of a symbolic size and an int, say): no tensor in or out, the host
    computes it as it computes the step's launch arguments; not an op left to eager PyTorch."""
    return d.get("kind") == "op" and d.get("shape") is None and str(d.get("op", "")).startswith(("_operator.", "sym_"))


def _reason(a: Analysis, cv: CanonicalView, n: str, refused_at: dict[str, Refusal], cache: dict[tuple, str],
            fallback: frozenset[str]) -> str:
    from .matcher import _op_in

    G = a.program.graph
    d = G.nodes[n]
    if _op_in(d["op"], fallback):
        return "forced to fallback by the fallback_ops option"
    if is_host_arithmetic(d):
        return HOST_ARITHMETIC
    if n in cv.folded:
        src = cv.folded[n]
        return f"no-op ({d['op']}) on a value crossing a region boundary (its value is {src}'s)"
    c = cv.rep.get(n, n)
    if c in a.region_of:  # covered canonical node but this original node was not assigned (should not happen)
        return "folded layout op at a region boundary"
    if c in cv.data and is_glue(cv, c) and cv.data.nodes[c]["op"] in LAYOUT_OPS:
        return "layout op between unfused ops (no adjacent region to absorb it)"
    if c in cv.data and is_glue(cv, c):
        return "constant op whose users are not fused"
    if any(m for m in a.matches if c in m.mapping.values()):
        return "matched, but its region was not kept"
    r = refused_at.get(c)
    if r is not None:
        return f"{r.variant.pattern.name} matched here but was refused: {r.reason}"
    key = (cv.data.nodes[c]["op"], _module_key(d.get("module")))
    if key not in cache:
        v, text = closest_miss(cv, a.reach, a.variants, c, fallback)
        cache[key] = (f"no pattern matches; closest: {text}" if v is not None
                      else f"no registered pattern contains {d['op']}")
    return cache[key]
