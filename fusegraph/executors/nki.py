"""Executors that run fused regions as generated NKI kernels and everything else eagerly.

``nkisim`` runs the kernels in fusegraph's CPU interpreter (the default without Trainium); ``neuron`` would run
them on a NeuronCore through ``nki.jit`` + torch-neuronx (see :mod:`.neuron`). Both share this class; only the
kernel runner differs.

Per call: eager ops before the kernel (rotary tables, the mask, cache positions), the kernel (one launch for the
decoder stack), eager ops after it. Model weights are converted to the kernel's layouts once and re-converted
only when a parameter's version counter changes. With ``verify`` on, a kernel's first call is checked against
the region's ATen ops on the same inputs; a mismatch disables that kernel with a warning and the step uses the
eager results, so it always returns correct values.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch

from ..program import Program
from ..program.execution import ExecutionRecord, KernelInfo, RegionRun
from ..settings import Settings
from ..warnings import one_line, warn
from ..codegen.registry import check as lowerable, is_host_side
from ..llm import enabled
from ..matching import analyze
from ..nkisim.torch_io import InterpretedKernel
from .base import RETIRE_AFTER_FAILURES, Runner, register_executor
from .eager import _resolver, build_plan, run_plan
from .kernel_args import kernel_args
from .kernel_cache import discard
from .kernels import FAILED, OK, RETRY, KernelPlan, agree, build_plans, covered_collectives, describe_disagreement
from .llm_fallback import IslandStep, bind_inlined, island_steps, plan_inline, run_island, write_islands
from .schedule import KernelSlot, build_schedule
from .state_journal import StateJournal
from .steps import build_steps
from .verify import state_copies, verification_problems

log = logging.getLogger(__name__)


class NkiExecutor:
    name = "nkisim"

    def make_runner(self, plan: KernelPlan, settings: Settings) -> Callable[..., list]:

        return InterpretedKernel(plan.generated, target=settings.target, filename=f"<fusegraph:{plan.generated.name}>",
                                 sbuf_budget=settings.sbuf_budget)

    def compile(self, program: Program, graph_index: int, settings: Settings) -> Runner:

        analysis = analyze(program, settings, lowerable=lowerable)
        analysis, written = plan_inline(program, graph_index, analysis, settings)  # LLM islands join regions
        plans = build_plans(program, graph_index, analysis, settings)
        ready: list[KernelPlan] = []
        for p in plans:
            try:
                p.runner = self.make_runner(p, settings)
                ready.append(p)
            except Exception as e:  # noqa: BLE001 - a kernel that does not load must not break the step
                if settings.pass_through_build_failures:
                    raise
                _discard_cached(p)
                warn(f"{p.label}: kernel failed to load ({one_line(e)}); it runs on the eager path")
        schedule, dropped = build_schedule(program, graph_index, [p.lowered.kernel_nodes for p in ready])
        for k in dropped:
            warn(f"{ready[k].label} is not convex (an op outside it both reads and feeds it); it runs on the eager path")
        active = [k for k in range(len(ready)) if k not in dropped]  # TP ranks agree on them: rank_agreement.py
        return _Run(self, program, graph_index, settings, ready, active, schedule, analysis, written)


class _Run:
    def __init__(self, executor: NkiExecutor, program: Program, graph_index: int, settings: Settings,
                 plans: list[KernelPlan], active: list[int], schedule: list, analysis: Any,
                 written: Sequence[Any] = ()) -> None:
        self.executor = executor
        self.program = program
        self.settings = settings
        self.plans = plans
        self.active = set(active)
        self.analysis = analysis
        self.program_graph = graph_index
        captured = program.captured(graph_index)
        self.input_ids = [i.node for i in captured.inputs]
        self.outputs = [_resolver(o) for o in captured.outputs]
        self.eager_all = build_plan(program, program.topo_order(graph_index))
        G = program.graph
        self._state_writers = {n for n in program.topo_order(graph_index) if G.nodes[n].get("writes_state")}
        #: each kernel's state-writing nodes in program order (what its journal saves before every launch)
        self._kernel_writers = {id(p): sorted((n for n in p.lowered.kernel_nodes if n in self._state_writers),
                                              key=lambda n: G.nodes[n]["order"]) for p in plans}
        self._failures: dict[int, int] = {id(p): 0 for p in plans}  # consecutive failing calls of each kernel
        while True:
            steps, missing = build_steps(program, graph_index, plans, self.active, schedule, self.input_ids)
            if missing is None:
                break
            k, node = missing
            self.active.discard(k)
            warn(f"{plans[k].label}: the value of {node} is needed outside the kernel but not produced by it; "
                 "it runs on the eager path")
        self.steps = steps
        self.islands = self._llm_islands(graph_index, written)
        if self.islands:
            self.steps = island_steps(self.steps, self.islands)
        self.last_args: list | None = None  # the latest call's inputs (for bisection tools)
        # what the report reads, kept current as kernels are verified, fail or trip their guards
        self.record = ExecutionRecord(graph=graph_index, executor=executor.name, llm=list(self.islands), run=self)
        self._region_runs = {id(p): _region_run(p, k in self.active) for k, p in enumerate(plans)}
        #: collective nodes each kernel issues: its outcomes are agreed with every rank of their groups
        self._collectives = {id(p): covered_collectives(program, p) for p in plans}
        self.record.regions = list(self._region_runs.values())
        program.execution[graph_index] = self.record

    def _llm_islands(self, graph_index: int, written: Sequence[Any] = ()) -> list:
        """Islands inlined in a running kernel, then the ops still left on the eager path offered to the LLM
        kernel writer (opt-in, see llm_fallback)."""

        if not enabled(self.settings):
            return []
        bind_inlined(written, self.plans, self.active, self.executor.name)
        covered = set()
        for k in self.active:
            covered |= set(self.plans[k].lowered.kernel_nodes)
        excluded = {n for m in self.analysis.matches if is_host_side(m.pattern.template) for n in m.nodes}
        rest = write_islands(self.program, graph_index, covered, excluded, self.settings, known=written)
        return [i for i in written if i.inlined] + rest

    def __call__(self, args: Sequence[Any]) -> list:
        self.last_args = list(args)
        env = dict(zip(self.input_ids, args))
        if any(not self.plans[s.index].disabled for s in self.steps if isinstance(s, KernelSlot)) or any(
                isinstance(s, IslandStep) and not s.island.disabled for s in self.steps):
            journal = StateJournal()
            try:
                env = self._run_with_kernels(env, journal)
            except Exception as e:  # noqa: BLE001 - the step's state goes back to the call's start, then eager
                journal.rollback()
                env = self._eager_after_failure(args, e)
        else:
            env = run_plan(self.eager_all, env)
        self.record.calls += 1
        return [o(env) for o in self.outputs]

    def _eager_after_failure(self, args: Sequence[Any], e: Exception) -> dict:
        """The fused call raised (a malformed input the eager fallback of a kernel also refused, say): with the state
        as it was at the start of the call, the whole graph runs eagerly in program order, so the result, the
        exception and the state writes before it are exactly eager's. A graph with collectives re-raises instead
        (re-running its collectives on this rank alone would pair them wrongly with its peers')."""
        if self.settings.pass_through_build_failures or self.program.collectives(self.program_graph):
            raise e
        log.debug("fused call failed; recomputing it eagerly from the call's initial state", exc_info=e)
        env = dict(zip(self.input_ids, args))
        run_plan(self.eager_all, env)  # raises eager's own error on a malformed input
        warn(f"graph {self.program_graph}: a fused call failed ({one_line(e)}); it was recomputed on the eager path")
        return env

    def _run_with_kernels(self, env: dict, journal: StateJournal) -> dict:
        launches = 0
        for step in self.steps:
            if isinstance(step, IslandStep):
                journal.save_nodes(self.program, step.island.nodes, env)
                if step.island.disabled or not run_island(step.island, env, self.program, self.settings):
                    run_plan(step.eager, env)
                else:
                    launches += 1
                continue
            if not isinstance(step, KernelSlot):
                n, target, a, kw = step
                if n in self._state_writers:
                    journal.save_node(self.program, n, env)
                env[n] = target(*a(env), **kw(env))
                continue
            plan = self.plans[step.index]
            if plan.disabled:
                self._eager_region(plan, env, journal)
                continue
            if self._run_kernel(plan, env, journal):
                launches += 1
        self.record.launches_per_call = launches
        return env

    def _run_kernel(self, plan: KernelPlan, env: dict, journal: StateJournal) -> bool:
        """One kernel slot of the schedule; True when the kernel was launched and ran to its end (its results are
        this call's, or a guard it raised sent the region to the eager path)."""
        if not plan.trusted and self.settings.verify:
            return self._verify(plan, env, journal)
        mine = self._journal_kernel(plan, env)
        if self._collectives[id(plan)]:
            return self._run_agreed(plan, env, mine, journal)
        try:
            results = self._launch(plan, env)
        except Exception as e:  # noqa: BLE001 - a kernel failing at a call falls back for that call
            mine.rollback()
            self._fail(plan, env, e, journal)
            return False
        self._failures[id(plan)] = 0
        if self._guard_tripped(plan, results):
            mine.rollback()
            self._eager_region(plan, env, journal)  # overwrites the kernel's outputs
        else:
            journal.extend(mine)
        return True

    def _journal_kernel(self, plan: KernelPlan, env: dict) -> StateJournal:
        """What the kernel's state writes will overwrite (rows of the KV caches at this step's positions)."""
        mine = StateJournal()
        for n in self._kernel_writers[id(plan)]:
            mine.save_node(self.program, n, env)
        return mine

    # ---- one kernel --------------------------------------------------------------------------------------
    def _launch(self, plan: KernelPlan, env: dict, state_override: dict | None = None) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        outs = plan.runner(kernel_args(plan, env, state_override))
        names = [v.name for v in plan.lowered.program.outputs]
        results = dict(zip(names, outs))
        if state_override is None:
            self._publish(plan, env, results)
        log.debug("%s ran in %.3f s", plan.label, time.perf_counter() - t0)
        return results

    def _publish(self, plan: KernelPlan, env: dict, results: dict) -> None:
        G = self.program.graph
        for name, node in plan.lowered.outputs.items():
            d = G.nodes[node]
            env[node] = results[name].reshape(d["shape"]).to(getattr(torch, d["dtype"]))
        for n in plan.lowered.kernel_nodes:
            st = G.nodes[n].get("writes_state")
            if st:
                env[n] = env[st]

    def _fail(self, plan: KernelPlan, env: dict, e: Exception, journal: StateJournal) -> None:
        """The kernel raised (at its verified first call or a later one: an out-of-range token id, a NaN router input
        the interpreter refuses as undefined behaviour): its state writes are already undone and this call runs the
        region eagerly (which raises eager's own error on a malformed input). Only a kernel that fails on
        :data:`RETIRE_AFTER_FAILURES` calls in a row is retired: one bad request must not cost every later one its
        kernel."""
        if self.settings.pass_through_build_failures:
            raise e
        log.debug("kernel failure", exc_info=e)
        if self._count_failure(plan, f"failed to run at call {self.record.calls + 1}: {one_line(e)}"):
            warn(f"{plan.label}: kernel failed at run time on {RETIRE_AFTER_FAILURES} calls in a row ({one_line(e)}); "
                 "it runs on the eager path from now on")
        else:
            warn(f"{plan.label}: kernel failed at run time ({one_line(e)}); this call runs it on the eager path")
        self._eager_region(plan, env, journal)

    def _count_failure(self, plan: KernelPlan, why: str) -> bool:
        """One more failing call of ``plan``; True when that retires it (see :data:`RETIRE_AFTER_FAILURES`)."""
        self._failures[id(plan)] += 1
        run = self._region_runs[id(plan)]
        run.failed_calls += 1
        if self._failures[id(plan)] < RETIRE_AFTER_FAILURES:
            return False
        self._disable(plan, why)
        return True

    def _guard_tripped(self, plan: KernelPlan, results: dict) -> bool:
        """Did the kernel flag this step as one it cannot compute like eager (see codegen.ir.Guard)? Then the
        caller undoes its state writes and recomputes the region eagerly, so the step's result and state are
        eager's."""
        tripped = plan.tripped_guards(results)
        if tripped:
            self._guard_rerun(plan, tripped[0])
        return bool(tripped)

    def _guard_rerun(self, plan: KernelPlan, why: str, every_rank: bool = False) -> None:
        """A guard (here or, agreed, on some rank) sent this call's region to the eager path: counted and warned."""
        self._region_runs[id(plan)].guard_reruns += 1
        warn(f"{plan.label}: {why}; steps where it happens are recomputed on the eager path"
             + (" on every rank" if every_rank else ""))

    def _eager_region(self, plan: KernelPlan, env: dict, journal: StateJournal) -> None:
        """Everything the kernel provides, computed eagerly: its nodes and its outputs (an output may be a glue
        view of a kernel value that is not itself a kernel node; the schedule takes it from the kernel)."""
        G = self.program.graph
        nodes = sorted(set(plan.lowered.kernel_nodes) | set(plan.lowered.outputs.values()),
                       key=lambda n: G.nodes[n]["order"])
        for n, target, a, kw in build_plan(self.program, nodes):
            if n in self._state_writers:
                journal.save_node(self.program, n, env)
            env[n] = target(*a(env), **kw(env))

    def _run_agreed(self, plan: KernelPlan, env: dict, mine: StateJournal, journal: StateJournal) -> bool:
        """A verified kernel that issues collectives: its outcome this call (ran / guard tripped / failed) is agreed
        with every rank of their groups, so all ranks recompute the region eagerly together (its eager ops run the
        same collectives) or none does: a rank left alone in a collective would wait for its peers. True when the
        kernel's results stand."""
        code, why = OK, ""
        try:
            results = self._launch(plan, env)
            tripped = plan.tripped_guards(results)
            if tripped:
                code, why = RETRY, tripped[0]
        except Exception as e:  # noqa: BLE001 - a kernel failing at a call falls back for that call, on every rank
            if self.settings.pass_through_build_failures:
                raise
            code, why = FAILED, f"kernel failed at call {self.record.calls + 1} ({one_line(e)})"
            log.debug("kernel failure", exc_info=e)
        worst, rows = agree(self.program, self._collectives[id(plan)], code, why)
        if worst != FAILED:
            self._failures[id(plan)] = 0
        if worst == OK:
            journal.extend(mine)
            return True
        mine.rollback()
        cause = describe_disagreement(rows)
        if worst == RETRY:
            self._guard_rerun(plan, cause, every_rank=True)
        elif self._count_failure(plan, f"failed on {cause}"):  # every rank counts the same agreed outcomes
            warn(f"{plan.label}: kernel failed on {cause} on {RETIRE_AFTER_FAILURES} calls in a row; every rank runs "
                 "it on the eager path from now on")
        else:
            warn(f"{plan.label}: kernel failed on {cause}; every rank runs this call on the eager path")
        self._eager_region(plan, env, journal)  # every rank: the same collectives, in program order
        return worst == RETRY

    def _verify(self, plan: KernelPlan, env: dict, journal: StateJournal) -> bool:
        """Run the kernel on copies of the state and the region eagerly on the real state; compare. A kernel that
        issues collectives agrees its outcome with every rank of their groups (see :meth:`_verify_agreed`). True
        when the kernel ran (its results equal eager's, which the step uses)."""
        copies = state_copies(plan, env)
        agreed = bool(self._collectives[id(plan)])
        try:
            results = self._launch(plan, env, state_override=copies)
        except Exception as e:  # noqa: BLE001 - a kernel that fails at run time falls back
            if not agreed or self.settings.pass_through_build_failures:
                self._fail(plan, env, e, journal)
                return False
            log.debug("kernel failure", exc_info=e)
            self._eager_region(plan, env, journal)
            self._verify_agreed(plan, FAILED, f"kernel failed to run at call {self.record.calls + 1} ({one_line(e)})")
            return False
        self._failures[id(plan)] = 0
        self._eager_region(plan, env, journal)
        if agreed:
            tripped = plan.tripped_guards(results)
            if tripped:
                self._verify_agreed(plan, RETRY, tripped[0])
                return True
        elif self._guard_tripped(plan, results):
            return True  # this step's kernel result is not comparable with eager's; verify on the next step
        problems = verification_problems(plan, results, copies, env, self.settings)
        if agreed:
            self._verify_agreed(plan, FAILED if problems else OK,
                                f"verification against eager failed ({problems[0]})" if problems else "")
        elif problems:
            self._disable(plan, "; ".join(problems[:3]))
            warn(f"{plan.label}: verification against eager failed ({problems[0]}); it runs on the eager path")
        else:
            plan.trusted = True
            self._region_runs[id(plan)].verification = "passed"
        return not plan.disabled

    def _verify_agreed(self, plan: KernelPlan, code: int, why: str) -> None:
        """This rank's verification outcome, agreed with every rank of the kernel's collective groups (the eager
        region already ran on every rank): the kernel is trusted only if it passed on all of them, disabled on all
        of them if it failed on any (one warning naming the rank and the cause), verified again next call if a
        guard tripped anywhere."""
        worst, rows = agree(self.program, self._collectives[id(plan)], code, why)
        if worst == OK:
            plan.trusted = True
            self._region_runs[id(plan)].verification = "passed"
            return
        cause = describe_disagreement(rows)
        if worst == RETRY:
            self._guard_rerun(plan, cause, every_rank=True)
            return
        self._disable(plan, f"failed on {cause}")
        warn(f"{plan.label}: verification failed on {cause}; every rank of its group runs it on the eager path")

    def _disable(self, plan: KernelPlan, why: str) -> None:
        """The region runs eagerly from now on: the plan, its record and the kernel cache all say so."""
        plan.disabled = True
        _discard_cached(plan)
        run = self._region_runs[id(plan)]
        run.disabled = True
        run.verification = why


def _region_run(plan: KernelPlan, scheduled: bool) -> RegionRun:
    """The execution record of a planned kernel (what the report shows of it)."""
    gen = plan.generated
    kernel = KernelInfo(name=gen.name, cache_hit=plan.cache_hit, codegen_seconds=plan.seconds,
                        lines=gen.stats.get("lines"), instructions=gen.stats.get("instructions"),
                        weight_chunks=gen.stats.get("chunks"), lnc=gen.stats.get("lnc", 1),
                        sbuf_peak_bytes=gen.budget.sbuf_peak, sbuf_budget_bytes=gen.budget.sbuf_budget)
    inside = frozenset(plan.lowered.kernel_nodes)
    return RegionRun(region_id=plan.region.id, kernel=kernel, kernel_nodes=inside,
                     host_nodes=frozenset(plan.region.nodes) - inside, scheduled=scheduled, disabled=plan.disabled)


def _discard_cached(plan: KernelPlan) -> None:
    """A kernel served by the disk cache that failed to load, run or verify is not served again."""
    if plan.cache_entry is not None:
        discard(plan.cache_entry)
        plan.cache_entry = None


def register() -> None:
    @register_executor("nkisim")
    def _make() -> NkiExecutor:
        return NkiExecutor()
