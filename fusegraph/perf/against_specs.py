"""Specs for ``fusegraph bench --against``: how to call published NKI kernels at Qwen3-30B-A3B shapes, shape-only.

Only argument *shapes* live here; the kernels are read from the user's checkouts (not part of the project):

* ``MK`` -- a checkout of ``KevGomes1403/nki-moe-megakernel`` (the hand-written 48-layer Qwen3 megakernel);
* ``NKILIB`` -- a directory holding ``aws-neuron/nki-library``'s ``nkilib`` package (the hand kernel imports
  nki-library too); ``shared/tools/prepare_anchors.sh`` extracts both and prints the exports.

Shapes are one rank of the published deployment (TP=4 x LNC=2, batch 1, one new token): 32/4 = 8 query heads and
4/4 = 1 KV head of 128, hidden 2048, 128 experts with top-8, expert intermediate 768/4 = 192, bf16. The hand
kernel's argument layout follows its NxDI driver (``qwen_with_megakernel.py``: per-layer weights and KV caches as
separate tensors, ``replica_groups=([0..tp-1],)``, launched ``[2]``).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from .against import KernelSpec

TP, LNC = 4, 2
H, D, Q_HEADS, KV_HEADS, EXPERTS, TOP_K, EXPERT_I = 2048, 128, 32 // TP, 1, 128, 8, 768 // TP
MODEL = "qwen3-30b-a3b"


def _bf16() -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16


def _checkout(var: str, marker: str) -> str:
    path = os.environ.get(var)
    if not path or not os.path.exists(os.path.join(path, marker)):
        raise RuntimeError(f"set {var} to a checkout containing {marker} (see shared/tools/prepare_anchors.sh)")
    return os.path.abspath(path)


def qwen3_megakernel(layers: int | None = None, cache_len: int = 640) -> KernelSpec:
    """The hand-written Qwen3-30B-A3B megakernel (``megakernels/qwen3_moe/transformer_qwen.py``), one rank."""
    from fusegraph.nkisim import Abstract

    mk = _checkout("MK", "megakernels/qwen3_moe/transformer_qwen.py")
    nkilib = _checkout("NKILIB", "nkilib")
    import sys

    for p in (nkilib, mk):
        if p not in sys.path:
            sys.path.insert(0, p)
    from megakernels.qwen3_moe import transformer_qwen as tq  # imported inside as_nki() by load_spec

    L = layers or tq.NUM_LAYERS
    bf = _bf16()

    def per_layer(*shape: int) -> list[Any]:
        return [Abstract(shape, bf) for _ in range(L)]

    args: list[Any] = [Abstract((1, 1, H), bf)]
    args += per_layer(Q_HEADS * D, H) + per_layer(KV_HEADS * D, H) + per_layer(KV_HEADS * D, H)  # Wq, Wk, Wv
    args += per_layer(Q_HEADS * D, H)  # Wo
    args += per_layer(D) + per_layer(D) + per_layer(H) + per_layer(1, H)  # q/k norm, pre/post-attention norm
    args += per_layer(H, EXPERTS) + per_layer(EXPERTS, H, 2 * EXPERT_I) + per_layer(EXPERTS, EXPERT_I, H)
    args += per_layer(1, 1, cache_len, D) + per_layer(1, 1, cache_len, D)  # K, V caches
    args += [Abstract((1, D), bf), Abstract((1, D), bf), Abstract((1, 1), np.int32)]  # cos, sin, position_ids
    return KernelSpec(
        kernel=tq.get_multilayer_kernel_jit(L), args=args, kwargs={"replica_groups": (list(range(TP)),)},
        lnc=LNC, target="trn3", layers=L, layer_var="_multilayer_body:layer_idx", shard=(TP, LNC), model=MODEL,
        cache_len=cache_len, name=f"KevGomes1403/nki-moe-megakernel transformer_qwen ({L} layers)",
        nki_api="sdk-2.27",  # its README: "Tested with AWS Neuron SDK v2.27"; it calls .ap on column slices
        notes="program 0's two all-reduces per layer are costed as ring collectives (TP=4, one chip: ~15.6 us per "
              "layer; ~31.2 us with the LNC partner's two); the published CC time, 27.77 us/layer, also holds the "
              "wait for the slowest rank and is not a like quantity (docs/performance.md, The collective figure)",
    )


def _nkilib() -> None:
    import sys

    path = _checkout("NKILIB", "nkilib")
    if path not in sys.path:
        sys.path.insert(0, path)


#: fusegraph regions (without the "L<i>." prefix) of the attention half of a decoder layer
ATTENTION_REGIONS = ("input_layernorm.*", "q_proj.*", "k_proj.*", "v_proj.*", "q_norm.*", "k_norm.*", "self_attn.*",
                     "o_proj.*")
#: ... and of the routed experts (moe_tkg takes the router's top-k as inputs)
EXPERT_REGIONS = ("experts.*",)


def nkilib_attention_block_tkg(layers: int | None = None, cache_len: int = 768) -> KernelSpec:
    """nki-library's ``attention_block_tkg`` (RMSNorm, QKV, q/k-norm, RoPE, KV write, attention, O-proj) for one
    Qwen3 layer on one rank. ``cache_len`` must be a multiple of 256 with LNC=2 (the kernel shards the context in
    two and tiles each half by 128), so 768 rather than the published 640."""
    from fusegraph.nkisim import Abstract

    _nkilib()
    from nkilib.core.utils.common_types import QuantizationType
    from nkilib.experimental.transformer.attention_block_tkg import attention_block_tkg

    bf = _bf16()
    S = cache_len
    kw = dict(
        X=Abstract((1, 1, H), bf), X_hidden_dim_actual=None, rmsnorm_X_enabled=True, rmsnorm_X_eps=1e-6,
        rmsnorm_X_gamma=Abstract((1, H), bf), W_qkv=Abstract((H, (Q_HEADS + 2 * KV_HEADS) * D), bf), bias_qkv=None,
        quantization_type_qkv=QuantizationType.NONE, weight_dequant_scale_qkv=None, input_dequant_scale_qkv=None,
        rmsnorm_QK_pre_rope_enabled=True, rmsnorm_QK_pre_rope_eps=1e-6, rmsnorm_QK_pre_rope_W_Q=Abstract((1, D), bf),
        rmsnorm_QK_pre_rope_W_K=Abstract((1, D), bf), cos=Abstract((D // 2, 1, 1), bf),
        sin=Abstract((D // 2, 1, 1), bf), rope_contiguous_layout=True, rmsnorm_QK_post_rope_enabled=False,
        rmsnorm_QK_post_rope_eps=1e-6, rmsnorm_QK_post_rope_W_Q=None, rmsnorm_QK_post_rope_W_K=None,
        K_cache_transposed=False, active_blocks_table=None, K_cache=Abstract((1, 1, S, D), bf),
        V_cache=Abstract((1, 1, S, D), bf), attention_mask=Abstract((S, 1, Q_HEADS, 1), np.uint8), sink=None,
        update_cache=True, kv_cache_update_idx=Abstract((1, 1), np.uint32), W_out=Abstract((Q_HEADS * D, H), bf),
        bias_out=None, quantization_type_out=QuantizationType.NONE, weight_dequant_scale_out=None,
        input_dequant_scale_out=None, transposed_out=False, out_in_sb=False,
    )
    return KernelSpec(kernel=attention_block_tkg, kwargs=kw, lnc=LNC, target="trn3", layers=1, shard=(TP, LNC),
                      model=MODEL, cache_len=cache_len, generated_regions=ATTENTION_REGIONS,
                      name="nki-library attention_block_tkg (one Qwen3 layer's attention)",
                      notes="compared with fusegraph's attention regions of a layer; no all-reduce in either")


def nkilib_moe_tkg(layers: int | None = None) -> KernelSpec:
    """nki-library's ``moe_tkg`` (selective experts: gate/up, SiLU, down, weighted sum) for one Qwen3 layer on one
    rank: one token, 128 experts, top-8, intermediate 192 per rank; the router's top-k are its inputs."""
    from fusegraph.nkisim import Abstract

    _nkilib()
    from fusegraph.nkisim import nki_modules
    from nkilib.core.moe.moe_tkg.moe_tkg import moe_tkg
    from nkilib.core.utils.common_types import ActFnType, ExpertAffinityScaleMode

    bf = _bf16()
    args = (Abstract((1, H), bf), Abstract((EXPERTS, H, 2, EXPERT_I), bf), Abstract((EXPERTS, EXPERT_I, H), bf),
            Abstract((1, EXPERTS), np.float32), Abstract((1, TOP_K), np.int32))
    kw = dict(is_all_expert=False, expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE,
              activation_fn=ActFnType.SiLU, output_dtype=nki_modules()["nki.language"].bfloat16)
    return KernelSpec(kernel=moe_tkg, args=args, kwargs=kw, lnc=LNC, target="trn3", layers=1, shard=(TP, LNC),
                      model=MODEL, generated_regions=EXPERT_REGIONS,
                      name="nki-library moe_tkg (one Qwen3 layer's routed experts)",
                      notes="compared with fusegraph's expert region of a layer (router and norm excluded on both)")
