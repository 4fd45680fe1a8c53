"""Spec for ``fusegraph bench --against``: the hand-written GPT-OSS-20B megakernel, one rank, shape-only.

The kernel is read from the user's checkout of ``KevGomes1403/nki-moe-megakernel`` (not part of the project):

* ``MK_GPTOSS`` (falling back to ``MK``) -- a checkout holding ``megakernels/gpt_oss/transformer_gpt_oss.py`` and
  its vendored ``nki_kernels/``. The profile the repository publishes ("exp 7",
  ``megakernels/gpt_oss/moe_dma_experiments_log.md`` @d6c1eb4: 4124.95 us raw for 24 layers) was taken with the tree
  committed next as ``9a3c4b5`` (branch ``debug_gpt_oss``; code-identical to ``d6e69cf`` on main): the profile
  attributes DMAs to ``transformer_gpt_oss.py:223/233/301``, which are the in-kernel RoPE/mask build and X load of
  that commit, while its MoE files equal d6c1eb4's. So ``9a3c4b5`` is the checkout to compare with; ``d6c1eb4``
  (driver-prepared masks and RoPE) and ``main`` (an MXFP4 path beside the bf16 one) have other argument lists,
  and the spec follows whichever the checkout has.
* ``NKILIB`` -- a directory holding ``aws-neuron/nki-library``'s ``nkilib`` package (the kernel imports its
  allocator, helpers and ``transformer_tkg._sb2sb_all_reduce_gather``).

Shapes are one rank of the published deployment (``gpt_oss_with_megakernel.py``: TP=8, LNC=1 on trn3, bf16,
batch 1, one new token): hidden 2880 padded to 3072, 64/8 = 8 query heads and 8/8 = 1 KV head of 64 (fused QKV
width (8 + 2) x 64 = 640), 32 experts top-4, expert intermediate 2880 padded to 3072 / 8 = 384, learned sinks and
biases on QKV / O / router / experts. Even layers use sliding-window attention with a 128-position cache (NxDI's
SWA cache is the window; ``9a3c4b5`` asserts ``K_caches[0].shape[-2] == 128``), odd layers a ``cache_len``
cache. Per-layer weights and caches are separate tensors (``_build_multilayer_kernel``), the launch is ``[1]``,
``replica_groups=([0..7],)``.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import sys
from typing import Any, Iterator

import numpy as np

from .against import KernelSpec
from .against_specs import _bf16, _checkout

TP, LNC = 8, 1
H, H_ACTUAL, D, Q_HEADS, KV_HEADS = 3072, 2880, 64, 64 // TP, 8 // TP
EXPERTS, TOP_K, EXPERT_I = 32, 4, 3072 // TP
SLIDING_WINDOW = 128
#: no bundled fusegraph model: GPT-OSS-20B is built from the gpt_oss family config in benchmarks/bench_flagships.py,
#: and ``fusegraph bench --against`` fails on a model name fusegraph.models.MODELS lacks (modelperf.against.
#: cost_generated calls model_config before its NotRun handling), so the spec names none; --models still may
MODEL = None
KERNEL = "megakernels/gpt_oss/transformer_gpt_oss.py"
#: the top-level packages of the checkout (also in the Qwen3 checkout ``MK``, possibly another commit)
_PACKAGES = ("megakernels", "nki_kernels")


@contextlib.contextmanager
def _isolated_import(root: str) -> Iterator[None]:
    """Import from ``root`` with its packages first on ``sys.path`` and without the ``megakernels`` /
    ``nki_kernels`` modules another checkout (``MK`` for the Qwen3 spec, maybe another commit) already put in
    ``sys.modules``; afterwards those are restored. Why: both checkouts name their packages alike, and whichever
    was imported first would otherwise shadow the other silently. The kernel imports everything at module level,
    so the modules it was loaded with stay bound to it."""
    def ours(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in _PACKAGES)

    saved = {k: sys.modules.pop(k) for k in [k for k in sys.modules if ours(k)]}
    sys.path.insert(0, root)
    try:
        yield
    finally:
        sys.path.remove(root)
        for k in [k for k in sys.modules if ours(k)]:
            del sys.modules[k]
        sys.modules.update(saved)


def gpt_oss_megakernel(layers: int | None = None, cache_len: int = 640,
                       commit_dir_env: str = "MK_GPTOSS") -> KernelSpec:
    """The hand-written GPT-OSS-20B megakernel (``transformer_gpt_oss_tkg_multilayer``), rank 0 of TP=8, LNC=1.

    ``cache_len``: positions of the full-attention layers' KV caches (the sliding-window layers keep 128)."""
    from fusegraph.nkisim import Abstract

    var = commit_dir_env if os.environ.get(commit_dir_env) else "MK"  # a set MK_GPTOSS never falls back
    try:
        mk = _checkout(var, KERNEL)
    except RuntimeError:
        raise RuntimeError(f"set {commit_dir_env} (or MK) to a checkout of KevGomes1403/nki-moe-megakernel "
                           f"containing {KERNEL} (commit 9a3c4b5 for the published exp-7 profile); "
                           f"{var}={os.environ.get(var)!r}") from None
    nkilib = _checkout("NKILIB", "nkilib")
    if nkilib not in sys.path:
        sys.path.insert(0, nkilib)
    with _isolated_import(mk):
        from megakernels.gpt_oss import transformer_gpt_oss as tg  # inside as_nki() (load_spec)
    got = os.path.realpath(tg.__file__)
    if not got.startswith(os.path.realpath(mk) + os.sep):
        raise RuntimeError(f"imported the GPT-OSS kernel from {got}, not from the checkout {mk}")

    body = inspect.signature(tg._multilayer_body).parameters
    L = layers or tg.NUM_LAYERS
    bf = _bf16()

    def per_layer(*shape: int, dtype: Any = bf) -> list[Any]:
        return [Abstract(shape, dtype) for _ in range(L)]

    def kv_caches() -> list[Any]:  # even layers sliding-window, odd layers full attention
        return [Abstract((1, KV_HEADS, SLIDING_WINDOW if i % 2 == 0 else cache_len, D), bf) for i in range(L)]

    qkv = (Q_HEADS + 2 * KV_HEADS) * D
    args: list[Any] = [Abstract((1, 1, H), bf)]  # X: [B, S_tkg, H]
    args += per_layer(H, qkv) + per_layer(1, qkv)  # Wqkv, bqkv
    args += per_layer(Q_HEADS * D, H) + per_layer(1, H)  # Wo, bo (pre-divided by TP)
    args += per_layer(Q_HEADS, 1)  # learned sinks
    args += per_layer(1, H) + per_layer(1, H)  # input / post-attention RMSNorm gammas
    args += per_layer(H, EXPERTS) + per_layer(1, EXPERTS)  # router weight (transposed), bias
    args += per_layer(EXPERTS, H, 2, EXPERT_I) + per_layer(EXPERTS, 2, EXPERT_I)  # fused gate/up, bias
    args += per_layer(EXPERTS, EXPERT_I, H) + per_layer(EXPERTS, H)  # down, bias
    # main's MXFP4 path adds GateUpScale_* / DownScale_* here; the bf16 kernel (mxfp4=False) takes none
    args += kv_caches() + kv_caches()  # K, V: [B, kv_heads, S, d_head]
    kwargs: dict[str, Any] = {"replica_groups": (list(range(TP)),)}
    if "mask_full" in body:  # d6c1eb4: RoPE and masks prepared by the driver
        rope = Abstract((D // 2, 1, 1), bf)  # [d_head // 2, B, S_tkg]
        args += [rope, rope, rope, rope]  # cos/sin window, cos/sin global (one rotary: the same tensors)
        args += [Abstract((SLIDING_WINDOW, 1, Q_HEADS, 1), bf), Abstract((cache_len, 1, Q_HEADS, 1), bf)]
        signature = "d6c1eb4 (driver-prepared masks and RoPE)"
    elif "cos_unperm" in body:  # 9a3c4b5 and later: masks built and RoPE permuted in the kernel
        rope = Abstract((1, 1, D // 2), bf)  # [B, S_tkg, d_head // 2]
        args += [rope, rope]
        kwargs["num_heads_per_rank"] = Q_HEADS
        signature = "9a3c4b5+ (in-kernel masks and RoPE)"
    else:
        raise RuntimeError(f"{KERNEL} in {mk}: unknown argument list {list(body)}")
    args += [Abstract((1, 1), np.int32), Abstract((1, 1), np.int32)]  # position_ids, position_ids % (window - 1)
    build = tg.get_multilayer_kernel_jit
    kernel = build(L, mxfp4=False) if "mxfp4" in inspect.signature(build).parameters else build(L)
    return KernelSpec(
        kernel=kernel, args=args, kwargs=kwargs, lnc=LNC, target="trn3", layers=L,
        layer_var="_multilayer_body:layer_idx", shard=(TP, LNC), model=MODEL, cache_len=cache_len,
        name=f"KevGomes1403/nki-moe-megakernel transformer_gpt_oss ({L} layers)",
        notes=f"checkout {mk}, argument list of {signature}; one rank of TP={TP} x LNC={LNC}, bf16; layer 0, 2, "
              f"... sliding-window (128-position cache), odd layers {cache_len} positions; two all-reduces per "
              f"layer (attention output via nki-library's _sb2sb_all_reduce_gather, MoE output), ring-modeled",
    )
