"""Template tests for any instruction, built-in or a plugin's: a one-instruction kernel around an activation input
(loaded by an embedding of rows) and an HBM output (a store), generated, checked against the NKI 0.3.0 and 0.6.0
API tables, run in the interpreter and in the reference VM.

``tests/codegen/test_templates.py`` tests every built-in template this way; a plugin tests its own the same way::

    b = Builder(tokens=3)
    x = b.act("x", torch.randn(3, 384))
    y = b.new("y", 384, torch.float32)
    b.ins.append(MyNorm(x=x, weight=b.hbm("w", w), out=y, eps=1e-6, layer=0))
    b.store(y)
    gen, results, reference_env, _ = b.run()
    torch.testing.assert_close(results["out_y"], reference_env["y"])
"""
from __future__ import annotations

from typing import Any

import torch

from . import ir, reference
from .io import Load, Store
from .megakernel import GeneratedKernel, generate
from .runtime import InterpretedKernel

V = ir.ValueKind


class Builder:
    """Builds, generates and runs a small kernel program (see the module docstring)."""

    def __init__(self, tokens: int = 1) -> None:
        self.T = tokens
        self.ins: list[ir.Instruction] = []
        self.inputs: list[ir.Value] = []
        self.outputs: list[ir.Value] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.ids = self.hbm("ids", torch.arange(tokens, dtype=torch.int32), V.INPUT)

    def hbm(self, name: str, t: torch.Tensor, kind: str = V.WEIGHT) -> ir.Value:
        """A kernel argument holding ``t`` (a weight by default)."""
        v = ir.Value(name, kind, tuple(t.shape), t.dtype)
        self.inputs.append(v)
        self.tensors[name] = t
        return v

    def act(self, name: str, x: torch.Tensor) -> ir.Value:
        """An activation [T, F] whose value is x (an input of the kernel, loaded to SBUF)."""
        src = self.hbm(f"in_{name}", x.clone(), V.INPUT)
        v = ir.Value(name, V.ACT, tuple(x.shape), x.dtype)
        self.ins.append(Load(src=src, out=v))
        return v

    def new(self, name: str, features: int, dtype: torch.dtype, kind: str = V.ACT) -> ir.Value:
        """A value an instruction will produce."""
        return ir.Value(name, kind, (self.T, features), dtype)

    def store(self, v: ir.Value) -> ir.Value:
        """Store ``v`` to a kernel output ``out_<name>``."""
        out = ir.Value(f"out_{v.name}", V.OUTPUT, v.shape, v.dtype)
        self.ins.append(Store(x=v, dst=out))
        self.outputs.append(out)
        return out

    def program(self) -> ir.KernelProgram:
        state = [v for v in self.inputs if v.kind == V.STATE]
        return ir.KernelProgram("test_kernel", self.T, list(self.ins), inputs=list(self.inputs),
                                outputs=self.outputs + state)

    def run(self, **gen_kw: Any) -> tuple[GeneratedKernel, dict[str, torch.Tensor], dict[str, torch.Tensor],
                                          dict[str, torch.Tensor]]:
        """Generate (conformance-checked), run in the interpreter and the reference VM: (kernel, kernel outputs by
        name, the reference VM's values by name, the tensors the kernel ran on)."""
        prog = self.program()
        gen = generate(prog, **gen_kw)
        kernel = InterpretedKernel(gen, target=gen_kw.get("target", "trn2"))
        ref_env = {k: v.clone() for k, v in self.tensors.items()}
        reference.run(prog, ref_env)
        kern_tensors = {k: v.clone() for k, v in self.tensors.items()}
        outs = kernel(kernel.prepare(kern_tensors))
        results = dict(zip([v.name for v in prog.outputs], outs))
        return gen, results, ref_env, kern_tensors


__all__ = ["Builder", "V"]
