"""Assemble one ``@nki.jit`` megakernel from a :class:`~.ir.KernelProgram`.

Structure of the emitted kernel::

    header, imports
    @nki.jit
    def fusegraph_step(<inputs>, <weights>, <constants>, <state>):
        outputs in shared HBM; constants and per-step inputs loaded into SBUF once
        embedding -> hidden state tile in SBUF
        layer 0 .. layer N-1   (instructions; weights streamed through a ring of SBUF buffers,
                                the next chunks' DMAs issued ahead of use, across layer boundaries)
        final norm, lm_head, store logits
        return logits, <state tensors written in place>

The hidden state never leaves SBUF between layers; only kernel outputs and the KV-cache rows are written to HBM.
Every emitted kernel is checked against the official NKI 0.3.0 and 0.6.0 API tables; a violation is a codegen
error, not a warning.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from . import ir
from .bind import ArgSpec, arg_specs
from .emitters import Context
from .errors import CodegenError
from .ir import assign_names
from .layout import Layout
from .io import Store
from .plan import Budget, live_activation_peak, plan_layouts, sbuf_budget
from .registry import templates_hash
from .render import nl_dtype, render
from .stream import ChunkUse, CriticalEnd, resolve

KIB = 1024


@dataclass
class GeneratedKernel:
    name: str
    source: str
    program: ir.KernelProgram
    layouts: dict[str, Layout]
    budget: Budget
    args: list[str]  # kernel parameter names in order
    constants: dict[str, torch.Tensor]  # constant kernel arguments fusegraph supplies (ones, rotations, selectors)
    specs: dict[str, ArgSpec] = field(default_factory=dict)  # how each model tensor becomes a kernel argument
    stats: dict[str, Any] = field(default_factory=dict)


def generate(program: ir.KernelProgram, *, target: str = "trn2", chunk_bytes: int = 16 * KIB, ring: int = 4,
             sbuf_budget_bytes: int = 0, model: str = "", region: str = "", check: bool = True,
             cached_source: str | None = None, layouts: dict[str, Layout] | None = None,
             lnc: int = 1) -> GeneratedKernel:
    """Emit NKI source for ``program``; raise :class:`CodegenError` if a template, layout or budget rule fails.

    Every central step asks the instructions (their hooks, :mod:`.ir`): layouts (``constrain``), argument specs
    (``arg_specs``), constants (``constants``), the prologue (``setup``) and the body (``emit``). When some
    instructions fail to emit, the error lists all of them (``error.instructions``) so the caller can retry
    without their matches.

    ``cached_source`` (from :mod:`fusegraph.executors.kernel_cache`, which checked it and named its kernel
    function ``program.name``) is used verbatim instead of the rendered source and is not re-checked for
    conformance; everything else (layouts, arguments, budget) is computed as always. An empty string is used
    as given, never silently replaced: the caller decides what a usable entry is."""
    t0 = time.perf_counter()
    if ring < 2:
        raise CodegenError("weight streaming needs at least 2 ring buffers")
    if lnc not in (1, 2):
        raise CodegenError(f"lnc must be 1 or 2, got {lnc}")
    T = program.tokens
    assign_names(program.instructions)
    layouts = dict(layouts) if layouts is not None else plan_layouts(program)
    specs = arg_specs(program, layouts)
    readers: dict[str, set] = {}
    for ins in program.instructions:
        for v in ins.reads():
            readers.setdefault(v.name, set()).add(type(ins))
    store_only = {n for n, kinds in readers.items() if kinds == {Store}}
    store_dsts: dict[str, list] = {}
    for ins in program.instructions:
        if isinstance(ins, Store) and ins.x.name in store_only:
            store_dsts.setdefault(ins.x.name, []).append(ins.dst)
    ctx = Context(tokens=T, layouts=layouts, target=target, chunk_bytes=chunk_bytes, consts={}, inputs={},
                  specs=specs, lnc=lnc, store_only=store_only,
                  stores={n: d[0] for n, d in store_dsts.items() if len(d) == 1})
    constants: dict[str, torch.Tensor] = {}
    for ins in program.instructions:
        for key, const in ins.constants(ctx).items():
            constants[key] = const.tensor
            ctx.consts[const.role] = key.replace("c_", "s_", 1)
    const_loads = [{"var": key.replace("c_", "s_", 1), "shape": tuple(t.shape), "dtype": nl_dtype(t.dtype), "src": key}
                   for key, t in constants.items()]
    pre_code: list[str] = []
    for ins in program.instructions:
        pre_code += ins.setup(ctx)

    pieces: list = []
    module_code: list[str] = []
    failures: list[tuple[ir.Instruction, CodegenError]] = []
    current_layer: object = "start"
    peak_scratch, peak_psum = 0, 0
    act_bytes: dict[str, int] = {}
    scratch_at: dict[int, int] = {}
    early_at, layer_start = 0, 0  # where the layer's early code goes (after its banner), its first instruction
    for i, ins in enumerate(program.instructions):
        if ins.layer != current_layer:
            current_layer = ins.layer
            title = f"decoder layer {ins.layer}" if ins.layer is not None else "outside the decoder layers"
            pieces.append(render("layer_banner.j2", indent=4, title=title))
            early_at, layer_start = len(pieces), i
        try:
            em = ins.emit(ctx, i)
            helpers = ins.module_code(ctx)  # module-level code before the kernel (an LLM island's sub-function)
        except CodegenError as e:
            failures.append((ins, e))
            continue
        module_code += [h for h in helpers if h not in module_code]
        if em.early:  # before the layer's instructions; its tiles are live through them
            pieces[early_at:early_at] = em.early
            early_at += len(em.early)
            for k in range(layer_start, i):
                if k in scratch_at:
                    scratch_at[k] += em.early_sbuf
                    peak_scratch = max(peak_scratch, scratch_at[k])
        pieces.extend(em.pieces)
        if _critical_loads(ins, em.pieces):
            pieces.append(CriticalEnd(i))
        peak_scratch = max(peak_scratch, em.sbuf)
        scratch_at[i] = em.sbuf
        peak_psum = max(peak_psum, em.psum_banks)
        for v in ins.writes():
            if v.kind == ir.ValueKind.ACT and v.name not in ctx.stored:  # stored by its producer: never whole
                lay = layouts[v.name]
                act_bytes[v.name] = lay.FT * T * torch.empty((), dtype=v.dtype).element_size()
    if failures:
        err = failures[0][1]
        err.instructions = tuple(ins for ins, _ in failures)
        err.causes = tuple(str(e) for _, e in failures)
        raise err
    body, stream_stats = resolve(pieces, ring)
    # persistent: constants + per-step inputs + ring; activations live at once + that instruction's scratch
    live_acts, live_scratch, _ = live_activation_peak(program, act_bytes, scratch_at)
    const_bytes = sum(t[0].numel() * t.element_size() if t.dim() > 1 else t.element_size()
                      for t in constants.values())
    budget = Budget(target=target, sbuf_budget=sbuf_budget(target, sbuf_budget_bytes))
    budget.items = {
        "weight ring": stream_stats["ring_bytes_per_partition"],
        "constants": const_bytes,
        "activations (live at the peak)": live_acts,
        "instruction scratch (at the peak)": live_scratch,
    }
    budget.sbuf_peak = sum(budget.items.values())
    budget.psum_peak_banks = peak_psum
    budget.check()

    name = program.name
    args = [v.name for v in program.inputs] + list(constants)
    outputs = [{"var": v.name, "shape": tuple(v.shape), "dtype": nl_dtype(v.dtype)}
               for v in program.outputs if v.kind == ir.ValueKind.OUTPUT]
    source = cached_source if cached_source is not None else (
        render("header.j2", version=_version(), model=model or "?", region=region or "decoder stack", target=target,
               tokens=T, layers=len(program.layers()), ring=ring, lnc=lnc,
               collectives="nki.collectives." in "".join(module_code) + "".join(pre_code) + body)
        + "".join(module_code)
        + render("kernel_open.j2", name=name, args=args, outputs=outputs, constants=const_loads, lnc=lnc)
        + "".join(pre_code)
        + body
        + "\n" + render("kernel_close.j2", returns=[v.name for v in program.outputs])
    )
    if check and cached_source is None:
        from fusegraph.nkiapi.conformance import check_source

        violations = check_source(source)
        if violations:
            raise CodegenError("generated kernel does not conform to the NKI API tables: "
                               + "; ".join(str(v) for v in violations[:5]))
    stats = dict(stream_stats, lnc=lnc, codegen_seconds=round(time.perf_counter() - t0, 4), lines=source.count("\n"),
                 instructions=len(program.instructions), templates=templates_hash())
    return GeneratedKernel(name=name, source=source, program=program, layouts=layouts, budget=budget, args=args,
                           constants=constants, specs=specs, stats=stats)


def _version() -> str:
    try:
        from fusegraph import __version__

        return __version__
    except Exception:  # pragma: no cover
        return "?"


def _critical_loads(ins: ir.Instruction, pieces: list) -> bool:
    """Whether the loads of ``ins`` are on the critical path of the step (see :class:`~.stream.CriticalEnd`): it
    reads the KV cache the step just updated and produces a value (attention), or it streams weights chosen at run
    time (the experts a router picked)."""
    if ins.writes() and any(v.kind == ir.ValueKind.STATE for v in ins.reads()):
        return True
    return any(isinstance(p, ChunkUse) and p.chunk.stream == "dynamic" for p in pieces)
