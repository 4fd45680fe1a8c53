"""MoE top-k router: logits, softmax in fp32, top-k, optional renormalization, cast back (Qwen3-MoE, Mixtral...).

Variant ``rounded`` (bf16/fp16 only): the softmax, top-k and renormalization in the logits' own dtype with every
step rounded, as keras-hub's Mixtral router runs under a bf16 policy (its StableHLO: ``x - max``, ``exp``, the
sum accumulated in fp32 and rounded, the division, each in bf16; the top-k on those probabilities; the
renormalization's sum likewise). PyTorch's ``F.softmax`` on a bf16 tensor is a different function (fp32 inside,
one rounding at the end), so the variant is spelled op by op, in the form the StableHLO importer emits for that
idiom (``fusegraph/stablehlo/emit.py``). No HF transformers model routes this way; the variant exists for
keras-hub/JAX programs.

Variant ``fp32_weights`` (bf16/fp16 only): HF Mixtral's router, fp32 like the default but with no cast back, so
the routing weights leave it in fp32 (see ``moe_experts``' ``*_fp32_weights`` variants)."""
import torch

from fusegraph.matching import Input, register_pattern


def _check(m):
    x, w = m.inputs["x"], m.inputs["weight"]
    if x.shape is None or w.shape is None or len(w.shape) != 2 or x.shape[-1] != w.shape[1]:
        return f"router weight {w.shape} does not match x {x.shape}"
    return True


@register_pattern(
    "fusegraph.moe_router",
    template="moe_router",
    block="moe",
    priority=30,
    inputs=[Input("x", "T H"), Input("weight", "E H", kind="weight")],
    outputs=("weights", "indices"),
    params={"top_k": 2},
    cases=[{"normalize": True}, {"normalize": False}],
    dims={"T": (3, 5), "H": (16, 40), "E": (6, 14)},
    check=_check,
)
def moe_router(x, weight, *, top_k, normalize):
    """``topk(softmax(x @ weight.T, fp32), top_k)``, weights renormalized to sum 1 if ``normalize``, cast to x's dtype."""
    router_logits = torch.nn.functional.linear(x, weight)
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, top_k, dim=-1)
    if normalize:
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    router_top_value = router_top_value.to(router_logits.dtype)
    return router_top_value, router_indices


@moe_router.implementation("rounded", dtypes=["bfloat16", "float16"])
def _rounded(x, weight, *, top_k, normalize):
    """keras-hub's router in bf16: ``e = exp(l - max(l))``, ``p = e / sum(e.float()).to(dtype)``, top-k of ``p``,
    ``top / sum(top.float()).to(dtype)``: each op rounds to the logits' dtype."""
    router_logits = torch.nn.functional.linear(x, weight)
    e = torch.exp(router_logits - router_logits.amax(-1, keepdim=True))
    router_probs = e / e.float().sum(-1, keepdim=True).to(e.dtype)
    router_top_value, router_indices = torch.topk(router_probs, top_k, dim=-1)
    if normalize:
        router_top_value = router_top_value / router_top_value.float().sum(-1, keepdim=True).to(router_top_value.dtype)
    return router_top_value, router_indices


@moe_router.implementation("fp32_weights", dtypes=["bfloat16", "float16"])
def _fp32_weights(x, weight, *, top_k, normalize):
    """HF Mixtral's ``MixtralTopKRouter`` in bf16/fp16: ``softmax(logits.float())``, top-k and the renormalization
    in fp32, and no cast back: the routing weights stay fp32 (the experts' ``fp32_weights`` variants take them)."""
    router_logits = torch.nn.functional.linear(x, weight)
    router_probs = torch.nn.functional.softmax(router_logits.float(), dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, top_k, dim=-1)
    if normalize:
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    return router_top_value, router_indices
