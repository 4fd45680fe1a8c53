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

from fusegraph.nkiapi.conformance import check_source

from . import ir
from .bind import ArgSpec, arg_specs
from .emitters import Context, Emitted
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
    assign_names(program.instructions)
    layouts = dict(layouts) if layouts is not None else plan_layouts(program)
    specs = arg_specs(program, layouts)
    ctx = _context(program, layouts, specs, target=target, chunk_bytes=chunk_bytes, lnc=lnc)
    constants = _constants(program, ctx)
    pre_code = [line for ins in program.instructions for line in ins.setup(ctx)]
    em = _Body(program, ctx)
    em.emit_all()
    body, stream_stats = resolve(em.pieces, ring)
    on_chip = {k: t for k, t in constants.items() if k not in ctx.hbm_consts}
    budget = _budget(program, em, on_chip, stream_stats, target, sbuf_budget_bytes)
    args = [v.name for v in program.inputs] + list(constants)
    source = cached_source if cached_source is not None else _render_source(
        program, args, on_chip, em.module_code, pre_code, body, target=target, ring=ring, lnc=lnc, model=model,
        region=region)
    if check and cached_source is None:
        _check_conformance(source)
    stats = dict(stream_stats, lnc=lnc, codegen_seconds=round(time.perf_counter() - t0, 4), lines=source.count("\n"),
                 instructions=len(program.instructions), templates=templates_hash())
    return GeneratedKernel(name=program.name, source=source, program=program, layouts=layouts, budget=budget,
                           args=args, constants=constants, specs=specs, stats=stats)


def _context(program: ir.KernelProgram, layouts: dict[str, Layout], specs: dict[str, ArgSpec], *, target: str,
             chunk_bytes: int, lnc: int) -> Context:
    """The emission context; it records the activations only a :class:`~.io.Store` reads (``store_only``) and,
    where that store is the only one, its destination, so their producers can write HBM directly."""
    readers: dict[str, set] = {}
    for ins in program.instructions:
        for v in ins.reads():
            readers.setdefault(v.name, set()).add(type(ins))
    store_only = {n for n, kinds in readers.items() if kinds == {Store}}
    store_dsts: dict[str, list] = {}
    for ins in program.instructions:
        if isinstance(ins, Store) and ins.x.name in store_only:
            store_dsts.setdefault(ins.x.name, []).append(ins.dst)
    return Context(tokens=program.tokens, layouts=layouts, target=target, chunk_bytes=chunk_bytes, consts={},
                   inputs={}, specs=specs, lnc=lnc, store_only=store_only,
                   stores={n: d[0] for n, d in store_dsts.items() if len(d) == 1})


def _constants(program: ir.KernelProgram, ctx: Context) -> dict[str, torch.Tensor]:
    """The constant kernel arguments the instructions ask for (ones, rotations, selectors), each loaded once; the
    context learns the SBUF name of each role. Constants that stay in HBM (``on_chip=False``) are arguments only:
    their names are in ``ctx.hbm_consts``."""
    constants: dict[str, torch.Tensor] = {}
    for ins in program.instructions:
        for key, const in ins.constants(ctx).items():
            constants[key] = const.tensor
            if const.on_chip:
                ctx.consts[const.role] = key.replace("c_", "s_", 1)
            else:
                ctx.hbm_consts.add(key)
    return constants


