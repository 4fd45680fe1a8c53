"""Rewrite HF's eager MoE expert loop into a static gather + batched-matmul form.

HF transformers 5 MoE blocks (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V2/V3, OLMoE and ~50 others) decorate
their experts class with ``use_experts_implementation``. With ``experts_implementation="eager"`` the forward is a
Python loop over ``expert_mask.sum(...).nonzero()``: data-dependent, so dynamo breaks the graph several times per
MoE layer. For a static-shape decode step the same math is: gather the chosen experts' weights, two batched
matmuls with the gated activation in between, scale by the routing weights and sum over the top-k slots.

Which classes qualify is decided by their *code*, not their names: a class qualifies when its original forward
has the same bytecode as the reference loop (Qwen3-MoE's), so a model family whose loop differs (GPT-OSS's
clamped SwiGLU, for instance) is never rewritten.
"""
from __future__ import annotations

import logging
from functools import lru_cache
from typing import Iterable

import torch

from .base import CaptureRewrite, hf_modeling_classes, register_capture_rewrite

log = logging.getLogger(__name__)

_REFERENCE = ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeExperts")


def _original_forward(cls: type):
    fwd = cls.__dict__.get("forward")
    fwd = getattr(fwd, "_fusegraph_original", fwd)  # our own dispatcher
    return getattr(fwd, "__wrapped__", None)  # HF's use_experts_implementation wrapper


def _fingerprint(fn) -> tuple | None:
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    return (code.co_code, code.co_names, code.co_varnames, tuple(c for c in code.co_consts if not hasattr(c, "co_code")))


@lru_cache(maxsize=1)
def _reference_fingerprint() -> tuple | None:
    try:
        mod = __import__(_REFERENCE[0], fromlist=[_REFERENCE[1]])
    except Exception as e:  # transformers missing or reorganized: the rewrite simply finds nothing
        log.debug("reference experts class unavailable: %s", e)
        return None
    return _fingerprint(_original_forward(getattr(mod, _REFERENCE[1])))


_seen: dict[str, list[type]] = {}


def _experts_classes(mod) -> list[type]:
    ref = _reference_fingerprint()
    return [obj for obj in list(vars(mod).values())
            if isinstance(obj, type) and obj.__module__ == mod.__name__ and hasattr(obj, "_apply_gate")
            and _fingerprint(_original_forward(obj)) == ref]


def find_classes() -> Iterable[type]:
    """Experts classes in already-imported transformers modeling modules whose eager loop is the reference one."""
    if _reference_fingerprint() is None:
        return []
    return hf_modeling_classes(_experts_classes, _seen)


def applies(module: torch.nn.Module) -> bool:
    config = getattr(module, "config", None)
    return getattr(config, "_experts_implementation", None) == "eager"


def forward(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor) -> torch.Tensor:
    """Same result as the eager loop: sum_k w[t,k] * down[e](act(gate[e] x_t) * up[e] x_t), e = idx[t,k]."""
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    expert_ids = top_k_index.reshape(-1)
    routing = top_k_weights.reshape(-1, 1)
    if getattr(module, "_is_expert_parallel", False):
        # sentinel id == num_experts marks slots served elsewhere; the loop skips them
        valid = expert_ids < module.num_experts
        routing = routing * valid.unsqueeze(-1).to(routing.dtype)
        expert_ids = expert_ids.clamp(max=module.num_experts - 1)
    x = hidden_states.unsqueeze(1).expand(tokens, top_k, hidden).reshape(tokens * top_k, 1, hidden)
    # row-vector @ W^T, the orientation of F.linear: bit-identical to the loop's per-expert linear on CPU
    gate_up = torch.bmm(x, module.gate_up_proj[expert_ids].transpose(1, 2)).squeeze(1)
    gate, up = gate_up.chunk(2, dim=-1)
    act = (module.act_fn(gate) * up).unsqueeze(1)
    down = torch.bmm(act, module.down_proj[expert_ids].transpose(1, 2)).squeeze(1)
    weighted = (down * routing).to(hidden_states.dtype)
    # the loop accumulates with index_add_ in expert order; for top-2 that is the same sum exactly
    return weighted.view(tokens, top_k, hidden).sum(dim=1)


register_capture_rewrite(
    CaptureRewrite(
        name="fusegraph.hf_eager_experts",
        description="HF MoE experts with experts_implementation='eager' (a data-dependent per-expert loop) -> "
        "gather of the chosen experts' weights + batched matmuls (no graph breaks).",
        find_classes=find_classes,
        applies=applies,
        forward=forward,
    )
)
