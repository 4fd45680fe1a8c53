"""Launching a kernel: argument binding, programs/ranks as threads, outputs and the profile.

``run(kernel, *args, lnc=1, target=None, shape_only=False, assume=None, **kwargs)`` is the explicit entry
point; calling an ``@nki.jit`` kernel (or ``kernel[2]``) goes through :func:`launch`.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from . import dtypes as dt
from . import profile as prof
from .context import ProgramContext, RunState, activate, session_target
from .enums import MemoryRegion
from .errors import NkiSimError, NkiSyncError, NkiUsageError, NkiValidationError
from .loops import check_closed
from .storage import Abstract, Storage, wrap_array
from .sync import SyncHub
from . import transport as transport_mod
from .memory import resolve_sbuf_overflow
from .targets import get_target, resolve_sbuf_budget
from .tensor import NkiTensor

log = logging.getLogger(__name__)

ENV_BACKEND = "FUSEGRAPH_NKISIM_BACKEND"


@dataclass
class _ArgBinding:
    """Kernel arguments of one rank, wrapped as NkiTensors, plus what to copy back afterwards."""

    args: list[Any]
    kwargs: dict[str, Any]
    copy_back: list[tuple[Any, Storage]] = field(default_factory=list)
    storages: list[Storage] = field(default_factory=list)
    origins: dict[int, np.ndarray] = field(default_factory=dict)  # storage id -> caller's numpy array


def _torch_to_numpy(x: Any) -> tuple[np.ndarray, bool]:
    """(numpy array, aliases the tensor's memory)."""
    import torch

    t = x.detach()
    if t.device.type != "cpu":
        return t.cpu().numpy(), False
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16), True
    return t.numpy(), True


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach") and hasattr(x, "dtype")


def _wrap_value(x: Any, label: str, buffer: MemoryRegion, shape_only: bool, b: _ArgBinding, program: int) -> Any:
    if isinstance(x, NkiTensor):
        return x
    if isinstance(x, Abstract):
        if not shape_only:
            raise NkiUsageError(f"argument {label} is an Abstract (no data); pass shape_only=True", rule="args")
        st = Storage(x.shape, x.dtype, buffer, buf=None, name=label, label=label, kind="input", program=program)
        b.storages.append(st)
        return NkiTensor.full(st)
    arr = None
    host_alias = True
    if isinstance(x, np.ndarray):
        arr = x
    elif _is_torch(x):
        arr, host_alias = _torch_to_numpy(x)
    if arr is not None:
        d = dt.get(arr.dtype)
        if arr.ndim == 0:
            raise NkiUsageError(f"argument {label} is a 0-d array; pass a Python scalar or a 1-element array",
                                rule="args")
        if shape_only:
            buf, aliased = None, True
        else:
            buf, aliased = wrap_array(arr)
        st = Storage(tuple(arr.shape), d, buffer, buf=buf, name=label, label=label, kind="input", program=program)
        b.storages.append(st)
        if not shape_only and not (aliased and host_alias):
            b.copy_back.append((x, st))
        if isinstance(x, np.ndarray) and not shape_only:
            b.origins[st.id] = x
        return NkiTensor.full(st)
    if isinstance(x, (list, tuple)) and any(isinstance(v, (np.ndarray, Abstract)) or _is_torch(v) for v in x):
        vals = [_wrap_value(v, f"{label}[{i}]", buffer, shape_only, b, program) for i, v in enumerate(x)]
        return type(x)(vals) if isinstance(x, tuple) else vals
    return x


def _bind(func: Callable[..., Any], args: tuple, kwargs: dict, buffer: MemoryRegion, shape_only: bool) -> _ArgBinding:
    try:
        sig = inspect.signature(func)
        bound = sig.bind(*args, **kwargs)
        names = {id(v): n for n, v in bound.arguments.items()}
    except (TypeError, ValueError):
        names = {}
    b = _ArgBinding([], {})
    for i, a in enumerate(args):
        b.args.append(_wrap_value(a, names.get(id(a), f"arg{i}"), buffer, shape_only, b, 0))
    for k, v in kwargs.items():
        b.kwargs[k] = _wrap_value(v, k, buffer, shape_only, b, 0)
    return b


