"""MoE experts of one expert-parallel rank (HF ``DistributedConfig(tp_size=W, ep_size=W)`` at inference).

HF's EP (``transformers/distributed/expert_parallel.py``) shards the experts' weights by expert (``grouped_gemm``:
``Shard(0)``, ``E = num_experts / W`` local experts) and, when the EP group is the TP group (every rank holds the
same batch) and no gradient is needed, runs ``AllReduceEP``: the router is replicated, its global choices are
mapped to the rank's experts (``off = idx // E != rank``; local id ``idx % E``, off-rank choices get the sentinel
``E`` and weight 0), the rank's experts run on every token (``integrations/moe.py`` with ``_is_expert_parallel``:
``batched_mm`` clamps the sentinels to ``E - 1`` and masks their weights once more; ``grouped_mm``, HF's default,
sorts them to the tail, drops them from the ``histc`` offsets and zeroes their rows), and one all-reduce sums the
ranks' partial outputs (``_AllReduceForward``, matched by ``fusegraph.all_reduce``). Forms: ``default``
(``batched_mm``), ``grouped_mm`` / ``grouped_mm_fallback`` (as in ``moe_experts``), and the ``*fp32_weights``
forms for HF Mixtral's fp32 routing weights.

This pattern is that math on the rank: ``sum_k [idx[t,k] // E == rank] * w[t,k] * down[e](act(gate[e] x_t) *
up[e] x_t)`` with ``e = idx[t,k] - rank * E``; ``indices`` are the router's *global* expert ids. ``ep_rank`` is
the rank's constant baked into its program (each rank's program differs only there). It is a separate pattern
(``fusegraph.moe_experts_ep``, template ``moe_experts_ep``) rather than a variant of ``fusegraph.moe_experts``
because it has a param the other forms do not have.
"""
import torch

from fusegraph.matching import ACTIVATIONS, register_pattern

from .moe_experts import _HISTC, DIMS, FP32_WEIGHTS, INPUTS, check_weights, grouped_experts


def _check(m):
    ok = check_weights(m)
    if ok is not True:
        return ok
    e = m.inputs["gate_up_proj"].shape[0]
    # the sentinel clamp's bound (E - 1) is not a dims expression the tracer checks: check it here (the batched
    # form gathers weights with the clamped ids; the grouped forms never read them, the clamp may be gone)
    if not str(getattr(m, "variant", "")).startswith("grouped"):
        try:
            hi = m.arg("aten.clamp.default", 2)
        except KeyError:
            return "EP experts: no clamp of the sentinel expert ids"
        if int(hi) != e - 1:
            return f"EP experts: sentinel clamp to {hi}, expected {e - 1} (local experts {e})"
    if int(m.params.get("ep_rank", -1)) < 0:
        return f"EP experts: rank {m.params.get('ep_rank')} is not a rank"
    return True


def _route(indices, weights, num_local, ep_rank):
    """HF ``AllReduceEP``'s route mask: the rank's local expert ids (the sentinel ``num_local`` for other ranks'
    choices) and the routing weights with other ranks' choices zeroed."""
    off_rank = (indices // num_local) != ep_rank
    return torch.where(off_rank, num_local, indices % num_local), weights.masked_fill(off_rank, 0.0)


@register_pattern(
    "fusegraph.moe_experts_ep",
    template="moe_experts_ep",
    block="moe",
    priority=31,
    inputs=INPUTS,
    params={"ep_rank": 1},
    slots={"act": ACTIVATIONS},
    dims=DIMS,
    check=_check,
)
def moe_experts_ep(x, indices, weights, gate_up_proj, down_proj, *, act, ep_rank):
    """HF ``AllReduceEP`` (the route mask) + ``batched_mm`` experts with ``_is_expert_parallel``, one rank."""
    num_local = gate_up_proj.shape[0]
    local_index, weights = _route(indices, weights, num_local, ep_rank)
    num_top_k = local_index.size(-1)
    num_tokens = x.size(0)
    hidden_dim = x.size(-1)
    selected_hidden_states = x.repeat_interleave(num_top_k, dim=0)
    sample_weights = weights.reshape(-1)
    expert_ids = local_index.reshape(-1)
    sentinel_mask = expert_ids >= num_local
    expert_ids = expert_ids.clamp(0, num_local - 1)
    proj_out = torch.bmm(gate_up_proj[expert_ids], selected_hidden_states.unsqueeze(-1)).squeeze(-1)
    gate, up = proj_out.chunk(2, dim=-1)
    proj_out = act(gate) * up
    proj_out = torch.bmm(down_proj[expert_ids], proj_out.unsqueeze(-1)).squeeze(-1)
    sample_weights = sample_weights.masked_fill(sentinel_mask, 0.0)
    weighted_out = proj_out * sample_weights.unsqueeze(-1)
    final = weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
    return final.to(x.dtype)


# HF Mixtral's router keeps the routing weights in fp32 (see ``moe_experts``' ``*_fp32_weights`` variants): in a
# bf16/fp16 model the rank's experts meet fp32 weights (masked in fp32), fp32 products summed in fp32, one rounding
moe_experts_ep.implementation("fp32_weights", dtypes=["bfloat16", "float16"], inputs=FP32_WEIGHTS)(moe_experts_ep.fn)


def _ep_grouped_mm(x, indices, weights, gate_up_proj, down_proj, *, act, ep_rank, gmm, histc):
    """HF ``AllReduceEP`` + ``grouped_mm`` experts with ``_is_expert_parallel`` (HF's default experts
    implementation): sentinels sort to the tail, ``histc(max=E-1)`` drops them from the offsets, their rows are
    zeroed before and after each grouped matmul."""
    local_index, weights = _route(indices, weights, gate_up_proj.shape[0], ep_rank)
    return grouped_experts(x, local_index, weights, gate_up_proj, down_proj, act=act, gmm=gmm, histc=histc,
                           sentinels=True)


# as ``moe_experts``: bf16 traces aten._grouped_mm, fp32 transformers' opaque fallback op; histc on float ids on CPU
moe_experts_ep.implementation("grouped_mm", dtypes=["bfloat16"], cases=[dict(c, gmm="aten") for c in _HISTC])(
    _ep_grouped_mm)
moe_experts_ep.implementation("grouped_mm_fallback", dtypes=["float32"],
                              cases=[dict(c, gmm="transformers") for c in _HISTC])(_ep_grouped_mm)
moe_experts_ep.implementation("grouped_mm_fp32_weights", dtypes=["bfloat16"], inputs=FP32_WEIGHTS,
                              cases=[dict(c, gmm="aten") for c in _HISTC])(_ep_grouped_mm)
