"""Build one-instruction kernel programs around an activation input (loaded by an embedding of rows) and an
HBM output (a store), generate the kernel, run it in the interpreter and the reference VM, compare."""
from __future__ import annotations

import torch

from fusegraph.codegen import ir, reference
from fusegraph.codegen.megakernel import generate
from fusegraph.codegen.runtime import InterpretedKernel

V = ir.ValueKind


class Builder:
    def __init__(self, tokens: int = 1) -> None:
        self.T = tokens
        self.ins: list[ir.Instruction] = []
        self.inputs: list[ir.Value] = []
        self.outputs: list[ir.Value] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.ids = self.hbm("ids", torch.arange(tokens, dtype=torch.int32), V.INPUT)

    def hbm(self, name: str, t: torch.Tensor, kind: str = V.WEIGHT) -> ir.Value:
        v = ir.Value(name, kind, tuple(t.shape), t.dtype)
        self.inputs.append(v)
        self.tensors[name] = t
        return v

    def act(self, name: str, x: torch.Tensor) -> ir.Value:
        """An activation [T, F] whose value is x (via an embedding of x's rows)."""
        table = self.hbm(f"tbl_{name}", x.clone())
        v = ir.Value(name, V.ACT, tuple(x.shape), x.dtype)
        self.ins.append(ir.Embed(ids=self.ids, table=table, out=v))
        return v

    def new(self, name: str, features: int, dtype: torch.dtype, kind: str = V.ACT) -> ir.Value:
        return ir.Value(name, kind, (self.T, features), dtype)

    def store(self, v: ir.Value) -> ir.Value:
        out = ir.Value(f"out_{v.name}", V.OUTPUT, v.shape, v.dtype)
        self.ins.append(ir.Store(x=v, dst=out))
        self.outputs.append(out)
        return out

    def program(self) -> ir.KernelProgram:
        state = [v for v in self.inputs if v.kind == V.STATE]
        return ir.KernelProgram("test_kernel", self.T, list(self.ins), inputs=list(self.inputs),
                                outputs=self.outputs + state)

    def run(self, **gen_kw):
        prog = self.program()
        gen = generate(prog, **gen_kw)
        kernel = InterpretedKernel(gen, target=gen_kw.get("target", "trn2"))
        ref_env = {k: v.clone() for k, v in self.tensors.items()}
        reference.run(prog, ref_env)
        kern_tensors = {k: v.clone() for k, v in self.tensors.items()}
        outs = kernel(kernel.prepare(kern_tensors))
        results = dict(zip([v.name for v in prog.outputs], outs))
        return gen, results, ref_env, kern_tensors
