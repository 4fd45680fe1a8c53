"""The hand-written Qwen3-30B-A3B megakernel (``KevGomes1403/nki-moe-megakernel``, ``megakernels/qwen3_moe``) run
unmodified in fusegraph's interpreter.

Entry point and argument layout are the kernel's own NxDI driver's (``qwen_with_megakernel.py``):
``get_multilayer_kernel_jit(L)[2](X, *Wq, *Wk, *Wv, *Wo, *qn, *kn, *gpre, *gpost, *router, *gate_up, *down, *K, *V,
cos, sin, position_ids, replica_groups=([0, 1, 2, 3],))`` -- one TP rank of TP=4, LNC=2 (the shapes are in
``fusegraph.perf.against_specs.qwen3_megakernel``).  Needs ``MK`` (the checkout) and ``NKILIB`` (the kernel imports
nki-library); see ``shared/tools/prepare_anchors.sh``.

    MK=/tmp/anch/mk NKILIB=/tmp/anch/nkilib-fixed python tests/nkisim/anchor_megakernel.py [shape LAYERS | data LAYERS]

* ``shape_only(48)``: all 48 layers, shape-only, one rank (its replica group names the 3 ranks not simulated);
* ``data(2)``: 2 layers with random data on all 4 ranks x 2 programs (8 threads), returning every rank's outputs;
  :func:`kv_reference` recomputes layer 0's new K/V cache row from the kernel's documented weight layout.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any

import ml_dtypes
import numpy as np

from fusegraph import nkisim
from fusegraph.nkisim.apiversion import use_api_version

BF16 = ml_dtypes.bfloat16
TP = 4
H, D, S_PRIOR, POS = 2048, 128, 640, 5


def available() -> bool:
    mk, lib = os.environ.get("MK"), os.environ.get("NKILIB")
    return bool(mk and lib and os.path.exists(os.path.join(mk, "megakernels/qwen3_moe/transformer_qwen.py"))
                and os.path.isdir(os.path.join(lib, "nkilib")))


def spec(layers: int):
    """The kernel and its shape-only arguments (``fusegraph.perf.against_specs``), imported inside as_nki()."""
    from fusegraph.perf.against import load_spec

    return load_spec("fusegraph.perf.against_specs:qwen3_megakernel", layers=layers)


def shape_only(layers: int = 48) -> tuple[Any, float]:
    """One rank (both programs), shape-only; returns (profile, seconds)."""
    s = spec(layers)
    t0 = time.perf_counter()
    with use_api_version(s.nki_api):  # SDK 2.27: .ap on a column slice reads the slice (apiversion.py)
        nkisim.run(s.kernel, *s.args, lnc=s.lnc, target=s.target, shape_only=True, **s.kwargs)
    return nkisim.last_profile(), time.perf_counter() - t0


def _random_args(layers: int, rng: np.random.Generator, x0: np.ndarray) -> tuple:
    """One rank's arguments with random data: small weights, unit-ish norms, a KV cache, cos/sin of a position."""
    def w(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(BF16)

    def near_one(*shape: int) -> np.ndarray:
        return (1 + rng.standard_normal(shape, dtype=np.float32) * 0.1).astype(BF16)

    L = layers
    a: list[Any] = [x0]
    a += [w(1024, H) for _ in range(L)] + [w(D, H) for _ in range(L)] + [w(D, H) for _ in range(L)]
    a += [w(1024, H) for _ in range(L)]
    a += [near_one(D) for _ in range(L)] + [near_one(D) for _ in range(L)] + [near_one(H) for _ in range(L)]
    a += [near_one(1, H) for _ in range(L)]
    a += [w(H, 128, scale=0.05) for _ in range(L)] + [w(128, H, 384) for _ in range(L)]
    a += [w(128, 192, H) for _ in range(L)]
    a += [w(1, 1, S_PRIOR, D, scale=1.0) for _ in range(2 * L)]
    ang = POS * 1e6 ** (-np.arange(D // 2) / (D // 2))
    a += [np.concatenate([np.cos(ang), np.cos(ang)])[None].astype(BF16),
          np.concatenate([np.sin(ang), np.sin(ang)])[None].astype(BF16), np.array([[POS]], np.int32)]
    return tuple(a)


def data(layers: int = 2, seed: int = 0) -> tuple[list[tuple], list[tuple], float]:
    """All ``TP`` ranks with data (the hidden state is replicated, weights and KV caches differ per rank).
    Returns (per-rank inputs, per-rank outputs, seconds); inputs are copies taken before the run."""
    s = spec(layers)
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal((1, 1, H), dtype=np.float32).astype(BF16)
    rank_args = [_random_args(layers, rng, x0) for _ in range(TP)]
    before = [tuple(np.array(a, copy=True) if isinstance(a, np.ndarray) else a for a in ra) for ra in rank_args]
    t0 = time.perf_counter()
    with use_api_version(s.nki_api):
        outs = nkisim.run(s.kernel, lnc=s.lnc, ranks=TP, rank_args=rank_args, target=s.target, **s.kwargs)
    return before, outs, time.perf_counter() - t0


def arg_index(layers: int) -> dict[str, int]:
    """Position of each layer-0 argument in the flat signature."""
    names = ["Wq", "Wk", "Wv", "Wo", "qn", "kn", "gpre", "gpost", "router", "gate_up", "down", "K", "V"]
    return {n: 1 + i * layers for i, n in enumerate(names)}


def _bf(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(BF16).astype(np.float32)


def kv_reference(args: tuple, layers: int) -> tuple[np.ndarray, np.ndarray]:
    """Layer 0's new K and V rows from the kernel's documented semantics (``attn_fused_nki.py``): pre-attention
    RMSNorm of the residual (eps 1e-6) times gamma, rounded to bf16; ``k = W_k h`` with the weight stored
    tile-transposed (``W_pt[p, t*d + f] = W[f, t*d + p]``), rounded to bf16; K RMSNorm over d times its gamma,
    rounded to bf16; RoPE with rotate-half, every product and the sum rounded to bf16 like the kernel."""
    ix = arg_index(layers)
    x = np.asarray(args[0], np.float32).reshape(H)
    gpre = np.asarray(args[ix["gpre"]], np.float32)
    h = _bf(x / np.sqrt(np.mean(x * x) + 1e-6) * gpre)

    def logical(w_pt: np.ndarray) -> np.ndarray:  # [d, H] stored tile-transposed -> W[f, t*d + p]
        w = np.asarray(w_pt, np.float32).reshape(D, H // D, D)  # [p, t, f]
        return w.transpose(2, 1, 0).reshape(D, H)

    k = _bf(logical(args[ix["Wk"]]) @ h)
    v = _bf(logical(args[ix["Wv"]]) @ h)
    kn = np.asarray(args[ix["kn"]], np.float32)
    k = _bf(k / np.sqrt(np.mean(k * k) + 1e-6) * kn)
    cos = _bf(np.asarray(args[-3], np.float32).reshape(D))
    sin = _bf(np.asarray(args[-2], np.float32).reshape(D))
    rot = np.concatenate([-k[D // 2:], k[:D // 2]])
    k = _bf(_bf(k * cos) + _bf(rot * sin))
    return k, v


def main(argv: list[str]) -> int:
    import logging

    logging.basicConfig(level=logging.ERROR)
    if not available():
        print("set MK and NKILIB (shared/tools/prepare_anchors.sh)", file=sys.stderr)
        return 2
    mode = argv[0] if argv else "shape"
    layers = int(argv[1]) if len(argv) > 1 else (48 if mode == "shape" else 2)
    if mode == "shape":
        p, sec = shape_only(layers)
        print(p.summary())
        print(f"{layers} layers shape-only in {sec:.1f} s")
        return 0
    before, outs, sec = data(layers)
    ix = arg_index(layers)
    ys = [np.asarray(o[0], np.float32) for o in outs]
    print(f"{layers} layers with data on {TP} ranks x 2 programs in {sec:.1f} s; |Y| max {np.abs(ys[0]).max():.3f}; "
          f"ranks agree: {all(np.array_equal(y, ys[0]) for y in ys)}")
    for r, (args, out) in enumerate(zip(before, outs)):
        k_ref, v_ref = kv_reference(args, layers)
        k_new = np.asarray(out[1], np.float32)[0, 0, POS]
        v_new = np.asarray(out[1 + layers], np.float32)[0, 0, POS]
        print(f"rank {r}: layer-0 K row max err {np.abs(k_new - k_ref).max():.4f} (|K| max {np.abs(k_ref).max():.2f}),"
              f" V row max err {np.abs(v_new - v_ref).max():.4f} (|V| max {np.abs(v_ref).max():.2f})")
    del ix
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
