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
    ``sbuf_budget``: usable SBUF bytes per partition.  ``backend="official"``: run through the real
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
        trace=trace, trace_layer=trace_layer, process_group=process_group,
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
) -> Any:
    func = kernel.func
    be = _resolve_backend(backend)
    if be == "official":
        from .official import run_official

        return run_official(func, args, kwargs, lnc)
    if be == "neuron":
        from .device import run_on_neuron

        return run_on_neuron(func, args, kwargs, lnc)
    if lnc not in (1, 2):
        raise NkiUsageError(f"lnc must be 1 or 2, got {lnc!r}", rule="lnc")
    if not isinstance(ranks, int) or ranks < 1:
        raise NkiUsageError(f"ranks must be a positive int, got {ranks!r}", rule="args")
    tgt = get_target(target or getattr(kernel, "default_target", None) or session_target())
    budget = resolve_sbuf_budget(tgt, sbuf_budget)
    code = getattr(func, "__code__", None)
    kernel_file = code.co_filename if code else None
    kernel_loc = f"{kernel_file}:{code.co_firstlineno}" if code else "<kernel>"
    placement = transport_mod.resolve(process_group, ranks, rank_args)
    rank_ids = placement.rank_ids  # the ranks this process runs (threads), by rank id
    local = len(rank_ids)
    run_state = RunState(
        target=tgt, lnc=lnc, ranks=placement.job_ranks, shape_only=shape_only, assume=assume,
        kernel_name=getattr(func, "__qualname__", str(func)), kernel_file=kernel_file, sbuf_budget=budget,
        max_records=max_records, grid_ndim=grid_ndim, trace=trace, trace_layer=trace_layer,
    )
    run_state.sync = SyncHub(local, lnc, rank_ids=rank_ids)
    if placement.pg is not None:
        run_state.transport = transport_mod.TorchTransport(placement.pg, lnc, data=not shape_only)
        run_state.transport.run_state = run_state
    else:
        run_state.transport = transport_mod.ThreadTransport(run_state.sync)
    arg_buffer = MemoryRegion.shared_hbm if lnc > 1 else MemoryRegion.private_hbm
    if rank_args is not None:
        if len(rank_args) != ranks:
            raise NkiUsageError(f"rank_args has {len(rank_args)} entries for ranks={ranks}", rule="args")
        per_rank = [(tuple(a), dict(kwargs)) for a in rank_args]
    else:
        per_rank = [(args, kwargs)] + [_copy_args(args, kwargs) for _ in range(ranks - 1)]
    bindings = [_bind(func, a, k, arg_buffer, shape_only) for a, k in per_rank]

    contexts = [[ProgramContext(run_state, p, r) for p in range(lnc)] for r in rank_ids]
    results: dict[tuple[int, int], Any] = {}
    errors: list[tuple[tuple[int, int], BaseException]] = []
    t0 = time.perf_counter()

    def body(r: int, p: int) -> None:
        ctx = contexts[r][p]
        b = bindings[r]
        try:
            with activate(ctx), np.errstate(all="ignore"):
                results[(r, p)] = func(*b.args, **b.kwargs)
                check_closed(ctx)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(((r, p), exc))
            why = f"program {p} of rank {rank_ids[r]}: {type(exc).__name__}: {exc}"
            run_state.sync.abort(why)
            run_state.transport.failed(why)

    if local * lnc == 1:
        ctx = contexts[0][0]
        try:
            with activate(ctx), np.errstate(all="ignore"):
                results[(0, 0)] = func(*bindings[0].args, **bindings[0].kwargs)
                check_closed(ctx)
        except BaseException as exc:
            run_state.transport.failed(f"program 0 of rank {rank_ids[0]}: {type(exc).__name__}: {exc}")
            raise
    else:
        threads = [
            threading.Thread(target=body, args=(r, p), name=f"nkisim-r{rank_ids[r]}-p{p}", daemon=True)
            for r in range(local)
            for p in range(lnc)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            primary = [e for e in errors if not isinstance(e[1], NkiSyncError) or "aborted" not in str(e[1])]
            (r, p), exc = (primary or errors)[0]
            if isinstance(exc, NkiSimError):
                raise exc
            raise exc

    outputs_per_rank = []
    output_labels: set[str] = set()
    for r in range(local):
        outs0 = _check_outputs(results.get((r, 0)), func, kernel_loc)
        for p in range(1, lnc):
            outs_p = _check_outputs(results.get((r, p)), func, kernel_loc)
            if [t._st.id for t in outs_p] != [t._st.id for t in outs0]:
                raise NkiValidationError(
                    f"the programs of the LNC={lnc} launch returned different tensors; both programs must return the "
                    f"same shared_hbm outputs",
                    rule="kernel-output",
                    location=kernel_loc,
                )
        for t in outs0:
            output_labels.add(t._st.label)
            if t._st.kind != "input":
                t._st.kind = "output"
        host = [
            bindings[r].origins[t._st.id] if t._st.id in bindings[r].origins and t.shape == t._st.shape
            else _to_host(t, shape_only)
            for t in outs0
        ]
        res = results.get((r, 0))
        if isinstance(res, tuple):
            out: Any = tuple(host)
        elif isinstance(res, list):
            out = list(host)
        else:
            out = host[0] if host else None
        outputs_per_rank.append(out)
        if not shape_only:
            for origin, st in bindings[r].copy_back:
                _copy_back(origin, st)

    wall = time.perf_counter() - t0
    profile = prof.Profile(
        kernel=run_state.kernel_name, target=tgt.name, lnc=lnc, ranks=placement.job_ranks, shape_only=shape_only,
        sbuf_budget_bytes=budget, wall_time_s=wall,
    )
    recorders = [ctx.rec for row in contexts for ctx in row]
    prof.merge(recorders, profile)
    from .collectives import profile_rows

    profile.collectives = profile_rows(contexts)
    capacity_errors: list[BaseException] = []
    for label, traffic in profile.hbm_by_tensor.items():
        if label in output_labels and traffic.kind != "input":
            traffic.kind = "output"
    for row in contexts:
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
            profile.peak_psum_bytes_per_partition = max(profile.peak_psum_bytes_per_partition, m.psum_peak_bytes)
            profile.peak_psum_banks = max(profile.peak_psum_banks, m.psum_peak_banks)
    prof.set_last(profile)
    if capacity_errors:
        raise capacity_errors[0]
    log.debug("%s", profile.summary())
    return outputs_per_rank if local > 1 else outputs_per_rank[0]


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
