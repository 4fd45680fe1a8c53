"""What an executor did with one graph of the program: the typed record the fused-region report reads.

An executor that runs kernels fills one :class:`ExecutionRecord` per graph (``Program.execution[graph]``) when it
compiles the graph and keeps it current while the step runs: a kernel disabled by verification or by a failure
at some call, a guard that had a step recomputed eagerly, an LLM-written island that failed. The report reads
these records and nothing else of the executor, so the report depends on the program layer only, and the
executor's plans and runners can change shape without the report walking them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KernelInfo:
    """The generated kernel of one region, as the report lists it (``kernels[]`` in docs/report.md)."""

    name: str
    cache_hit: bool
    codegen_seconds: float
    lines: int | None
    instructions: int | None
    weight_chunks: int | None
    lnc: int
    sbuf_peak_bytes: int
    sbuf_budget_bytes: int | None


@dataclass
class RegionRun:
    """One region the executor built a kernel for, and what became of it."""

    region_id: int
    kernel: KernelInfo
    #: program ops computed inside the kernel
    kernel_nodes: frozenset[str] = frozenset()
    #: the region's other ops: small host-side inputs (rotary tables, masks) the region feeds the kernel by design
    host_nodes: frozenset[str] = frozenset()
    #: the kernel has its slot in the step's schedule (False: it was refused before the first call)
    scheduled: bool = False
    #: verification failed or the kernel failed on several calls in a row: the region runs eagerly from then on
    disabled: bool = False
    verification: str | None = None  # "passed", or why it failed; None until the first verified call
    guard_reruns: int = 0  # steps recomputed eagerly because the kernel's guard output was set
    failed_calls: int = 0  # calls on which the kernel failed at run time (that call ran the region eagerly)

    @property
    def runs_kernel(self) -> bool:
        """The kernel (not the eager ops) computes this region at the next call."""
        return self.scheduled and not self.disabled


@dataclass
class IslandRun:
    """A group of ops no pattern covers, offered to the LLM kernel writer (``llm_kernels[]`` in the report)."""

    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    ops: dict[str, int] = field(default_factory=dict)
    #: the writer's verdict as the report shows it (``WriterResult.to_dict()``); None until the writer answered
    llm: dict[str, Any] | None = None
    disabled: bool = False  # the accepted kernel failed at run time: the ops run eagerly from then on
    calls: int = 0  # steps the island's kernel computed

    @property
    def accepted(self) -> bool:
        return bool((self.llm or {}).get("accepted"))

    @property
    def runs_kernel(self) -> bool:
        return self.accepted and not self.disabled

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": list(self.nodes), "ops": dict(self.ops), "inputs": list(self.inputs),
                "outputs": list(self.outputs), "disabled": self.disabled, "llm": self.llm}


@dataclass
class ExecutionRecord:
    """One graph as an executor runs it: who computes each region, kernel launches per call, calls so far."""

    graph: int
    executor: str  # the executor's name ("nkisim", "neuron"): who runs a region whose kernel runs
    regions: list[RegionRun] = field(default_factory=list)
    llm: list[IslandRun] = field(default_factory=list)
    launches_per_call: int = 0  # kernels the latest call launched (regions + LLM islands)
    calls: int = 0
    #: the executor's own runner of the graph (its plans, the latest call's inputs), for tools that re-run a kernel
    #: (``fusegraph.executors.bisect``) and for tests; the report never reads it
    run: Any = field(default=None, repr=False, compare=False)

    @property
    def executed_by(self) -> dict[int, str]:
        """Region id -> who computes it now (the executor's name, or ``"eager"``)."""
        return {r.region_id: self.executor if r.runs_kernel else "eager" for r in self.regions}

    @property
    def verification(self) -> dict[int, str]:
        """Region id -> the verification outcome, for regions verified (or failed) so far."""
        return {r.region_id: r.verification for r in self.regions if r.verification is not None}

    @property
    def guard_reruns(self) -> dict[int, int]:
        """Region id -> steps recomputed eagerly because the kernel's guard was set (regions with any)."""
        return {r.region_id: r.guard_reruns for r in self.regions if r.guard_reruns}

    def region(self, region_id: int) -> RegionRun | None:
        return next((r for r in self.regions if r.region_id == region_id), None)

    def planned_launches(self) -> int:
        """Kernels a call would launch (before any call has run): running regions and accepted islands."""
        return sum(r.runs_kernel for r in self.regions) + sum(i.runs_kernel for i in self.llm)
