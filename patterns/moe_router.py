"""MoE top-k router: logits, softmax in fp32, top-k, optional renormalization, cast back (Qwen3-MoE, Mixtral...)."""
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
