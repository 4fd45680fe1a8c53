"""Pattern matching and region formation over the program graph.

Public API (what plugin packages and codegen use):

* :func:`register_pattern`, :class:`Pattern`, :class:`Input`, :class:`Slot`, :data:`ACTIVATIONS` — write patterns;
* :func:`analyze` -> :class:`Analysis` with :class:`Match`, :class:`Region`, :class:`Decision`, :class:`Unmatched`;
* :func:`registered_patterns`, :func:`get_pattern`, :func:`unregister_pattern`, :data:`REGISTRY`.

Modules, one job each: ``pattern`` (API, registry, entry points), ``trace`` (function -> pattern graph),
``canonicalize`` (the analysis view), ``matcher`` (VF2 + validation + overlaps), ``reach`` (convexity bitsets),
``regions`` (merging + decision log), ``debug`` (why-not explanations), ``analyze`` (orchestration),
``generic_ops`` (what generic lowering computes, generic pieces), ``activations`` (the one activation table),
``carve`` (a region minus matches codegen failed on, as convex parts).
"""
from .analyze import Analysis, analyze
from .pattern import (ACTIVATIONS, ENTRY_POINT_GROUP, REGISTRY, Implementation, Input, Pattern, Slot, get_pattern,
                      register_pattern, registered_patterns, unregister_pattern)
from .results import Block, Boundary, Decision, Match, Region, Unmatched
from .trace import PatternTraceError, compile_pattern

__all__ = [
    "ACTIVATIONS", "ENTRY_POINT_GROUP", "REGISTRY", "Analysis", "Block", "Boundary", "Decision", "Implementation",
    "Input", "Match", "Pattern", "PatternTraceError", "Region", "Slot", "Unmatched", "analyze", "compile_pattern",
    "get_pattern", "register_pattern", "registered_patterns", "unregister_pattern",
]
