"""The Python reference VM: run a :class:`~.ir.KernelProgram` instruction by instruction in PyTorch.

It implements each instruction with the same dtype chain as the HF code it replaces, on logical values
(activations ``[T, F]``, HBM tensors in model shapes). Two uses: template tests compare the generated kernel
with it, and :mod:`fusegraph.codegen.bisect` compares it (and the kernel) with eager values op by op.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from . import ir
from .errors import CodegenError

ACT_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}

_OPS: dict[type, Callable] = {}


def _op(cls: type) -> Callable:
    def deco(fn: Callable) -> Callable:
        _OPS[cls] = fn
        return fn

    return deco


def run(program: ir.KernelProgram, env: dict[str, torch.Tensor],
        on_instruction: Callable[[int, ir.Instruction, dict], None] | None = None) -> dict[str, torch.Tensor]:
    """Execute every instruction; ``env`` maps value names to tensors (HBM inputs in model layout, state is
    updated in place). Returns ``env`` with every produced value."""
    for i, ins in enumerate(program.instructions):
        fn = _OPS.get(type(ins))
        if fn is None:
            raise CodegenError(f"the reference VM has no implementation of {ins.opcode}")
        fn(ins, env)
        if on_instruction is not None:
            on_instruction(i, ins, env)
    return env


def _g(env: dict, v: ir.Value | None) -> torch.Tensor | None:
    return None if v is None else env[v.name]


@_op(ir.Load)
def _load(ins: ir.Load, env: dict) -> None:
    env[ins.out.name] = env[ins.src.name].reshape(ins.out.shape)


@_op(ir.Embed)
def _embed(ins: ir.Embed, env: dict) -> None:
    out = env[ins.table.name][env[ins.ids.name].reshape(-1).long()].reshape(ins.out.shape)
    if ins.scale is not None:
        out = out * env[ins.scale.name].reshape(()).to(out.dtype)
    env[ins.out.name] = out


@_op(ir.ScalarGate)
def _sigmoid_gate(ins: ir.ScalarGate, env: dict) -> None:
    env[ins.out.name] = torch.sigmoid(env[ins.gate.name]) * env[ins.x.name]


@_op(ir.RMSNorm)
def _rmsnorm(ins: ir.RMSNorm, env: dict) -> None:
    x = env[ins.x.name]
    T = x.shape[0]
    xf = x.float().reshape(T, -1, ins.group)
    if ins.center:  # LayerNorm: fp32 throughout, one rounding at the end
        xc = xf - xf.mean(-1, keepdim=True)
        y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + ins.eps)
        if ins.weight is not None:
            y = y * env[ins.weight.name].float()
        if ins.bias is not None:
            y = y + env[ins.bias.name].float()
        env[ins.out.name] = y.to(ins.out.dtype).reshape(ins.out.shape)
        return
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ins.eps)).to(x.dtype)
    if ins.weight is not None:
        w = env[ins.weight.name]
        w = w.float() + ins.weight_offset if ins.weight_offset else w
        y = (w * y).to(ins.out.dtype)
    env[ins.out.name] = y.reshape(ins.out.shape)


@_op(ir.Linear)
def _linear(ins: ir.Linear, env: dict) -> None:
    env[ins.out.name] = F.linear(env[ins.x.name], env[ins.weight.name], _g(env, ins.bias)).reshape(ins.out.shape)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


@_op(ir.Rope)
def _rope(ins: ir.Rope, env: dict) -> None:
    x = env[ins.x.name]
    T = x.shape[0]
    xh = x.reshape(T, -1, ins.head_dim)
    cos = env[ins.cos.name].reshape(T, 1, ins.head_dim)
    sin = env[ins.sin.name].reshape(T, 1, ins.head_dim)
    r = ins.rotary_dim or ins.head_dim
    part = xh[..., :r]
    turned = torch.stack((-part[..., 1::2], part[..., 0::2]), -1).flatten(-2) if ins.interleaved else rotate_half(part)
    rot = torch.cat((turned, torch.zeros_like(xh[..., r:])), dim=-1)  # cos/sin padded past r
    env[ins.out.name] = ((xh * cos) + (rot * sin)).reshape(ins.out.shape)


@_op(ir.KVWrite)
def _kv_write(ins: ir.KVWrite, env: dict) -> None:
    cache = env[ins.cache.name]
    B, H, L, D = cache.shape
    val = env[ins.value.name].reshape(B, H, D)
    idx = env[ins.index.name].reshape(-1).long()
    for b in range(B):
        cache[b, :, idx[b], :] = val[b]


@_op(ir.Attention)
def _attention(ins: ir.Attention, env: dict) -> None:
    k, v = env[ins.k_cache.name], env[ins.v_cache.name]
    B, Hkv, L, D = k.shape
    q = env[ins.q.name].reshape(B, -1, 1, D)
    mask = env[ins.mask.name].reshape(B, 1, 1, L)
    k = k.repeat_interleave(ins.groups, dim=1)
    v = v.repeat_interleave(ins.groups, dim=1)
    if ins.rounding == "eager":
        scores = torch.matmul(q, k.transpose(2, 3)) * ins.scale
    else:
        scores = torch.matmul(q.float(), k.float().transpose(2, 3)) * ins.scale
    if ins.softcap:
        scores = torch.tanh(scores / ins.softcap) * ins.softcap
    scores = scores + (mask if ins.rounding == "eager" else mask.float())
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    env[ins.out.name] = torch.matmul(p, v).reshape(ins.out.shape)


@_op(ir.Add)
def _add(ins: ir.Add, env: dict) -> None:
    env[ins.out.name] = env[ins.a.name] + env[ins.b.name]


@_op(ir.GatedAct)
def _gated(ins: ir.GatedAct, env: dict) -> None:
    env[ins.out.name] = ACT_FNS[ins.act](env[ins.gate.name]) * env[ins.up.name]


@_op(ir.Router)
def _router(ins: ir.Router, env: dict) -> None:
    logits = F.linear(env[ins.x.name], env[ins.weight.name])
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    # the kernel's rule: distinct experts, equal probabilities lowest index first (a stable descending sort)
    ranked, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, idx = ranked[:, :ins.top_k], order[:, :ins.top_k]
    if ins.tie is not None:
        tie = (ranked[:, ins.top_k - 1] == ranked[:, ins.top_k]).float().unsqueeze(-1)
        env[ins.tie.name] = tie if ins.tie_first else torch.maximum(env[ins.tie.name], tie)
    if ins.normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    env[ins.weights.name] = top.to(logits.dtype)
    env[ins.indices.name] = idx.to(torch.int32)


@_op(ir.Experts)
def _experts(ins: ir.Experts, env: dict) -> None:
    x = env[ins.x.name]
    gu, dn = env[ins.gate_up.name], env[ins.down.name]
    w, idx = env[ins.weights.name], env[ins.indices.name].long()
    T, K = idx.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float32)
    for t in range(T):
        for k in range(K):
            e = int(idx[t, k])
            g, u = F.linear(x[t:t + 1], gu[e]).chunk(2, dim=-1)
            y = F.linear(ACT_FNS[ins.act](g) * u, dn[e])
            out[t] += (y[0] * w[t, k]).to(x.dtype).float()
    env[ins.out.name] = out.to(x.dtype)


@_op(ir.Elementwise)
def _elementwise(ins: ir.Elementwise, env: dict) -> None:
    T = ins.outputs[0].shape[0]
    local: dict[str, torch.Tensor] = {}
    for v, name, cls in zip(ins.inputs, ins.input_names, ins.input_classes):
        t = env[v.name]
        local[name] = t.reshape(T, -1) if cls == "full" else t.reshape(T, 1) if cls == "token" else t.reshape(-1)
    alu = {"add": torch.add, "subtract": torch.sub, "multiply": torch.mul, "maximum": torch.maximum,
           "minimum": torch.minimum}
    for op in ins.ops:
        kind, _, fn = op.op.partition(":")
        src = [local[s] if isinstance(s, str) else s for s in op.srcs]
        if kind == "copy":
            out = src[0]
        elif kind == "act":
            out = {"exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "abs": torch.abs,
                   "erf": torch.erf, "gelu_apprx_tanh": ACT_FNS["gelu_tanh"], **ACT_FNS}[fn](src[0].float())
        elif kind == "recip":
            out = torch.reciprocal(src[0].float())
        elif kind == "cast":
            out = src[0]
        elif kind == "scalar":
            out = alu[fn](src[0].float(), torch.tensor(src[1]))
        elif kind == "sum":
            out = src[0].float().sum(-1, keepdim=True) * op.scale
        else:
            out = alu[fn](src[0].float(), src[1].float())
        local[op.dst] = out.to(op.dtype)
    for v, name in zip(ins.outputs, ins.output_names):
        env[v.name] = local[name].reshape(v.shape)


@_op(ir.Guard)
def _guard(ins: ir.Guard, env: dict) -> None:
    env[ins.dst.name] = env[ins.x.name].reshape(ins.dst.shape).clone()


@_op(ir.Store)
def _store(ins: ir.Store, env: dict) -> None:
    env[ins.dst.name] = env[ins.x.name].reshape(ins.dst.shape).clone()
