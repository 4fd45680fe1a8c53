"""Find the first instruction where a kernel's values leave eager PyTorch's (the HazyResearch diff-test idea).

Given a region's kernel program and the eager values of every program node for one step, build kernels that
stop after instruction ``i`` and store its outputs, run them in the interpreter on copies of the step's
inputs, and compare with the eager value of the program node the instruction stands for. Binary search finds
the first divergent instruction (its layer, the pattern and ATen ops it implements, the model module); the
reference VM is compared too, which tells a lowering bug (reference already wrong) from a template bug
(reference right, kernel wrong).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from fusegraph.nkisim.torch_io import InterpretedKernel

from . import ir, reference
from .megakernel import generate


@dataclass
class Divergence:
    index: int  # instruction index in the kernel program
    opcode: str
    layer: int | None
    module: str | None
    pattern: str | None
    aten_ops: list[str]
    value: str
    max_abs_diff: float
    scale: float
    reference_ok: bool  # the reference VM matched eager at this instruction (=> the template is wrong)

    def describe(self) -> str:
        where = f"layer {self.layer}" if self.layer is not None else "outside the layers"
        blame = "the NKI template" if self.reference_ok else "the lowering (the reference VM diverges too)"
        return (f"first divergence at instruction {self.index} ({self.opcode}, {where}, module {self.module}, "
                f"pattern {self.pattern}; ATen ops {', '.join(self.aten_ops) or '-'}): value {self.value} differs by "
                f"{self.max_abs_diff:.3g} (scale {self.scale:.3g}); suspect {blame}")


def _outputs_of(ins: ir.Instruction) -> list[ir.Value]:
    return [v for v in ins.writes() if v.kind == ir.ValueKind.ACT and v.node is not None]


def _truncated(program: ir.KernelProgram, upto: int) -> tuple[ir.KernelProgram, list[tuple[ir.Value, ir.Value]]]:
    instrs = list(program.instructions[: upto + 1])
    stores = []
    for v in _outputs_of(program.instructions[upto]):
        dst = ir.Value(f"probe_{v.name}", ir.ValueKind.OUTPUT, (program.tokens, v.features), v.dtype, node=v.node)
        instrs.append(ir.Store(x=v, dst=dst))
        stores.append((v, dst))
    used = {x.name for i in instrs for x in i.reads() + i.writes()}
    inputs = [v for v in program.inputs if v.name in used]
    state = [v for v in program.outputs if v.kind == ir.ValueKind.STATE and v.name in used]
    return dataclasses.replace(program, instructions=instrs, inputs=inputs,
                               outputs=[d for _, d in stores] + state), stores


def _diff(got: torch.Tensor, exp: torch.Tensor) -> tuple[float, float]:
    g, e = got.float().reshape(-1), exp.float().reshape(-1)
    return (g - e).abs().max().item(), max(e.abs().max().item(), 1e-6)


def first_divergence(program: ir.KernelProgram, kernel_args: dict[str, torch.Tensor], eager: Callable[[str], torch.Tensor],
                     node_ops: Callable[[str], list[str]], *, tolerance: float = 1e-4, target: str = "trn2",
                     reference_env: dict[str, torch.Tensor] | None = None, **gen_kw: Any) -> Divergence | None:
    """``kernel_args``: prepared kernel arguments (weights in kernel layout); ``eager(node)`` gives the eager
    value of a program node; ``node_ops(ids)`` names the ATen ops of the instruction's nodes. ``reference_env``:
    model-layout tensors for the reference VM (optional). Returns None when no instruction diverges."""
    probes = [i for i, ins in enumerate(program.instructions) if _outputs_of(ins)]
    if not probes:
        return None

    def check(i: int) -> Divergence | None:
        prog, stores = _truncated(program, i)
        gen = generate(prog, target=target, **gen_kw)
        k = InterpretedKernel(gen, target=target)
        args = {n: (t.clone() if n in {v.name for v in prog.outputs} else t) for n, t in kernel_args.items()}
        outs = dict(zip([v.name for v in prog.outputs], k(args)))
        worst = None
        for v, dst in stores:
            exp = eager(v.node)
            err, scale = _diff(outs[dst.name], exp)
            tol = tolerance if v.dtype == torch.float32 else max(tolerance, 2e-2)
            if err > tol * scale and (worst is None or err / scale > worst[1] / worst[2]):
                worst = (v, err, scale)
        if worst is None:
            return None
        ins = program.instructions[i]
        ref_ok = True
        if reference_env is not None:
            env = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in reference_env.items()}
            reference.run(dataclasses.replace(program, instructions=program.instructions[: i + 1]), env)
            r_err, r_scale = _diff(env[worst[0].name], eager(worst[0].node))
            ref_ok = r_err <= tolerance * r_scale * (1 if worst[0].dtype == torch.float32 else 200)
        return Divergence(index=i, opcode=ins.opcode, layer=ins.layer, module=ins.module, pattern=ins.pattern,
                          aten_ops=node_ops(ins.nodes), value=worst[0].name, max_abs_diff=worst[1], scale=worst[2],
                          reference_ok=ref_ok)

    lo, hi = 0, len(probes) - 1
    found = check(probes[hi])
    if found is None:
        return None
    hi -= 1
    while lo <= hi:  # the first divergent probe, assuming divergence persists once it starts
        mid = (lo + hi) // 2
        d = check(probes[mid])
        if d is not None:
            found, hi = d, mid - 1
        else:
            lo = mid + 1
    return found