def _copy_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def cp(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return v.copy()
        if _is_torch(v):
            return v.clone()
        if isinstance(v, (list, tuple)):
            return type(v)(cp(x) for x in v)
        return v

    return tuple(cp(a) for a in args), {k: cp(v) for k, v in kwargs.items()}


def _check_outputs(result: Any, func: Callable[..., Any], kernel_loc: str) -> list[NkiTensor]:
    outs = list(result) if isinstance(result, (tuple, list)) else ([] if result is None else [result])
    tensors = []
    for i, t in enumerate(outs):
        if not isinstance(t, NkiTensor):
            raise NkiValidationError(
                f"kernel {func.__name__} returned a {type(t).__name__} as output {i}; kernels return NKI tensors "
                f"allocated with buffer=nl.shared_hbm (or an input tensor)",
                rule="kernel-output",
                location=kernel_loc,
            )
        st = t._st
        if st.kind != "input" and st.buffer is not MemoryRegion.shared_hbm:
            raise NkiValidationError(
                f"kernel {func.__name__} returns tensor '{st.label}' in {st.buffer.name}; kernel outputs must be "
                f"allocated with buffer=nl.shared_hbm (SDK 2.29) or be an input tensor",
                rule="kernel-output",
                location=kernel_loc,
            )
        if t._ind is not None or t._offset != 0 or t.size * t.dtype.itemsize != st.nbytes:
            raise NkiValidationError(
                f"kernel {func.__name__} returns a partial view of '{st.label}'; return the whole tensor",
                rule="kernel-output",
                location=kernel_loc,
            )
        tensors.append(t)
    return tensors


def _to_host(t: NkiTensor, shape_only: bool) -> Any:
    st = t._st
    if shape_only or st.abstract:
        return Abstract(t.shape, t.dtype)
    from .access import np_view

    return np_view(t)


def _resolve_backend(backend: str | None) -> str:
    b = backend or os.environ.get(ENV_BACKEND) or "fusegraph"
    if b not in ("fusegraph", "official", "neuron"):
        raise NkiUsageError(f"unknown backend {b!r}; expected 'fusegraph', 'official' or 'neuron'", rule="args")
    return b


def run(
    kernel: Any,
    *args: Any,
    lnc: int = 1,
    target: Any = None,
    shape_only: bool = False,
    assume: Any = None,
    ranks: int = 1,
    rank_args: list[tuple] | None = None,
    sbuf_budget: int | None = None,
    backend: str | None = None,
    max_records: int = prof.DEFAULT_MAX_RECORDS,
    trace: bool = False,
    trace_layer: str | None = None,
    process_group: Any = None,
    sbuf_overflow: str | None = None,
    **kwargs: Any,
) -> Any:
    """Run an NKI kernel (``@nki.jit`` object or plain function) in the interpreter.

    ``lnc``: 1 or 2 programs (LNC=2 runs two threads sharing ``shared_hbm``).  ``target``: "trn2"/"trn3"
    (default: the kernel's / ``as_nki`` target, else ``NEURON_PLATFORM_TARGET_OVERRIDE``, else trn3 as in
    ``nki.simulate``).  ``shape_only``: no arithmetic, same checks and counters; args may be :class:`Abstract`.
    ``assume``: data-dependent indices for shape-only runs (see :mod:`fusegraph.nkisim.assume`).  ``ranks``:
    simulate N ranks for ``nki.collectives`` (each rank gets a copy of the array args unless ``rank_args`` lists
    per-rank argument tuples); returns a list of per-rank outputs.  ``process_group``: a ``torch.distributed`` group
    whose processes each run their own rank (``rank_id()`` is the process's rank in it; collectives go over it);
    default: the job's default group when ``torch.distributed`` is initialized with several processes and
    ``ranks=1`` (``FUSEGRAPH_NKISIM_DIST=off`` disables that), else in-process ranks.
    ``sbuf_budget``: usable SBUF bytes per partition.  ``sbuf_overflow``: what live SBUF beyond it means --
    ``"error"`` (default; ``FUSEGRAPH_NKISIM_SBUF_OVERFLOW``) or ``"compiler"`` (accepted and recorded as
    ``Profile.sbuf_over_budget_bytes``, the way neuronx-cc's allocator fits compiler-placed tensors; see
    :mod:`fusegraph.nkisim.memory`).  ``backend="official"``: run through the real
    ``nki.simulate`` (only where the Neuron SDK is installed).  ``trace``: also record every instruction in program
    order with the tensors it read and wrote (``last_profile().trace``); ``trace_layer="function:variable"`` tags
    each event with that local of the kernel's call stack (a layer loop index).  Remaining keyword args go to the
    kernel.

    Returns the kernel's outputs as NumPy arrays (a tuple if the kernel returns a tuple); input arrays written
    by the kernel are updated in place.  :func:`fusegraph.nkisim.last_profile` gives the profile.
    """
    from .jit import Kernel, Launcher

    grid_ndim = 1 if lnc != 1 else 0
    if isinstance(kernel, Launcher):
        lnc, grid_ndim, kernel = kernel.lnc, 1, kernel.kernel
    if not isinstance(kernel, Kernel):
        if not callable(kernel):
            raise NkiUsageError(f"run() expects a kernel, got {kernel!r}", rule="args")
        kernel = Kernel(kernel)
    return launch(
        kernel, args, kwargs, lnc=lnc, grid_ndim=grid_ndim, target=target, shape_only=shape_only, assume=assume,
        ranks=ranks, rank_args=rank_args, sbuf_budget=sbuf_budget, backend=backend, max_records=max_records,
        trace=trace, trace_layer=trace_layer, process_group=process_group, sbuf_overflow=sbuf_overflow,
    )


def launch(
    kernel: Any,
    args: tuple,
    kwargs: dict,
    *,
    lnc: int = 1,
    grid_ndim: int = 0,
    target: Any = None,
    shape_only: bool = False,
    assume: Any = None,
    ranks: int = 1,
    rank_args: list[tuple] | None = None,
    sbuf_budget: int | None = None,
    backend: str | None = None,
    max_records: int = prof.DEFAULT_MAX_RECORDS,
    trace: bool = False,
    trace_layer: str | None = None,
    process_group: Any = None,
    sbuf_overflow: str | None = None,
) -> Any:
    """One launch of ``kernel`` (see :func:`run` for the arguments): validate, bind, run, collect, profile.

    The steps are separate functions and :class:`_Launch` methods so that each stage of a launch (where the
    ranks run, how arguments are bound, how outputs and the profile are gathered) reads on its own.
    """
    func = kernel.func
    be = _resolve_backend(backend)
    if be != "fusegraph":
        return _run_elsewhere(be, func, args, kwargs, lnc)
    if lnc not in (1, 2):
        raise NkiUsageError(f"lnc must be 1 or 2, got {lnc!r}", rule="lnc")
    if not isinstance(ranks, int) or ranks < 1:
        raise NkiUsageError(f"ranks must be a positive int, got {ranks!r}", rule="args")
    tgt = get_target(target or getattr(kernel, "default_target", None) or session_target())
    budget = resolve_sbuf_budget(tgt, sbuf_budget)
    overflow = resolve_sbuf_overflow(sbuf_overflow)
    code = getattr(func, "__code__", None)
    kernel_file = code.co_filename if code else None
    kernel_loc = f"{kernel_file}:{code.co_firstlineno}" if code else "<kernel>"
    placement = transport_mod.resolve(process_group, ranks, rank_args)
    run_state = RunState(
        target=tgt, lnc=lnc, ranks=placement.job_ranks, shape_only=shape_only, assume=assume,
        kernel_name=getattr(func, "__qualname__", str(func)), kernel_file=kernel_file, sbuf_budget=budget,
        sbuf_overflow=overflow, max_records=max_records, grid_ndim=grid_ndim, trace=trace, trace_layer=trace_layer,
    )
    _connect(run_state, placement)
    arg_buffer = MemoryRegion.shared_hbm if lnc > 1 else MemoryRegion.private_hbm
    per_rank = _per_rank_args(args, kwargs, ranks, rank_args)
    bindings = [_bind(func, a, k, arg_buffer, shape_only) for a, k in per_rank]
    job = _Launch(func, run_state, placement.rank_ids, bindings, kernel_loc)
    t0 = time.perf_counter()
    job.execute()
    outputs_per_rank, output_labels = job.outputs()
    profile = job.profile(time.perf_counter() - t0, output_labels, placement.job_ranks)
    log.debug("%s", profile.summary())
    return outputs_per_rank if len(job.rank_ids) > 1 else outputs_per_rank[0]


def _run_elsewhere(backend: str, func: Callable[..., Any], args: tuple, kwargs: dict, lnc: int) -> Any:
    """Hand the launch to the real ``nki.simulate`` ("official") or a NeuronCore ("neuron"): those backends
    bind, run and profile on their own, none of this module's steps apply."""
    if backend == "official":
        from .official import run_official

        return run_official(func, args, kwargs, lnc)
    from .device import run_on_neuron

    return run_on_neuron(func, args, kwargs, lnc)


def _connect(run_state: RunState, placement: transport_mod.Resolved) -> None:
    """Give the launch its barrier hub and its collective transport: over ``torch.distributed`` when a process
    group carries the ranks, else between this process's rank threads."""
    run_state.sync = SyncHub(len(placement.rank_ids), run_state.lnc, rank_ids=placement.rank_ids)
    if placement.pg is not None:
        run_state.transport = transport_mod.TorchTransport(placement.pg, run_state.lnc, data=not run_state.shape_only)
        run_state.transport.run_state = run_state
    else:
        run_state.transport = transport_mod.ThreadTransport(run_state.sync)


def _per_rank_args(args: tuple, kwargs: dict, ranks: int, rank_args: list[tuple] | None) -> list[tuple[tuple, dict]]:
    """Each rank's (args, kwargs): the caller's per-rank tuples, else the arguments for rank 0 and a private copy
    for every other rank (a rank writing its inputs must not change another's)."""
    if rank_args is not None:
        if len(rank_args) != ranks:
            raise NkiUsageError(f"rank_args has {len(rank_args)} entries for ranks={ranks}", rule="args")
        return [(tuple(a), dict(kwargs)) for a in rank_args]
    return [(args, kwargs)] + [_copy_args(args, kwargs) for _ in range(ranks - 1)]


@dataclass
class _Launch:
    """The programs of one launch (this process's ranks x LNC programs) and what they returned or raised.

    Shared state of the launch steps (running, collecting outputs, building the profile), kept in one place
    instead of being passed between them."""

    func: Callable[..., Any]
    run_state: RunState
    rank_ids: list[int]  # the ranks this process runs (threads), by rank id
    bindings: list[_ArgBinding]
    kernel_loc: str
    contexts: list[list[ProgramContext]] = field(init=False)
    results: dict[tuple[int, int], Any] = field(default_factory=dict)
    errors: list[tuple[tuple[int, int], BaseException]] = field(default_factory=list)

    def __post_init__(self) -> None:
        lnc = self.run_state.lnc
        self.contexts = [[ProgramContext(self.run_state, p, r) for p in range(lnc)] for r in self.rank_ids]

    def execute(self) -> None:
        """Run every program: inline when there is one, else one thread per program (collectives and LNC
        barriers need them concurrent); the first error that is not another program's abort is re-raised."""
        if len(self.rank_ids) * self.run_state.lnc == 1:
            self._run_single()
        else:
            self._run_threads()

    def _run_single(self) -> None:
        """The one program on the caller's thread (its exception propagates unchanged)."""
        ctx = self.contexts[0][0]
        b = self.bindings[0]
        try:
            with activate(ctx), np.errstate(all="ignore"):
                self.results[(0, 0)] = self.func(*b.args, **b.kwargs)
                check_closed(ctx)
        except BaseException as exc:
            self.run_state.transport.failed(f"program 0 of rank {self.rank_ids[0]}: {type(exc).__name__}: {exc}")
            raise

    def _program_body(self, r: int, p: int) -> None:
        """Program ``p`` of local rank ``r`` on its thread; a failure aborts the others (barriers, transport)."""
        ctx = self.contexts[r][p]
        b = self.bindings[r]
        try:
            with activate(ctx), np.errstate(all="ignore"):
                self.results[(r, p)] = self.func(*b.args, **b.kwargs)
                check_closed(ctx)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            self.errors.append(((r, p), exc))
            why = f"program {p} of rank {self.rank_ids[r]}: {type(exc).__name__}: {exc}"
            self.run_state.sync.abort(why)
            self.run_state.transport.failed(why)

    def _run_threads(self) -> None:
        """Every program on its own thread; re-raise the root cause (not the aborts it triggered elsewhere)."""
        threads = [
            threading.Thread(target=self._program_body, args=(r, p), name=f"nkisim-r{self.rank_ids[r]}-p{p}",
                             daemon=True)
            for r in range(len(self.rank_ids))
            for p in range(self.run_state.lnc)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if self.errors:
            primary = [e for e in self.errors if not isinstance(e[1], NkiSyncError) or "aborted" not in str(e[1])]
            _, exc = (primary or self.errors)[0]
            raise exc

    def outputs(self) -> tuple[list[Any], set[str]]:
        """Every local rank's outputs as host arrays (shaped like the kernel's return value), and the labels of
        the returned tensors; inputs written through a copy are copied back."""
        outputs_per_rank = []
        output_labels: set[str] = set()
        for r in range(len(self.rank_ids)):
            outs0 = self._rank_tensors(r)
            for t in outs0:
                output_labels.add(t._st.label)
                if t._st.kind != "input":
                    t._st.kind = "output"
            outputs_per_rank.append(self._host_outputs(r, outs0))
            if not self.run_state.shape_only:
                for origin, st in self.bindings[r].copy_back:
                    _copy_back(origin, st)
        return outputs_per_rank, output_labels

    def _rank_tensors(self, r: int) -> list[NkiTensor]:
        """The checked output tensors of local rank ``r``; every LNC program must return the same ones."""
        lnc = self.run_state.lnc
        outs0 = _check_outputs(self.results.get((r, 0)), self.func, self.kernel_loc)
        for p in range(1, lnc):
            outs_p = _check_outputs(self.results.get((r, p)), self.func, self.kernel_loc)
            if [t._st.id for t in outs_p] != [t._st.id for t in outs0]:
                raise NkiValidationError(
                    f"the programs of the LNC={lnc} launch returned different tensors; both programs must return the "
                    f"same shared_hbm outputs",
                    rule="kernel-output",
                    location=self.kernel_loc,
                )
        return outs0

    def _host_outputs(self, r: int, outs0: list[NkiTensor]) -> Any:
        """Rank ``r``'s outputs for the caller: a whole input array returned is the caller's own array; the
        container (tuple, list, single value, None) follows what the kernel returned."""
        origins = self.bindings[r].origins
        host = [
            origins[t._st.id] if t._st.id in origins and t.shape == t._st.shape
            else _to_host(t, self.run_state.shape_only)
            for t in outs0
        ]
        res = self.results.get((r, 0))
        if isinstance(res, tuple):
            return tuple(host)
        if isinstance(res, list):
            return list(host)
        return host[0] if host else None

    def profile(self, wall: float, output_labels: set[str], job_ranks: int) -> prof.Profile:
        """Merge the programs' recorders into the launch's profile, make it :func:`last_profile`, and raise the
        first on-chip capacity error the memory replay found (the profile is kept so the failure can be read)."""
        rs = self.run_state
        profile = prof.Profile(
            kernel=rs.kernel_name, target=rs.target.name, lnc=rs.lnc, ranks=job_ranks, shape_only=rs.shape_only,
            sbuf_budget_bytes=rs.sbuf_budget, wall_time_s=wall,
        )
        prof.merge([ctx.rec for row in self.contexts for ctx in row], profile)
        from .collectives import profile_rows

        profile.collectives = profile_rows(self.contexts)
        for label, traffic in profile.hbm_by_tensor.items():
            if label in output_labels and traffic.kind != "input":
                traffic.kind = "output"
        capacity_errors = self._memory_peaks(profile)
        prof.set_last(profile)
        if capacity_errors:
            raise capacity_errors[0]
        return profile

    def _memory_peaks(self, profile: prof.Profile) -> list[BaseException]:
        """Replay every program's on-chip allocations: their SBUF/PSUM peaks go into ``profile``; the capacity
        errors found are returned (raised by the caller after the profile is published)."""
        capacity_errors: list[BaseException] = []
        for row in self.contexts:
            for ctx in row:
                m = ctx.mem
                try:
                    m.replay()
                except NkiSimError:
                    capacity_errors.append(sys.exc_info()[1])
                profile.peak_by_program.append(
                    {
                        "rank": ctx.rank,
                        "program": ctx.program_id,
                        "sbuf_bytes_per_partition": m.sbuf_peak,
                        "psum_bytes_per_partition": m.psum_peak_bytes,
                        "psum_banks": m.psum_peak_banks,
                    }
                )
                profile.peak_sbuf_bytes_per_partition = max(profile.peak_sbuf_bytes_per_partition, m.sbuf_peak)
                profile.sbuf_over_budget_bytes = max(profile.sbuf_over_budget_bytes, m.sbuf_over_budget)
                profile.peak_psum_bytes_per_partition = max(profile.peak_psum_bytes_per_partition, m.psum_peak_bytes)
                profile.peak_psum_banks = max(profile.peak_psum_banks, m.psum_peak_banks)
        return capacity_errors


def _copy_back(origin: Any, st: Storage) -> None:
    if st.buf is None:
        return
    data = st.buf.view(st.dtype.np).reshape(st.shape)
    if isinstance(origin, np.ndarray):
        if origin.flags.writeable:
            origin[...] = data
        return
    if _is_torch(origin):
        import torch

        if origin.dtype == torch.bfloat16:
            src = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
        else:
            src = torch.from_numpy(np.ascontiguousarray(data))
        with torch.no_grad():
            origin.copy_(src.to(origin.device))
