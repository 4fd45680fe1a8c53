"""MoE experts for the chosen top-k: gather each slot's expert weights, gate/up, activation, down, weighted sum.

One math (``sum_k w[t,k] * down[e](act(gate[e] x_t) * up[e] x_t)``, ``e = idx[t,k]``, weights in HF's
``[E, 2I, H]`` / ``[E, H, I]`` layout), three traced forms:

* ``batched_mm``: HF ``batched_mm_experts_forward`` (``W[ids]`` gathers + ``bmm``);
* ``grouped_mm``: HF ``grouped_mm_experts_forward`` (sort by expert, ``histc``/``cumsum`` offsets, grouped matmul:
  ``aten._grouped_mm`` in bf16, the opaque ``transformers.grouped_mm_fallback`` op otherwise; ``histc`` on float
  ids on CPU, int ids on other devices);
* ``eager_rewrite``: fusegraph's capture rewrite of HF's eager expert loop
  (``bmm(x[S,1,H], W[idx].transpose(1, 2))``).
"""
import torch

from fusegraph.matching import ACTIVATIONS, Input, register_pattern


def check_weights(m):
    """True when the expert weights are [E, 2I, H] / [E, H, I] for x's H, else the reason (shared with the
    expert-parallel pattern)."""
    x, gu, down = m.inputs["x"], m.inputs["gate_up_proj"], m.inputs["down_proj"]
    if None in (x.shape, gu.shape, down.shape) or len(gu.shape) != 3 or len(down.shape) != 3:
        return "expert weights must be [E, 2I, H] and [E, H, I]"
    e, two_i, h = gu.shape
    if down.shape != (e, h, two_i // 2) or x.shape[-1] != h:
        return f"expert weights {gu.shape} / {down.shape} do not fit x {x.shape}"
    return True


#: the experts' inputs (HF's fused ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]) and example dims, shared
#: with the expert-parallel form (``moe_experts_ep``)
INPUTS = [Input("x", "T H"), Input("indices", "T K", dtype="int64"), Input("weights", "T K"),
          Input("gate_up_proj", "E 2*I H", kind="weight"), Input("down_proj", "E H I", kind="weight")]
DIMS = {"T": (2, 3), "K": (2, 3), "E": (4, 6), "H": (16, 32), "I": (8, 24)}


@register_pattern(
    "fusegraph.moe_experts",
    template="moe_experts",
    block="moe",
    priority=30,
    inputs=INPUTS,
    slots={"act": ACTIVATIONS},
    dims=DIMS,
    check=check_weights,
)
def moe_experts(x, indices, weights, gate_up_proj, down_proj, *, act):
    """HF ``batched_mm`` experts."""
    num_top_k = indices.size(-1)
    num_tokens = x.size(0)
    hidden_dim = x.size(-1)
    selected_hidden_states = x.repeat_interleave(num_top_k, dim=0)
    sample_weights = weights.reshape(-1)
    expert_ids = indices.reshape(-1)
    proj_out = torch.bmm(gate_up_proj[expert_ids], selected_hidden_states.unsqueeze(-1)).squeeze(-1)
    gate, up = proj_out.chunk(2, dim=-1)
    proj_out = act(gate) * up
    proj_out = torch.bmm(down_proj[expert_ids], proj_out.unsqueeze(-1)).squeeze(-1)
    weighted_out = proj_out * sample_weights.unsqueeze(-1)
    final = weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
    return final.to(x.dtype)


def _grouped(gmm):
    if gmm == "aten":
        return lambda a, w, offs: torch.nn.functional.grouped_mm(a, w, offs=offs)
    import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.grouped_mm_fallback)

    return lambda a, w, offs: torch.ops.transformers.grouped_mm_fallback(a, w, offs=offs)


def _grouped_mm(x, indices, weights, gate_up_proj, down_proj, *, act, gmm, histc):
    return grouped_experts(x, indices, weights, gate_up_proj, down_proj, act=act, gmm=gmm, histc=histc)