class _Body:
    """The kernel body: each instruction's emitted pieces in program order, a banner per decoder layer, a
    layer's early code (its first cache block's reads) right after its banner, and what the budget needs
    (scratch per instruction, PSUM peak, the bytes of each activation kept whole in SBUF)."""

    def __init__(self, program: ir.KernelProgram, ctx: Context) -> None:
        self.program, self.ctx = program, ctx
        self.pieces: list = []
        self.module_code: list[str] = []
        self.failures: list[tuple[ir.Instruction, CodegenError]] = []
        self.peak_scratch = self.peak_psum = 0
        self.act_bytes: dict[str, int] = {}
        self.scratch_at: dict[int, int] = {}
        self.early_at = self.layer_start = 0  # where the layer's early code goes (after its banner), its first
        self._layer: object = "start"

    def emit_all(self) -> None:
        """Emit every instruction; raise the first failure with all of them attached (``error.instructions``)."""
        for i, ins in enumerate(self.program.instructions):
            self._banner(i, ins)
            try:
                em = ins.emit(self.ctx, i)
                helpers = ins.module_code(self.ctx)  # module-level code before the kernel (an LLM island's function)
            except CodegenError as e:
                self.failures.append((ins, e))
                continue
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001 - an emitter's bug (a plugin's, a shape it never saw) costs its
                # instruction's match only, like a CodegenError: the executor retries without it (or generically)
                self.failures.append((ins, CodegenError(f"{ins.opcode} emission raised {type(e).__name__}: {e}")))
                continue
            self.module_code += [h for h in helpers if h not in self.module_code]
            self._place(i, ins, em)
        if self.failures:
            err = self.failures[0][1]
            err.instructions = tuple(ins for ins, _ in self.failures)
            err.causes = tuple(str(e) for _, e in self.failures)
            raise err

    def _banner(self, i: int, ins: ir.Instruction) -> None:
        if ins.layer != self._layer:
            self._layer = ins.layer
            title = f"decoder layer {ins.layer}" if ins.layer is not None else "outside the decoder layers"
            self.pieces.append(render("layer_banner.j2", indent=4, title=title))
            self.early_at, self.layer_start = len(self.pieces), i

    def _place(self, i: int, ins: ir.Instruction, em: Emitted) -> None:
        if em.early:  # before the layer's instructions; its tiles are live through them
            self.pieces[self.early_at:self.early_at] = em.early
            self.early_at += len(em.early)
            for k in range(self.layer_start, i):
                if k in self.scratch_at:
                    self.scratch_at[k] += em.early_sbuf
                    self.peak_scratch = max(self.peak_scratch, self.scratch_at[k])
        self.pieces.extend(em.pieces)
        if _critical_loads(ins, em.pieces):
            self.pieces.append(CriticalEnd(i))
        self.peak_scratch = max(self.peak_scratch, em.sbuf)
        self.scratch_at[i] = em.sbuf
        self.peak_psum = max(self.peak_psum, em.psum_banks)
        for v in ins.writes():
            if v.kind == ir.ValueKind.ACT and v.name not in self.ctx.stored:  # stored by its producer: never whole
                lay = self.ctx.layouts[v.name]
                self.act_bytes[v.name] = lay.FT * self.program.tokens * torch.empty((), dtype=v.dtype).element_size()


def _budget(program: ir.KernelProgram, em: _Body, constants: dict[str, torch.Tensor], stream_stats: dict[str, Any],
            target: str, sbuf_budget_bytes: int) -> Budget:
    """SBUF per partition at the peak: persistent (constants, per-step inputs, the weight ring) plus the
    activations live at once and that instruction's scratch; checked against the target's budget."""
    live_acts, live_scratch, _ = live_activation_peak(program, em.act_bytes, em.scratch_at)
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
    budget.psum_peak_banks = em.peak_psum
    budget.check()
    return budget


def _render_source(program: ir.KernelProgram, args: list[str], constants: dict[str, torch.Tensor],
                   module_code: list[str], pre_code: list[str], body: str, *, target: str, ring: int, lnc: int,
                   model: str, region: str) -> str:
    """The kernel module: header, module-level helpers, the signature with constant loads, prologue, body, return."""
    const_loads = [{"var": key.replace("c_", "s_", 1), "shape": tuple(t.shape), "dtype": nl_dtype(t.dtype),
                    "src": key} for key, t in constants.items()]
    outputs = [{"var": v.name, "shape": tuple(v.shape), "dtype": nl_dtype(v.dtype)}
               for v in program.outputs if v.kind == ir.ValueKind.OUTPUT]
    return (
        render("header.j2", version=_version(), model=model or "?", region=region or "decoder stack", target=target,
               tokens=program.tokens, layers=len(program.layers()), ring=ring, lnc=lnc,
               collectives="nki.collectives." in "".join(module_code) + "".join(pre_code) + body)
        + "".join(module_code)
        + render("kernel_open.j2", name=program.name, args=args, outputs=outputs, constants=const_loads, lnc=lnc)
        + "".join(pre_code)
        + body
        + "\n" + render("kernel_close.j2", returns=[v.name for v in program.outputs])
    )


def _check_conformance(source: str) -> None:
    """Every NKI call of the rendered kernel against the official API tables."""
    violations = check_source(source)
    if violations:
        raise CodegenError("generated kernel does not conform to the NKI API tables: "
                           + "; ".join(str(v) for v in violations[:5]))


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
