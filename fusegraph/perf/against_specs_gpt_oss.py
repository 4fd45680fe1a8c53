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

``variant=`` picks one of the trees whose device profiles the repository publishes instead
(``benchmarks/prepare_gpt_oss_trees.sh`` extracts them from the git mirrors and prints the exports):

* ``"exp7"`` -- ``MK_GPTOSS_EXP7``: ``9a3c4b5`` as committed (hoisted gate/up DMAs in two H1 halves, gate on HWDGE,
  up on SWDGE, 2-slot cross-expert prefetch ring), with ``NKILIB``;
* ``"exp6"`` -- ``MK_GPTOSS_EXP6``: ``9a3c4b5`` with its local ``use_prefetch_ring`` forced off (the same halves
  issued in line; no argument or env var of the kernel turns the ring off alone), with ``NKILIB``;
* ``"canonical"`` -- ``MK_GPTOSS_CANONICAL`` + ``NKILIB_GPTOSS_CANONICAL``: the pre-experiment profile ("exp 0"):
  ``9a3c4b5`` with ``82fe502``'s ``nki_kernels/moe/selective_expert_impl.py``, which calls nki-library's own
  ``process_gate_up_projection`` / ``process_down_projection`` (one HWDGE DMA per 4-tile HTile: 6 per projection
  and expert), from nki-library ``d2ad3a5`` (the canonical profile's line numbers). That ``nkilib`` is imported
  in isolation, like the checkout's packages, so another ``nkilib`` (``NKILIB``) loaded before or after is
  untouched and not used.

The spec reads the checkout's ``selective_expert_impl.py`` and refuses a variant the tree is not.

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
#: no bundled fusegraph model (fusegraph.models.MODELS): ``bench --against`` prints this kernel's side alone;
#: fusegraph's own GPT-OSS-20B rank is ``benchmarks/bench_tp.py --rows gpt-oss-20b:trn3:8:1`` (docs/performance.md)
MODEL = None
KERNEL = "megakernels/gpt_oss/transformer_gpt_oss.py"
#: the top-level packages of the checkout (also in the Qwen3 checkout ``MK``, possibly another commit)
_PACKAGES = ("megakernels", "nki_kernels")


#: the variants of ``gpt_oss_megakernel``: the env vars naming the checkout (the first one set is used) and the env
#: var naming the variant's own ``nkilib`` (None: ``NKILIB``)
VARIANTS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "default": (("MK_GPTOSS", "MK"), None),
    "exp7": (("MK_GPTOSS_EXP7",), None),
    "exp6": (("MK_GPTOSS_EXP6",), None),
    "canonical": (("MK_GPTOSS_CANONICAL",), "NKILIB_GPTOSS_CANONICAL"),
}
SELECTIVE_EXPERT = "nki_kernels/moe/selective_expert_impl.py"
_PREPARE = "benchmarks/prepare_gpt_oss_trees.sh"


@contextlib.contextmanager
def _isolated_import(*roots: str, packages: tuple[str, ...] = _PACKAGES) -> Iterator[None]:
    """Import from ``roots`` (first on ``sys.path``, in this order) without the ``packages`` modules (``megakernels``
    / ``nki_kernels``, and ``nkilib`` for a variant with its own) another checkout (``MK`` for the Qwen3 spec, maybe
    another commit; ``NKILIB``) already put in ``sys.modules``; afterwards those are restored and ``roots`` leave
    ``sys.path``. Why: the checkouts name their packages alike, and whichever was imported first would otherwise
    shadow the other silently. The kernel imports everything at module level (no function of the kernel or of
    nkilib imports at call time), so the modules it was loaded with stay bound to it."""
    def ours(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in packages)

    saved = {k: sys.modules.pop(k) for k in [k for k in sys.modules if ours(k)]}
    for root in reversed(roots):
        sys.path.insert(0, root)
    try:
        yield
    finally:
        for root in roots:
            sys.path.remove(root)
        for k in [k for k in sys.modules if ours(k)]:
            del sys.modules[k]
        sys.modules.update(saved)


def moe_state(checkout: str) -> str:
    """Which published MoE weight-load state ``checkout``'s ``selective_expert_impl.py`` is, from its text:
    ``"canonical"`` (nki-library's gate/up projection), ``"exp6"`` (prefetch ring forced off), ``"exp7"`` (the ring;
    2c30412 / main read as ``"exp7"`` too, though ``NKI_MOE_LEGACY_WEIGHT_LOAD=1`` at import turns their ring off:
    the text cannot tell) or ``"unknown"``."""
    try:
        with open(os.path.join(checkout, SELECTIVE_EXPERT)) as f:
            text = f.read()
    except OSError:
        return "unknown"
    if "from nkilib.core.mlp.mlp_tkg.mlp_tkg_gate_up_projection import process_gate_up_projection" in text:
        return "canonical"
    if "use_prefetch_ring = False" in text:
        return "exp6"
    if "use_prefetch_ring = (" in text:
        return "exp7"
    return "unknown"


