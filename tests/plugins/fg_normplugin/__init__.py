"""A third-party plugin that ships a fusion *and* its lowering: a pattern, an instruction with its own Jinja2
template (``templates/fgnorm_l2norm.j2``) and its PyTorch reference, registered at import through the public API
(the ``fusegraph.patterns`` entry point imports this module on the first compile).

The op: an L2 norm with a per-feature gain, ``weight * x / sqrt(sum(x^2) + eps)`` (no built-in pattern has it:
RMSNorm divides by the *mean* of squares).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

import fusegraph
from fusegraph.codegen.api import PMAX, W, Emitted, aten, inst_name, ir, nbytes, nl_dtype, norm_param_chunk


@fusegraph.register_pattern(
    "fgnorm.l2norm",
    template="fgnorm_l2norm",
    priority=20,
    inputs=[fusegraph.Input("x", "T H"), fusegraph.Input("weight", "H", kind="weight")],
    params={"eps": 1e-6},
    dims={"T": (3, 5), "H": (16, 40)},
    dtypes=("float32",),
)
def l2norm(x, weight, *, eps):
    """``weight * x * rsqrt(sum(x^2, -1) + eps)``."""
    return weight * (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps))


@dataclass
class L2Norm(fusegraph.Instruction):
    """out = weight * x * rsqrt(sum(x^2) + eps) over the hidden state (fp32)."""

    opcode: ClassVar[str] = "fgnorm_l2norm"
    x: ir.Value
    weight: ir.Value
    out: ir.Value
    eps: float

    def constrain(self, c):
        c.same(self.x, self.out)

    def arg_specs(self, layouts, add):
        lay = layouts[self.x.name]
        add(self.weight, f"fgnorm:{lay}", lambda t, lay=lay: W.per_feature(t, lay), torch.float32)

    def constants(self, ctx):
        return {"c_ones": fusegraph.Constant(W.ones(PMAX), "ones")}

    def emit(self, ctx, i):
        lay = ctx.layout(self.x)
        T = ctx.tokens
        v = ctx.var(self.out)
        e = Emitted(sbuf=lay.FT * T * (4 + nbytes(self.out.dtype)) + 4 * T, psum_banks=1)
        weight = norm_param_chunk(e, self.weight, ctx, f"{inst_name(self)}.w", i)
        e.code("fgnorm_l2norm.j2", module=self.module or "", aten=aten(self), name=inst_name(self), P=lay.P,
               FT=lay.FT, T=T, x=ctx.var(self.x), out=v, sq=f"{v}_sq", ss=f"{v}_ss", rn=f"{v}_rn",
               ones=ctx.consts["ones"], weight=weight, eps=repr(float(self.eps)), dtype=nl_dtype(self.out.dtype))
        return e

    def reference(self, env):
        x = env[self.x.name].float()
        y = env[self.weight.name].float() * (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + self.eps))
        env[self.out.name] = y.to(self.out.dtype)


@fusegraph.register_lowering(l2norm, template_dir=Path(__file__).parent / "templates", instructions=[L2Norm])
def lower_l2norm(L, m):
    x = L.act(L.input(m, "x"), L.views(m, "x"))
    out = L.new_act(L.output(m), L.label(m, "l2"))
    L.emit(L2Norm(x=x, weight=L.hbm(L.input(m, "weight")), out=out, eps=float(m.params["eps"])), m)