def grouped_experts(x, indices, weights, gate_up_proj, down_proj, *, act, gmm, histc, sentinels=False):
    """transformers' grouped_mm experts op by op (sort the choices by expert, histc offsets, two grouped matmuls,
    weight, unsort, sum over top-k). ``sentinels``: the expert-parallel variant, where ids past the rank's experts
    (other ranks' choices) sort to the tail, are clamped into range and their rows zeroed before and after each
    grouped matmul -- the same ops with those in between, so one function traces both."""
    mm = _grouped(gmm)
    num_top_k = indices.size(-1)
    num_tokens = x.size(0)
    hidden_dim = x.size(-1)
    sample_weights = weights.reshape(-1)
    expert_ids = indices.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids)
    selected = x[perm // num_top_k]
    sample_weights_g = sample_weights[perm]
    histc_input = expert_ids_g.float() if histc == "float" else expert_ids_g.int()
    num_experts = gate_up_proj.shape[0]
    tokens_per_expert = torch.histc(histc_input, bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    if sentinels:
        sentinel_mask = (expert_ids_g >= num_experts).unsqueeze(-1)
        expert_ids_g.clamp_(max=num_experts - 1)
        selected.masked_fill_(sentinel_mask, 0.0)
    proj_out = mm(selected.to(gate_up_proj.dtype), gate_up_proj.transpose(-2, -1), offsets)
    if sentinels:
        proj_out = proj_out.masked_fill(sentinel_mask, 0.0)
    gate, up = proj_out.chunk(2, dim=-1)
    proj_out = act(gate) * up
    proj_out = mm(proj_out.to(down_proj.dtype), down_proj.transpose(-2, -1), offsets)
    if sentinels:
        proj_out = proj_out.masked_fill(sentinel_mask, 0.0)
    weighted_out = proj_out * sample_weights_g.unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
    weighted_out = weighted_out[inv_perm]
    final = weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
    return final.to(x.dtype)


@moe_experts.implementation("eager_rewrite")
def _eager_rewrite(x, indices, weights, gate_up_proj, down_proj, *, act):
    tokens, hidden = x.shape
    top_k = indices.shape[-1]
    expert_ids = indices.reshape(-1)
    routing = weights.reshape(-1, 1)
    xs = x.unsqueeze(1).expand(tokens, top_k, hidden).reshape(tokens * top_k, 1, hidden)
    gate_up = torch.bmm(xs, gate_up_proj[expert_ids].transpose(1, 2)).squeeze(1)
    gate, up = gate_up.chunk(2, dim=-1)
    h = (act(gate) * up).unsqueeze(1)
    down = torch.bmm(h, down_proj[expert_ids].transpose(1, 2)).squeeze(1)
    weighted = (down * routing).to(x.dtype)
    return weighted.view(tokens, top_k, hidden).sum(dim=1)


# HF histograms float ids on CPU/MPS and int ids elsewhere; CPU has no int histc kernel, so trace that on meta
_HISTC = [{"histc": "float"}, {"histc": "int", "_device": "meta"}]
# bf16: aten._grouped_mm; other dtypes: transformers' opaque fallback op (as HF dispatches under torch.compile)
moe_experts.implementation("grouped_mm", dtypes=["bfloat16"], cases=[dict(c, gmm="aten") for c in _HISTC])(_grouped_mm)
moe_experts.implementation("grouped_mm_fallback", dtypes=["float32"],
                           cases=[dict(c, gmm="transformers") for c in _HISTC])(_grouped_mm)

# HF Mixtral's router keeps the routing weights in fp32 (no cast back): in a bf16/fp16 model the experts meet fp32
# weights, ``proj_out * weights`` is an fp32 product and the top-k sum is in fp32, rounded once at the end. Same
# math, another dtype flow: the lowering reads the variant name (``batched_mm_fp32_weights``,
# ``grouped_mm_fp32_weights``) and skips the per-term rounding.
# (shared with the expert-parallel form)
FP32_WEIGHTS = [*INPUTS[:2], Input("weights", "T K", dtype="float32"), *INPUTS[3:]]
moe_experts.implementation("batched_mm_fp32_weights", dtypes=["bfloat16", "float16"], inputs=FP32_WEIGHTS)(
    moe_experts.fn)
moe_experts.implementation("grouped_mm_fp32_weights", dtypes=["bfloat16"], inputs=FP32_WEIGHTS,
                           cases=[dict(c, gmm="aten") for c in _HISTC])(_grouped_mm)
# the eager loop's rewrite rounds each term (``(down * routing).to(x.dtype)``) whatever the routing weights' dtype:
# the lowering keeps the per-term rounding for it
moe_experts.implementation("eager_rewrite_fp32_weights", dtypes=["bfloat16", "float16"], inputs=FP32_WEIGHTS)(
    _eager_rewrite)