def _variant_dirs(variant: str, commit_dir_env: str) -> tuple[str, str, bool]:
    """(checkout, nkilib dir, whether that nkilib is the variant's own) of ``variant``."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: one of {sorted(VARIANTS)}")
    envs, lib_env = VARIANTS[variant]
    if variant == "default":
        envs = (commit_dir_env, "MK")
    var = next((v for v in envs if os.environ.get(v)), envs[-1])  # a set MK_GPTOSS never falls back
    try:
        mk = _checkout(var, KERNEL)
    except RuntimeError:
        hint = ("commit 9a3c4b5 for the published exp-7 profile" if variant == "default"
                else f"the {variant} tree {_PREPARE} extracts")
        raise RuntimeError(f"set {' (or '.join(envs)}{')' * (len(envs) - 1)} to a checkout of "
                           f"KevGomes1403/nki-moe-megakernel containing {KERNEL} ({hint}); "
                           f"{var}={os.environ.get(var)!r}") from None
    if lib_env is None:
        return mk, _checkout("NKILIB", "nkilib"), False
    try:
        return mk, _checkout(lib_env, "nkilib"), True
    except RuntimeError:
        raise RuntimeError(f"set {lib_env} to the nkilib package dir of nki-library d2ad3a5 for the {variant} "
                           f"variant ({_PREPARE}); {lib_env}={os.environ.get(lib_env)!r}") from None


def _under(path: str, root: str) -> bool:
    return os.path.realpath(path).startswith(os.path.realpath(root) + os.sep)


def gpt_oss_megakernel(layers: int | None = None, cache_len: int = 640,
                       commit_dir_env: str = "MK_GPTOSS", variant: str = "default") -> KernelSpec:
    """The hand-written GPT-OSS-20B megakernel (``transformer_gpt_oss_tkg_multilayer``), rank 0 of TP=8, LNC=1.

    ``cache_len``: positions of the full-attention layers' KV caches (the sliding-window layers keep 128).
    ``variant``: ``"default"`` (``commit_dir_env``, else ``MK``, whatever tree it holds), ``"exp7"``, ``"exp6"`` or
    ``"canonical"`` (see the module docstring)."""
    from fusegraph.nkisim import Abstract

    mk, nkilib, own_lib = _variant_dirs(variant, commit_dir_env)
    state = moe_state(mk)
    if variant != "default" and state != variant:
        raise RuntimeError(f"variant {variant!r}: {os.path.join(mk, SELECTIVE_EXPERT)} is the {state!r} MoE "
                           f"weight load, not {variant!r} (extract the trees with {_PREPARE})")
    if own_lib:
        isolated = _isolated_import(mk, nkilib, packages=_PACKAGES + ("nkilib",))
    else:
        if nkilib not in sys.path:
            sys.path.insert(0, nkilib)
        isolated = _isolated_import(mk)
    with isolated:
        from megakernels.gpt_oss import transformer_gpt_oss as tg  # inside as_nki() (load_spec)
        lib_file = getattr(sys.modules.get("nkilib"), "__file__", None) or ""
    got = os.path.realpath(tg.__file__)
    if not _under(got, mk):
        raise RuntimeError(f"imported the GPT-OSS kernel from {got}, not from the checkout {mk}")
    if own_lib and not _under(lib_file, nkilib):
        raise RuntimeError(f"variant {variant!r} imported nkilib from {lib_file!r}, not from {nkilib}")

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
    label = "" if variant == "default" else f" {variant}"
    return KernelSpec(
        kernel=kernel, args=args, kwargs=kwargs, lnc=LNC, target="trn3", layers=L,
        layer_var="_multilayer_body:layer_idx", shard=(TP, LNC), model=MODEL, cache_len=cache_len,
        name=f"KevGomes1403/nki-moe-megakernel transformer_gpt_oss{label} ({L} layers)",
        notes=f"checkout {mk} (MoE weight load: {state}), nkilib {nkilib}, argument list of {signature}; one rank "
              f"of TP={TP} x LNC={LNC}, bf16; layer 0, 2, ... sliding-window (128-position cache), odd layers "
              f"{cache_len} positions; two all-reduces per layer (attention output via nki-library's "
              f"_sb2sb_all_reduce_gather, MoE output), ring-modeled",
    )


def gpt_oss_megakernel_exp7(layers: int | None = None, cache_len: int = 640) -> KernelSpec:
    """``--against fusegraph.perf.against_specs_gpt_oss:gpt_oss_megakernel_exp7`` (``MK_GPTOSS_EXP7``)."""
    return gpt_oss_megakernel(layers, cache_len, variant="exp7")


def gpt_oss_megakernel_exp6(layers: int | None = None, cache_len: int = 640) -> KernelSpec:
    """``--against fusegraph.perf.against_specs_gpt_oss:gpt_oss_megakernel_exp6`` (``MK_GPTOSS_EXP6``)."""
    return gpt_oss_megakernel(layers, cache_len, variant="exp6")


def gpt_oss_megakernel_canonical(layers: int | None = None, cache_len: int = 640) -> KernelSpec:
    """``--against fusegraph.perf.against_specs_gpt_oss:gpt_oss_megakernel_canonical`` (``MK_GPTOSS_CANONICAL``,
    ``NKILIB_GPTOSS_CANONICAL``)."""
    return gpt_oss_megakernel(layers, cache_len, variant="canonical")
