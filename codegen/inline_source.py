"""What a match of an op written outside fusegraph's templates carries: a verified NKI module inlined into the
megakernel (the LLM fallback's islands, ``fusegraph.patterns.llm_island``). A core type, so the executor that makes
such matches and the op that lowers them share it without importing each other."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class InlineSource:
    """What an ``llm_island`` match carries (``match.params["inline"]``), set by the executor.

    ``recheck(source)``: the writer's static checks on exactly this text (None: passes, else why not).
    ``reference``: the island's own ATen ops as a callable on tensors of the island's shapes (the reference VM's
    implementation of the op); its ``repr`` must be stable (it is part of the kernel cache key)."""

    source: str
    sha256: str  # of ``source`` when it passed verification
    entry: str  # the @nki.jit function of ``source``
    inputs: tuple[str, ...]  # program nodes, in the kernel's parameter order
    outputs: tuple[str, ...]  # program nodes, in the kernel's return order
    recheck: Callable[[str], str | None]
    reference: Any = None
    what: str = ""  # the island's ops, for comments and messages
