"""RMSNorm (hidden state, q/k-norm, Gemma's ``1 + w`` form) and LayerNorm over the hidden state, one instruction.

Sums of squares (and LayerNorm's mean) are ones-matmuls over partitions that broadcast back to every partition;
``activation(rsqrt, scale=1/n, bias=eps)`` gives the reciprocal norm. For one token the ``FT`` chunks of a
partition are summed first on the engine that computes them (``activation``'s free-axis reduce for the squares,
``tensor_reduce`` for LayerNorm's mean), so one matmul replaces ``FT`` accumulating ones: why, a decode step's
norms sit on the critical path and each matmul costs a full initiation interval (the stationary ones reloaded)
however little it moves. Several tokens keep the per-chunk accumulation (a free-axis reduce would mix tokens). LayerNorm subtracts the mean in
fp32 and adds beta in fp32 before one rounding, like ``torch.nn.functional.layer_norm``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fusegraph.codegen.api import (aten, CodegenError, Context, Emitted, inst_name, ir, Layout, Lowerer, nbytes,
                                    nl_dtype, norm_param_chunk, per_token_features, PMAX, register_lowering,
                                    weights as W, x_tokens)
from .layernorm import layernorm
from .layernorm_offset import layernorm_offset
from .rmsnorm import rmsnorm
from .rmsnorm_offset import rmsnorm_offset


@dataclass
class RMSNorm(ir.Instruction):
    """out = w * (x * rsqrt(mean(x^2 over each group) + eps)) (+ offset on w, e.g. Gemma's 1 + w).

    With ``center`` it is LayerNorm: x - mean(x) is normalized, in fp32, then ``* w + bias`` rounded once (what
    ``torch.nn.functional.layer_norm`` does for low-precision inputs). Hidden-state norms only."""

    opcode: ClassVar[str] = "rmsnorm"
    x: ir.Value
    weight: ir.Value | None
    out: ir.Value
    eps: float
    group: int  # normalized group size: F for a hidden-state norm, head_dim for q/k-norm
    weight_offset: float = 0.0
    center: bool = False
    bias: ir.Value | None = None
    fp32_product: bool = False  # the weight product in fp32 before the one rounding (OLMo-2, keras-hub)

    @property
    def per_head(self) -> bool:
        return self.group != self.x.features

    def constrain(self, c: ir.Constraints) -> None:
        c.same(self.x, self.out)
        if self.per_head:
            c.heads(self.x, self.group)

    def arg_specs(self, layouts: dict[str, Layout], add: ir.AddSpec) -> None:
        if self.weight is None:
            return
        xl = layouts[self.x.name]  # a head split over S partition tiles: [P, S], one column per tile
        lay = (Layout(self.group, 1) if xl.split == 1 else Layout(xl.P, xl.split)) if self.per_head else xl
        dtype = torch.float32 if (self.per_head or self.weight_offset or self.center or self.fp32_product) \
            else self.weight.dtype
        add(self.weight, f"norm:{lay}:{self.weight_offset}",
            lambda t, lay=lay, off=self.weight_offset: W.per_feature(t, lay, offset=off), dtype)
        add(self.bias, f"norm_bias:{lay}", lambda t, lay=lay: W.per_feature(t, lay), torch.float32)

    def constants(self, ctx: Context) -> dict[str, ir.Constant]:
        return {"c_ones": ir.Constant(W.ones(PMAX), "ones")}

    def emit(self, ctx: Context, i: int) -> Emitted:
        lay = ctx.layout(self.x)
        T = ctx.tokens
        per_head = self.per_head
        if per_head and lay.P * lay.split != self.group:
            raise CodegenError(f"per-head norm over {self.group} features needs them on partitions (layout has {lay.P})")
        if self.center and per_head:
            raise CodegenError("per-head LayerNorm has no template")
        v = ctx.var(self.out)
        xn_dtype = torch.float32 if self.fp32_product else self.x.dtype  # the normalized values before the weight
        scratch = lay.FT * T * (4 + nbytes(self.x.dtype) + nbytes(xn_dtype)) + 4 * T * (lay.FT if per_head else 1) + 4
        if self.center:  # fp32 copy, centered values, fp32 product before the bias
            scratch += lay.FT * T * 12 + 4 * T
        e = Emitted(sbuf=scratch, psum_banks=2 if self.center else 1)
        name = inst_name(self)
        weight = norm_param_chunk(e, self.weight, ctx, f"{name}.w", i)
        xw = f"{v}_xw" if self.bias is not None else ""
        e.code("rmsnorm.j2", module=self.module or "", aten=aten(self), name=name, per_head=per_head,
               P=lay.P, FT=lay.FT, T=T, x=ctx.var(self.x), out=v, sq=f"{v}_sq", ss=f"{v}_ss", rstd=f"{v}_rstd",
               xn=f"{v}_xn", ones=ctx.consts["ones"], eps=repr(float(self.eps)), inv_n=repr(1.0 / self.group),
               weight=weight, center=self.center, xf=f"{v}_xf", ms=f"{v}_ms", nmean=f"{v}_nmean", xc=f"{v}_xc",
               neg_inv_n=repr(-1.0 / self.group), xw=xw, rs=f"{v}_rs", split=lay.split if per_head else 1, H=lay.heads,
               xdtype=nl_dtype(xn_dtype), dtype=nl_dtype(self.out.dtype))
        if self.bias is not None:  # its chunk is used after the weight's, so a ring of one buffer still works
            bias = norm_param_chunk(e, self.bias, ctx, f"{name}.b", i)
            e.code("norm_bias.j2", module=self.module or "", name=name, T=T, P=lay.P, FT=lay.FT, out=v, xw=xw,
                   bias=bias)
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        x = env[self.x.name]
        T = x.shape[0]
        xf = x.float().reshape(T, -1, self.group)
        if self.center:  # LayerNorm: fp32 throughout, one rounding at the end
            xc = xf - xf.mean(-1, keepdim=True)
            y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.eps)
            if self.weight is not None:
                y = y * (env[self.weight.name].float() + self.weight_offset)
            if self.bias is not None:
                y = y + env[self.bias.name].float()
            env[self.out.name] = y.to(self.out.dtype).reshape(self.out.shape)
            return
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = y if self.fp32_product else y.to(x.dtype)
        if self.weight is not None:
            w = env[self.weight.name]
            w = w.float() if self.fp32_product else w
            w = w.float() + self.weight_offset if self.weight_offset else w
            y = (w * y).to(self.out.dtype)
        env[self.out.name] = y.to(self.out.dtype).reshape(self.out.shape)


@register_lowering(rmsnorm, rmsnorm_offset, tokens=x_tokens, instructions=[RMSNorm])
def lower_rmsnorm(L: Lowerer, m: Any) -> None:
    """Plain RMSNorm and the ``(offset + weight)`` form (Gemma); q/k-norms normalize each head (last dim)."""
    x_node = L.input(m, "x")
    x = L.act(x_node, L.views(m, "x"))
    w = L.hbm(L.input(m, "weight")) if "weight" in m.inputs else None
    default_offset = 1.0 if m.pattern.template == "rmsnorm_offset" else 0.0
    out = L.new_act(L.output(m), L.label(m))
    L.emit(RMSNorm(x=x, weight=w, out=out, eps=float(m.params.get("eps", 1e-6)),
                   group=int(L.node(x_node)["shape"][-1]),
                   weight_offset=float(m.params.get("offset", default_offset) or 0.0),
                   fp32_product=str(getattr(m, "variant", "")).startswith("fp32_weight")), m)


def _layernorm_check(m: Any, graph: Any, tokens: int | None) -> str | None:
    group = int(graph.nodes[m.inputs["x"]]["shape"][-1])
    features = per_token_features(graph, m.inputs["x"], tokens)
    if features is not None and features != group:
        return f"LayerNorm over {group} of {features} features (per-head LayerNorm) has no template"
    return None


@register_lowering(layernorm, layernorm_offset, check=_layernorm_check)
def lower_layernorm(L: Lowerer, m: Any) -> None:
    """LayerNorm over the hidden state (nn.LayerNorm with or without bias, Cohere's fp32 form)."""
    x_node = L.input(m, "x")
    x = L.act(x_node, L.views(m, "x"))
    group = int(L.node(x_node)["shape"][-1])
    if group != x.features:
        raise CodegenError(f"LayerNorm over {group} of {x.features} features (per-head LayerNorm) has no template")
    w = L.hbm(L.input(m, "weight")) if "weight" in m.inputs else None
    b = L.hbm(m.inputs["bias"]) if m.inputs.get("bias") else None
    out = L.new_act(L.output(m), L.label(m))
    L.emit(RMSNorm(x=x, weight=w, out=out, eps=float(m.params.get("eps", 1e-5)), group=group, center=True, bias=b,
                   weight_offset=float(m.params.get("offset", 0.0) or 0.0)), m)
