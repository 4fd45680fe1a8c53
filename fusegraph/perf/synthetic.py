"""Kernel programs built straight from a model config (interim, until the lowering of captured programs lands).

The codegen lowering (:mod:`fusegraph.codegen.lowering`) turns matched regions of a *captured* program into a
:class:`~fusegraph.codegen.ir.KernelProgram`. The cost model needs full-size kernels before the matcher and the
lowering are wired end to end, so this module builds the same instruction sequence the lowering produces for the
bundled decoder families (Llama, Qwen3, Qwen3-MoE) directly from their HF config: same instruction kinds, same
module paths and pattern names, same value dtypes and shapes. Once ``fusegraph.codegen.build_decode_kernel``
exists, :mod:`fusegraph.perf.pipeline` uses it and this module only serves tests.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from fusegraph.codegen import ir

V = ir.ValueKind


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


class _B:
    """Value factory keeping argument order (inputs, weights, state) like the lowering does."""

    def __init__(self, tokens: int) -> None:
        self.T = tokens
        self.inputs: list[ir.Value] = []
        self.ins: list[ir.Instruction] = []

    def arg(self, name: str, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> ir.Value:
        v = ir.Value(name, kind, tuple(shape), dtype)
        self.inputs.append(v)
        return v

    def act(self, name: str, features: int, dtype: torch.dtype, kind: str = V.ACT) -> ir.Value:
        return ir.Value(name, kind, (self.T, features), dtype)

    def emit(self, ins: ir.Instruction, *, layer: int | None, module: str, pattern: str) -> None:
        ins.layer, ins.module, ins.pattern = layer, module, pattern
        self.ins.append(ins)


def decode_program(config: Any, *, tokens: int = 1, cache_len: int = 640, dtype: torch.dtype = torch.bfloat16,
                   num_layers: int | None = None, name: str = "fusegraph_step") -> ir.KernelProgram:
    """The decode-step kernel program of a Llama / Qwen3 / Qwen3-MoE config (a dict or an HF config)."""
    H = int(_get(config, "hidden_size"))
    Hq = int(_get(config, "num_attention_heads"))
    Hkv = int(_get(config, "num_key_value_heads", Hq))
    D = int(_get(config, "head_dim", None) or H // Hq)
    Vocab = int(_get(config, "vocab_size"))
    n_layers = int(num_layers if num_layers is not None else _get(config, "num_hidden_layers"))
    eps = float(_get(config, "rms_norm_eps", 1e-6))
    experts = int(_get(config, "num_experts", 0) or 0)
    qk_norm = _get(config, "model_type", "") in ("qwen3", "qwen3_moe") or experts > 0
    T = tokens
    b = _B(T)
    ids = b.arg("token_ids", V.INPUT, (T,), torch.int32)
    cos = b.arg("rope_cos", V.INPUT, (T, D), dtype)
    sin = b.arg("rope_sin", V.INPUT, (T, D), dtype)
    mask = b.arg("attn_mask", V.INPUT, (T, cache_len), dtype)
    pos = b.arg("kv_position", V.INPUT, (T,), torch.int32)
    table = b.arg("embed_tokens_weight", V.WEIGHT, (Vocab, H), dtype)
    h = b.act("embed_tokens", H, dtype)
    b.emit(ir.Embed(ids=ids, table=table, out=h), layer=None, module="model.embed_tokens", pattern="embedding")
    state: list[ir.Value] = []
    for i in range(n_layers):
        p = f"model.layers.{i}"
        s = f"l{i}"

        def w(label: str, shape: tuple[int, ...]) -> ir.Value:
            return b.arg(f"{s}_{label}_weight", V.WEIGHT, shape, dtype)

        def lin(x: ir.Value, label: str, mod: str, n_out: int) -> ir.Value:
            out = b.act(f"{s}_{label}", n_out, dtype)
            b.emit(ir.Linear(x=x, weight=w(label, (n_out, x.features)), out=out), layer=i, module=f"{p}.{mod}",
                   pattern="linear")
            return out

        x = b.act(f"{s}_input_layernorm", H, dtype)
        b.emit(ir.RMSNorm(x=h, weight=w("input_layernorm", (H,)), out=x, eps=eps, group=H), layer=i,
               module=f"{p}.input_layernorm", pattern="rmsnorm")
        q = lin(x, "q_proj", "self_attn.q_proj", Hq * D)
        k = lin(x, "k_proj", "self_attn.k_proj", Hkv * D)
        v = lin(x, "v_proj", "self_attn.v_proj", Hkv * D)
        if qk_norm:
            qn, kn = b.act(f"{s}_q_norm", Hq * D, dtype), b.act(f"{s}_k_norm", Hkv * D, dtype)
            b.emit(ir.RMSNorm(x=q, weight=w("q_norm", (D,)), out=qn, eps=eps, group=D), layer=i,
                   module=f"{p}.self_attn.q_norm", pattern="rmsnorm")
            b.emit(ir.RMSNorm(x=k, weight=w("k_norm", (D,)), out=kn, eps=eps, group=D), layer=i,
                   module=f"{p}.self_attn.k_norm", pattern="rmsnorm")
            q, k = qn, kn
        qr, kr = b.act(f"{s}_q_rope", Hq * D, dtype), b.act(f"{s}_k_rope", Hkv * D, dtype)
        b.emit(ir.Rope(x=q, cos=cos, sin=sin, out=qr, head_dim=D), layer=i, module=f"{p}.self_attn", pattern="rope")
        b.emit(ir.Rope(x=k, cos=cos, sin=sin, out=kr, head_dim=D), layer=i, module=f"{p}.self_attn", pattern="rope")
        kc = ir.Value(f"{s}_keys", V.STATE, (T, Hkv, cache_len, D), dtype)
        vc = ir.Value(f"{s}_values", V.STATE, (T, Hkv, cache_len, D), dtype)
        state += [kc, vc]
        b.emit(ir.KVWrite(cache=kc, value=kr, index=pos), layer=i, module=f"{p}.self_attn", pattern="kv_cache_update")
        b.emit(ir.KVWrite(cache=vc, value=v, index=pos), layer=i, module=f"{p}.self_attn", pattern="kv_cache_update")
        o = b.act(f"{s}_attn", Hq * D, dtype)
        b.emit(ir.Attention(q=qr, k_cache=kc, v_cache=vc, mask=mask, out=o, scale=D ** -0.5, groups=Hq // Hkv),
               layer=i, module=f"{p}.self_attn", pattern="decode_attention")
        a = lin(o, "o_proj", "self_attn.o_proj", H)
        h1 = b.act(f"{s}_attn_add", H, dtype)
        b.emit(ir.Add(a=h, b=a, out=h1), layer=i, module=f"{p}", pattern="residual_add")
        x2 = b.act(f"{s}_post_attention_layernorm", H, dtype)
        b.emit(ir.RMSNorm(x=h1, weight=w("post_attention_layernorm", (H,)), out=x2, eps=eps, group=H), layer=i,
               module=f"{p}.post_attention_layernorm", pattern="rmsnorm")
        if experts:
            K = int(_get(config, "num_experts_per_tok"))
            inter = int(_get(config, "moe_intermediate_size"))
            rw = b.act(f"{s}_router_w", K, dtype, kind=V.ROUTING)
            ri = ir.Value(f"{s}_router_idx", V.ROUTING, (T, K), torch.int32)
            b.emit(ir.Router(x=x2, weight=w("mlp_gate", (experts, H)), weights=rw, indices=ri, top_k=K,
                             normalize=bool(_get(config, "norm_topk_prob", True))), layer=i, module=f"{p}.mlp.gate",
                   pattern="moe_router")
            y = b.act(f"{s}_experts", H, dtype)
            b.emit(ir.Experts(x=x2, weights=rw, indices=ri, gate_up=w("experts_gate_up_proj", (experts, 2 * inter, H)),
                              down=w("experts_down_proj", (experts, H, inter)), out=y, intermediate=inter),
                   layer=i, module=f"{p}.mlp.experts", pattern="moe_experts")
        else:
            inter = int(_get(config, "intermediate_size"))
            g = lin(x2, "gate_proj", "mlp.gate_proj", inter)
            u = lin(x2, "up_proj", "mlp.up_proj", inter)
            m = b.act(f"{s}_act", inter, dtype)
            b.emit(ir.GatedAct(gate=g, up=u, out=m, act="silu"), layer=i, module=f"{p}.mlp", pattern="swiglu")
            y = lin(m, "down_proj", "mlp.down_proj", H)
        h = b.act(f"{s}_mlp_add", H, dtype)
        b.emit(ir.Add(a=h1, b=y, out=h), layer=i, module=f"{p}", pattern="residual_add")
    hn = b.act("norm", H, dtype)
    b.emit(ir.RMSNorm(x=h, weight=b.arg("norm_weight", V.WEIGHT, (H,), dtype), out=hn, eps=eps, group=H), layer=None,
           module="model.norm", pattern="rmsnorm")
    logits = b.act("lm_head", Vocab, dtype)
    b.emit(ir.Linear(x=hn, weight=b.arg("lm_head_weight", V.WEIGHT, (Vocab, H), dtype), out=logits), layer=None,
           module="lm_head", pattern="linear")
    out = ir.Value("logits", V.OUTPUT, (T, Vocab), dtype)
    b.emit(ir.Store(x=logits, dst=out), layer=None, module="lm_head", pattern="store")
    b.inputs += state
    return ir.KernelProgram(name, T, b.ins, inputs=b.inputs, outputs=[out] + state,
                            meta={"synthetic": True, "cache_len": cache_len})
