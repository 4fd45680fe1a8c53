"""Generic lowering as matches: connected unmatched elementwise/reduction ops become ``fusegraph.generic`` matches.

Without a pattern for a decoder variant's custom activation or norm, its ops would be blockers that split the
decoder-stack region (and the megakernel) in two. Codegen can lower elementwise chains and feature-axis
reductions without a pattern, so such pieces are offered to region formation like any other match, and the region
stays whole. Which ops qualify is :mod:`.generic_ops` (matching's own table; codegen translates the same ops).
The piece itself travels in ``params["piece"]``.
"""
from __future__ import annotations

from typing import Any

from ..program import Program
from .canonicalize import CanonicalView
from .generic_ops import find_pieces, piece_of
from .pattern import Pattern
from .results import Match


def _no_reference(*args: Any, **kwargs: Any) -> Any:  # the piece's own ATen ops are its reference
    raise NotImplementedError("a generic piece is verified against its own ATen ops")


GENERIC = Pattern(name="fusegraph.generic", fn=_no_reference, inputs=(), template="generic", priority=-1000,
                  description="generic lowering of unmatched elementwise chains and feature reductions",
                  source="fusegraph")
#: a generic piece of step metadata (positions, masks): computed on the host before the kernel (GenericPiece.host)
GENERIC_HOST = Pattern(name="fusegraph.generic_host", fn=_no_reference, inputs=(), template="generic_host",
                       priority=-1000, description="unmatched ops on step metadata (positions, masks), computed on "
                       "the host before the kernel", source="fusegraph")


def generic_matches(program: Program, cv: CanonicalView, matches: list[Match]) -> list[Match]:
    G = program.graph
    covered = set().union(*(m.nodes for m in matches)) if matches else set()
    # a node canonicalization folded into another (a functional copy that equals its source, a cat with one
    # non-empty operand) is that value, not an op to compute: region formation treats it as glue
    candidates = {n for n, d in G.nodes(data=True) if d["kind"] == "op" and n not in covered
                  and cv.rep.get(n, n) == n}
    out = []
    for piece in find_pieces(G, candidates):
        canon = {cv.rep.get(n, n) for n in piece.nodes}
        canon = {c for c in canon if c in cv.data}
        if not canon:
            continue
        order = min(G.nodes[n]["order"] for n in piece.nodes)
        out.append(Match(
            pattern=GENERIC_HOST if piece.host else GENERIC, variant="generic", nodes=frozenset(piece.nodes),
            # like pattern matches, name canonical nodes (a piece may end in an alias that canonicalization folded)
            inputs={f"in{i}": n for i, n in enumerate(_canonical(cv, piece.inputs))},
            outputs={f"out{i}": n for i, n in enumerate(_canonical(cv, piece.outputs))},
            params={"piece": piece, "ops": dict(piece.ops)}, layer=piece.layer, module=piece.module,
            mapping={f"n{i}": c for i, c in enumerate(sorted(canon))},
            graphs=tuple(sorted({G.nodes[n]["graph"] for n in piece.nodes})), order=order,
        ))
    return out


def as_generic(program: Program, m: Match) -> Match | None:
    """Match ``m``'s own ops as one ``fusegraph.generic`` match (None when it has none, or is one already): what
    the executor offers generic lowering when a pattern's lowering fails at build time, so a shape the pattern's
    template does not handle still runs in the kernel instead of on the eager path."""
    G = program.graph
    ops = [n for n in m.nodes if G.nodes[n].get("kind") == "op"]
    if not ops or m.pattern in (GENERIC, GENERIC_HOST):
        return None
    piece = piece_of(G, ops)
    return Match(
        pattern=GENERIC, variant="generic", nodes=frozenset(piece.nodes),
        inputs={f"in{i}": n for i, n in enumerate(piece.inputs)},
        outputs={f"out{i}": n for i, n in enumerate(piece.outputs)},
        params={"piece": piece, "ops": dict(piece.ops), "instead_of": m.pattern.name}, layer=m.layer,
        module=m.module, mapping={}, graphs=m.graphs, order=m.order,
    )


def _canonical(cv: CanonicalView, nodes: Any) -> list[str]:
    out: list[str] = []
    for n in nodes:
        c = cv.rep.get(n, n)
        if c in cv.data and c not in out:
            out.append(c)
    return out
