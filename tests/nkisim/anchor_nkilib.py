"""nki-library kernels run unmodified in fusegraph's interpreter and checked against the library's own torch
references (``<kernel>_torch.py`` next to each kernel).

The library is not part of the project: point ``NKILIB`` at a directory holding the ``nkilib`` package (see
``shared/tools/prepare_anchors.sh``, which extracts ``aws-neuron/nki-library`` and prints the exports).  Each case
builds inputs the way the library's own integration test does (``test/integration/nkilib/core/...``: shapes,
dtypes, layouts, LNC; our own seeded random data), runs the kernel through ``nkisim.run`` (what the library's
test harness does with ``nki.cpu_simulate(kernel)[lnc](**inputs)``) and compares with the reference at the
library test's tolerance.

    NKILIB=/tmp/anch/nkilib-fixed python tests/nkisim/anchor_nkilib.py [case ...]

``tests/nkisim/test_anchor_nkilib.py`` runs the same cases under pytest (marked slow; skipped without NKILIB).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import ml_dtypes
import numpy as np

from fusegraph import nkisim

ENV = "NKILIB"
BF16 = ml_dtypes.bfloat16


def nkilib_root() -> str | None:
    """The directory holding the ``nkilib`` package, or None when ``NKILIB`` is unset or wrong."""
    root = os.environ.get(ENV)
    if not root or not os.path.isdir(os.path.join(root, "nkilib")):
        return None
    return root


def _install_test_utils_shim() -> None:
    """``qkv_tkg_torch.py`` imports ``norm_name2func_torch`` from nki-library's *test* utilities (which need the
    non-public ``neuron_dtypes``); provide that one mapping, built from the library's own norm references."""
    name = "test.integration.nkilib.utils.test_kernel_common"
    if name in sys.modules:
        return
    from nkilib.core.subkernels.layernorm_torch import layer_norm_torch_ref
    from nkilib.core.subkernels.rmsnorm_torch import rms_norm_torch_ref
    from nkilib.core.utils.common_types import NormType

    parts = name.split(".")
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        if pkg not in sys.modules:
            m = types.ModuleType(pkg)
            m.__path__ = []
            sys.modules[pkg] = m
    mod = types.ModuleType(name)
    mod.norm_name2func_torch = {
        NormType.NO_NORM: lambda *x, **_: x[0],
        NormType.RMS_NORM: rms_norm_torch_ref,
        NormType.LAYER_NORM: layer_norm_torch_ref,
        NormType.RMS_NORM_SKIP_GAMMA: rms_norm_torch_ref,
    }
    sys.modules[name] = mod


def _install_neuron_dtypes_shim() -> None:
    """``moe_tkg_torch.py`` imports ``mx_torch_common``, which imports the non-public ``neuron_dtypes`` package for
    its MX helpers (``static_cast`` into x4-packed types).  The non-MX references never call it; the shim casts
    ordinary dtypes and refuses packed ones, so an MX case would fail loudly instead of silently."""
    if "neuron_dtypes" in sys.modules:
        return
    try:
        importlib.import_module("neuron_dtypes")
        return
    except ImportError:
        pass
    mod = types.ModuleType("neuron_dtypes", "test shim: ordinary dtype casts only (no x4 packing)")

    def static_cast(x: Any, dtype: Any) -> np.ndarray:
        if "x4" in str(dtype):
            raise NotImplementedError("neuron_dtypes shim: x4-packed casts (MX) are not available")
        return np.asarray(x).astype(dtype)

    mod.static_cast = static_cast
    sys.modules["neuron_dtypes"] = mod


def load(module: str) -> types.ModuleType:
    """Import ``nkilib.<module>`` with ``nki`` bound to the interpreter."""
    root = nkilib_root()
    if root is None:
        raise RuntimeError(f"set {ENV} to a directory holding the nkilib package")
    if root not in sys.path:
        sys.path.insert(0, root)
    with nkisim.as_nki():
        if module.endswith("_torch") and "qkv" in module:
            _install_test_utils_shim()
        if module.endswith("moe_tkg_torch"):
            _install_neuron_dtypes_shim()
        return importlib.import_module(f"nkilib.{module}")


def to_torch(v: Any, preserve_bf16: bool = False) -> Any:
    """NumPy -> torch like nki-library's ``torch_ref_wrapper``: 16-bit floats become float32, except bfloat16 with
    ``preserve_lower_precision`` (the reference then computes op by op in bfloat16, like the kernel's tiles)."""
    import torch

    if isinstance(v, np.ndarray):
        if v.dtype == BF16 and preserve_bf16:
            return torch.from_numpy(v.astype(np.float32)).to(torch.bfloat16)
        if v.dtype in (np.float16, BF16):
            v = v.astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(v))
    return v


def to_np(v: Any) -> np.ndarray:
    if hasattr(v, "detach"):
        v = v.detach().float().numpy() if v.dtype.is_floating_point else v.detach().numpy()
    return np.asarray(v)


def f32(a: Any) -> np.ndarray:
    a = np.asarray(a)
    return a.astype(np.float32) if a.dtype.kind == "f" or a.dtype == BF16 else a


@dataclass
class Case:
    """One configuration of one kernel: ``run()`` returns ``{output name: (kernel value, reference value)}``."""

    name: str
    kernel: str
    run: Callable[[], dict[str, tuple[np.ndarray, np.ndarray]]]
    rtol: float
    atol: float
    note: str = ""
    exact: tuple[str, ...] = field(default_factory=tuple)  # outputs compared for equality (indices)


def close(got: np.ndarray, ref: np.ndarray, rtol: float, atol: float) -> np.ndarray:
    """nki-library's own criterion (``maxAllClose``, mode "max", in its test utils' ``comparators.py``):
    ``|got - ref| <= atol + rtol * max|ref|`` for every element (the range of the whole output, not per element)."""
    brange = np.abs(ref)
    brange = float(np.max(brange[np.isfinite(brange)])) if brange.size else 0.0
    return np.abs(got.astype(np.float64) - ref.astype(np.float64)) <= atol + rtol * brange


def check(case: Case) -> dict[str, float]:
    """Run a case and assert every output matches; returns the max abs error per output."""
    errs = {}
    for out, (got, ref) in case.run().items():
        got, ref = f32(got), f32(ref).reshape(np.shape(got))
        if not np.any(ref != 0) and not np.any(got != 0):
            raise AssertionError(f"{case.name}: {out}: kernel output and reference are both all zeros (nothing ran?)")
        if out in case.exact:
            np.testing.assert_array_equal(got, ref, err_msg=f"{case.name}: {out}")
            errs[out] = 0.0
            continue
        ok = close(got, ref, case.rtol, case.atol)
        err = np.abs(got.astype(np.float64) - ref)
        if not ok.all():
            i = np.unravel_index(int(np.argmax(err)), err.shape)
            raise AssertionError(
                f"{case.name}: {out}: {int((~ok).sum())} of {ok.size} elements outside atol {case.atol} + rtol "
                f"{case.rtol} x max|ref|; largest error {err[i]:.4g} at {i} (got {got[i]}, ref {ref[i]})"
            )
        errs[out] = float(err.max()) if got.size else 0.0
    return errs


def _nl_dtype(dtype: Any) -> Any:
    """The ``nl.<dtype>`` object for a NumPy dtype (kernels compare dtype names: ``str(nl.float16)``)."""
    return getattr(nkisim.nki_modules()["nki.language"], np.dtype(dtype).name)


def _rng(seed: int = 42) -> np.random.Generator:
    return np.random.default_rng(seed)


# ------------------------------------------------------------------------------------------ norms


def _norm_case(kind: str, lnc: int, b: int, s: int, h: int, hidden_actual: int | None = None,
               shard_on_h: bool = False) -> Case:
    def run():
        r = _rng()
        x = r.standard_normal((b, s, h)).astype(np.float16)
        gamma = r.standard_normal((1, h)).astype(np.float16)
        out = np.zeros((128, b * s, h // 128), np.float16)
        if kind == "rmsnorm_tkg":
            k = load("core.subkernels.rmsnorm_tkg").rmsnorm_tkg
            refm = load("core.subkernels.rmsnorm_torch")
            ref_fn = refm.rmsnorm_tkg_torch_ref if lnc == 2 else refm.rmsnorm_tkg_torch_ref_lnc1
            kw = dict(hidden_actual=hidden_actual, shard_on_h=shard_on_h)
            nkisim.run(k, x, gamma, out, lnc=lnc, target="trn2", **kw)
            ref = ref_fn(input=to_torch(x), gamma=to_torch(gamma), output=to_torch(out), **kw)
        else:
            beta = r.standard_normal((1, h)).astype(np.float16)
            k = load("core.subkernels.layernorm_tkg").layernorm_tkg
            refm = load("core.subkernels.layernorm_torch")
            ref_fn = refm.layernorm_tkg_torch_ref if (lnc == 2 or shard_on_h) else refm.layernorm_tkg_torch_ref_lnc1
            nkisim.run(k, x, gamma, out, beta=beta, shard_on_h=shard_on_h, lnc=lnc, target="trn2")
            ref = ref_fn(input=to_torch(x), gamma=to_torch(gamma), output=to_torch(out), beta=to_torch(beta),
                         shard_on_h=shard_on_h)
        return {"out": (out, to_np(ref["out"]))}

    tag = f"lnc{lnc}_b{b}_s{s}_h{h}" + (f"_ha{hidden_actual}" if hidden_actual else "")
    tag += "_shardh" if shard_on_h else ""
    return Case(f"{kind}[{tag}]", kind, run, rtol=2e-2, atol=1e-5)


# ------------------------------------------------------------------------------------------ rope


def _rope_case(d_head: int, B: int, n_heads: int, S: int, contiguous: bool, relayout: bool, lnc: int) -> Case:
    def run():
        r = _rng()
        x = r.standard_normal((d_head, B, n_heads, S)).astype(BF16)
        cos = r.standard_normal((d_head // 2, B, S)).astype(BF16)
        sin = r.standard_normal((d_head // 2, B, S)).astype(BF16)
        k = load("core.embeddings.rope").RoPE
        ref = load("core.embeddings.rope_torch").rope_torch_ref
        kw = dict(lnc_shard=True, contiguous_layout=contiguous, relayout_in_sbuf=relayout)
        got = nkisim.run(k, x, cos, sin, lnc=lnc, target="trn2", **kw)
        want = ref(to_torch(x), to_torch(cos), to_torch(sin), **kw)
        return {"x_out": (got, to_np(next(iter(want.values()))))}

    layout = ("contig" if contiguous else "interleaved") + ("_relayout" if relayout else "")
    tag = f"d{d_head}_b{B}_h{n_heads}_s{S}_{layout}_lnc{lnc}"
    return Case(f"rope[{tag}]", "rope", run, rtol=2 ** -7, atol=1e-3)


def _rope_hf_case(b: int, qh: int, kvh: int, s: int, d: int, dtype: Any, lnc: int) -> Case:
    def run():
        r = _rng()
        q = r.standard_normal((b, qh, s, d)).astype(dtype)
        k_ = r.standard_normal((b, kvh, s, d)).astype(dtype)
        cos = r.standard_normal((b, s, d)).astype(dtype)
        sin = r.standard_normal((b, s, d)).astype(dtype)
        q_out, k_out = np.zeros_like(q), np.zeros_like(k_)
        kern = load("core.embeddings.rope_hf").rope_hf
        ref = load("core.embeddings.rope_hf_torch").rope_hf_torch_ref
        nkisim.run(kern, q, k_, q_out, k_out, cos=cos, sin=sin, lnc=lnc, target="trn2")
        t = functools.partial(to_torch, preserve_bf16=True)  # torch_ref_wrapper(..., preserve_lower_precision=True)
        want = ref(t(q), t(k_), t(q_out), t(k_out), cos=t(cos), sin=t(sin))
        return {
            "q_out": (q_out, to_np(want["q_out"]).astype(dtype)),
            "k_out": (k_out, to_np(want["k_out"]).astype(dtype)),
        }

    dn = np.dtype(dtype).name
    # the library test: rtol=atol=1e-6 with the reference cast to the kernel's dtype (preserve_lower_precision)
    return Case(f"rope_hf[b{b}_qh{qh}_kvh{kvh}_s{s}_d{d}_{dn}_lnc{lnc}]", "rope_hf", run, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------ router top-k


def _router_topk_case(T: int, H: int, E: int, k: int, act: str, bias: bool, pre_norm: bool, norm_topk: bool,
                      indirect_scatter: bool, lnc: int = 2) -> Case:
    def run():
        import torch

        mod = load("core.router_topk.router_topk")
        ref = load("core.router_topk.router_topk_torch").router_topk_torch_ref
        types_ = load("core.utils.common_types")
        act_fn = getattr(types_.RouterActFnType, act)
        g = torch.Generator().manual_seed(0)

        def gen(shape):
            return torch.empty(shape, dtype=torch.float32).uniform_(-0.1, 0.1, generator=g).numpy().astype(BF16)

        x = gen((H, T))
        w = gen((H, E))
        w_bias = gen((1, E)) if bias else None
        logits = np.zeros((T, E), BF16)
        affin = np.zeros((T, E), BF16)
        index = np.zeros((T, k), np.uint32)
        kw = dict(act_fn=act_fn, k=k, x_hbm_layout=mod.XHBMLayout_H_T__0, x_sb_layout=mod.XSBLayout_tp102__0,
                  router_pre_norm=pre_norm, norm_topk_prob=norm_topk, use_indirect_dma_scatter=indirect_scatter)
        nkisim.run(mod.router_topk, x, w, w_bias, logits, affin, index, lnc=lnc, target="trn2", **kw)
        want = ref(x=to_torch(x), w=to_torch(w), w_bias=to_torch(w_bias), router_logits=to_torch(logits),
                   expert_affinities=to_torch(affin), expert_index=to_torch(index.astype(np.int64)), **kw)
        if not isinstance(want, dict):
            want = dict(zip(("router_logits", "expert_index", "expert_affinities"), want))
        return {
            "router_logits": (logits, to_np(want["router_logits"])),
            "expert_index": (index, to_np(want["expert_index"])),
            "expert_affinities": (affin, to_np(want["expert_affinities"])),
        }

    tag = f"T{T}_H{H}_E{E}_k{k}_{act.lower()}{'_bias' if bias else ''}{'_prenorm' if pre_norm else ''}" \
          f"{'_normk' if norm_topk else ''}{'_scatter' if indirect_scatter else ''}"
    return Case(f"router_topk[{tag}]", "router_topk", run, rtol=2e-2, atol=1e-5, exact=("expert_index",))


# ------------------------------------------------------------------------------------------ qkv (TKG path)


def _qkv_case(lnc: int, B: int, S: int, H: int, nq: int, nkv: int, d: int, fused_add: bool) -> Case:
    def run():
        mod = load("core.qkv.qkv")
        ref = load("core.qkv.qkv_tkg_torch").qkv_tkg_torch_ref
        ct = load("core.utils.common_types")
        r = _rng()
        I = (nq + 2 * nkv) * d
        x = r.standard_normal((B, S, H)).astype(BF16)
        w = (r.standard_normal((H, I)) * 0.05).astype(BF16)
        gamma = r.standard_normal((1, H)).astype(BF16)
        mlp_prev = r.standard_normal((B, S, H)).astype(BF16) if fused_add else None
        attn_prev = r.standard_normal((B, S, H)).astype(BF16) if fused_add else None
        kw = dict(output_layout=ct.QKVOutputLayout.BSD, fused_residual_add=fused_add, mlp_prev=mlp_prev,
                  attention_prev=attn_prev, fused_norm_type=ct.NormType.RMS_NORM, gamma_norm_weights=gamma,
                  norm_eps=1e-6, d_head=d, num_q_heads=nq, num_kv_heads=nkv)
        got = nkisim.run(mod.qkv, x, w, lnc=lnc, target="trn2", **kw)
        want = ref(hidden=to_torch(x), qkv_w=to_torch(w), norm_w=to_torch(gamma), fused_add=fused_add,
                   mlp_prev=to_torch(mlp_prev), attn_prev=to_torch(attn_prev), d_head=d, num_kv_heads=nkv,
                   num_q_heads=nq, output_layout=ct.QKVOutputLayout.BSD, eps=1e-6, norm_type=ct.NormType.RMS_NORM)
        outs = got if isinstance(got, tuple) else (got,)
        res = {"out": (outs[0], to_np(want["out"]).astype(BF16))}
        if fused_add and len(outs) > 1:
            res["fused_hidden"] = (outs[1], to_np(want["fused_hidden"]).astype(BF16))
        return res

    return Case(f"qkv_tkg[lnc{lnc}_B{B}_S{S}_H{H}_q{nq}_kv{nkv}_d{d}{'_fusedadd' if fused_add else ''}]", "qkv_tkg",
                run, rtol=2e-2, atol=1e-5)


# ------------------------------------------------------------------------------------------ output projection


def _oproj_case(lnc: int, B: int, n_heads: int, S: int, d_head: int, H: int, bias: bool, transpose_out: bool) -> Case:
    def run():
        mod = load("core.output_projection.output_projection_tkg")
        ref = load("core.output_projection.output_projection_tkg_torch").output_projection_tkg_torch_ref
        ct = load("core.utils.common_types")
        r = _rng()
        att = r.standard_normal((d_head, B, n_heads, S)).astype(BF16)
        w = (r.standard_normal((d_head * n_heads, H)) * 0.05).astype(BF16)
        b = (r.standard_normal((1, H)) * 100).astype(BF16) if bias else None
        kw = dict(quantization_type=ct.QuantizationType.NONE, weight_scale=None, input_scale=None,
                  TRANSPOSE_OUT=transpose_out, OUT_IN_SB=False)
        got = nkisim.run(mod.output_projection_tkg, att, w, b, lnc=lnc, target="trn2", **kw)
        want = ref(attention=to_torch(att), weight=to_torch(w), bias=to_torch(b), **kw)
        want = next(iter(want.values())) if isinstance(want, dict) else want
        return {"out": (got, to_np(want).astype(BF16))}

    tag = f"lnc{lnc}_B{B}_n{n_heads}_S{S}_d{d_head}_H{H}{'_bias' if bias else ''}{'_T' if transpose_out else ''}"
    return Case(f"output_projection_tkg[{tag}]", "output_projection_tkg", run, rtol=2e-2, atol=1e-5)


# ------------------------------------------------------------------------------------------ gen_mask


def _gen_mask_case(lnc: int, batch: int, q_head: int, s_ctx: int, s_active: int) -> Case:
    def run():
        import torch

        mod = load("core.attention.gen_mask_tkg")
        ref = load("core.attention.gen_mask_tkg_torch").gen_mask_tkg_hbm_torch_ref
        r = np.random.default_rng(42)
        cache_lens = r.integers(1, s_ctx, size=(batch,)).astype(np.float32)
        pos = np.repeat(cache_lens, s_active)[None, :].astype(np.float32)  # [1, bs * s_active]
        kw = dict(bs=batch, q_head=q_head, s_active=s_active, s_prior=s_ctx)
        got = nkisim.run(mod.gen_mask_tkg_hbm, pos, lnc=lnc, target="trn2", **kw)
        want = ref[lnc](pos_ids_hbm=torch.from_numpy(pos), **kw)
        return {"mask_out_hbm": (got, to_np(want))}

    return Case(f"gen_mask_tkg[lnc{lnc}_b{batch}_qh{q_head}_s{s_ctx}_a{s_active}]", "gen_mask_tkg", run, rtol=0,
                atol=0)


# ------------------------------------------------------------------------------------------ cascaded max, cumsum


def _cascaded_max_case(lnc: int, b: int, s: int, v: int) -> Case:
    def run():
        x = np.random.default_rng(42).standard_normal((b, s, v)).astype(np.float32)
        vals, idx = nkisim.run(load("core.max.cascaded_max").cascaded_max, x, lnc=lnc, target="trn2")
        want = load("core.max.cascaded_max_torch").cascaded_max_torch_ref(to_torch(x))
        return {"max_values": (vals, to_np(want["max_values"])), "max_indices": (idx, to_np(want["max_indices"]))}

    return Case(f"cascaded_max[lnc{lnc}_b{b}_s{s}_v{v}]", "cascaded_max", run, rtol=0, atol=0,
                exact=("max_values", "max_indices"))


def _cumsum_case(shape: tuple[int, ...], dtype: Any) -> Case:
    def run():
        x = np.random.default_rng(42).standard_normal(shape).astype(dtype)
        got = nkisim.run(load("core.cumsum.cumsum").cumsum, x, lnc=2, target="trn2")
        want = load("core.cumsum.cumsum_torch").cumsum_torch_ref(to_torch(x))
        return {"output_0": (got, to_np(want["output_0"]))}

    bf = dtype == BF16
    return Case(f"cumsum[{'x'.join(map(str, shape))}_{np.dtype(dtype).name}]", "cumsum", run,
                rtol=1e-2 if bf else 1e-3, atol=1e-2 if shape[-1] > 5000 else 1e-3)


# ------------------------------------------------------------------------------------------ moe_tkg


def _moe_case(lnc: int, T: int, H: int, I: int, E: int, top_k: int | None, all_expert: bool, act: str,
              dtype: Any = np.float16, bias: bool = True, clamp: bool = True) -> Case:
    def run():
        mod = load("core.moe.moe_tkg.moe_tkg")
        ref = load("core.moe.moe_tkg.moe_tkg_torch").moe_tkg_torch_ref
        ct = load("core.utils.common_types")
        K = top_k if top_k is not None else E
        r = np.random.default_rng(0)
        np.random.seed(0)
        if all_expert:
            idx = np.stack([np.random.choice(E, size=K, replace=False) for _ in range(T)]).astype(np.int32)
        else:
            idx = np.random.randint(0, E, size=(T, K)).astype(np.int32)
        aff_dtype = BF16 if all_expert else np.float32
        p = np.random.rand(T, K)
        p = p / p.sum(axis=1, keepdims=True)
        aff = np.zeros((T, E), np.float32)
        for t in range(T):
            for j in range(K):
                aff[t, idx[t, j]] = p[t, j]
        aff = aff.astype(aff_dtype)
        x = r.normal(size=(T, H)).astype(dtype)
        gu = r.normal(size=(E, H, 2, I)).astype(dtype)
        dn = r.normal(size=(E, I, H)).astype(dtype)
        gu_b = r.normal(size=(E, 2, I)).astype(dtype) if bias else None
        dn_b = r.normal(size=(E, H)).astype(dtype) if bias else None
        rank = np.zeros((1, 1), np.uint32) if all_expert else None
        kw = dict(
            is_all_expert=all_expert, expert_affinities_scaling_mode=ct.ExpertAffinityScaleMode.POST_SCALE,
            activation_fn=getattr(ct.ActFnType, act), output_dtype=_nl_dtype(dtype),
            gate_clamp_upper_limit=7.0 if clamp else None, gate_clamp_lower_limit=None,
            up_clamp_upper_limit=8.0 if clamp else None, up_clamp_lower_limit=-6.0 if clamp else None,
        )
        got = nkisim.run(mod.moe_tkg, x, gu, dn, aff, idx, rank_id=rank, expert_gate_up_bias=gu_b,
                         expert_down_bias=dn_b, lnc=lnc, target="trn2", **kw)
        want = ref(hidden_input=to_torch(x), expert_gate_up_weights=to_torch(gu), expert_down_weights=to_torch(dn),
                   expert_affinities=to_torch(aff), expert_index=to_torch(idx), rank_id=to_torch(rank),
                   expert_gate_up_bias=to_torch(gu_b), expert_down_bias=to_torch(dn_b), **kw)
        want = next(iter(want.values())) if isinstance(want, dict) else want
        return {"out": (got, to_np(want))}

    mode = "all" if all_expert else f"sel{top_k}"
    return Case(f"moe_tkg[lnc{lnc}_T{T}_H{H}_I{I}_E{E}_{mode}_{act.lower()}_{np.dtype(dtype).name}]", "moe_tkg", run,
                rtol=2e-2, atol=1e-5)


# ------------------------------------------------------------------------------------------ the list


def cases() -> list[Case]:
    """The configurations run (a few per kernel, from the library tests' own parameter lists)."""
    return [
        _norm_case("rmsnorm_tkg", 1, 1, 4, 2048, hidden_actual=1920),
        _norm_case("rmsnorm_tkg", 2, 4, 8, 8192),
        _norm_case("rmsnorm_tkg", 2, 2, 8, 8192, shard_on_h=True),
        _norm_case("layernorm_tkg", 2, 2, 8, 8192),
        _norm_case("layernorm_tkg", 2, 4, 1, 3072, shard_on_h=True),
        _rope_case(128, 8, 8, 16, True, False, 2),
        _rope_case(64, 1, 1, 128, False, True, 2),
        _rope_hf_case(1, 32, 8, 256, 128, BF16, 2),
        _rope_hf_case(1, 32, 8, 256, 128, np.float32, 1),
        _router_topk_case(4, 3072, 128, 4, "SOFTMAX", True, False, False, False),
        _router_topk_case(8, 3072, 128, 4, "SOFTMAX", True, True, True, False),
        _qkv_case(2, 2, 1, 2048, 8, 2, 128, fused_add=False),
        _qkv_case(1, 2, 1, 2048, 8, 2, 128, fused_add=True),
        _oproj_case(2, 4, 8, 4, 64, 3072, True, True),
        _oproj_case(1, 4, 2, 4, 128, 8192, True, False),
        _gen_mask_case(1, 4, 1, 1024, 5),
        _gen_mask_case(2, 4, 1, 4096, 5),
        _cascaded_max_case(2, 8, 5, 4058),
        _cascaded_max_case(1, 4, 5, 8192),
        _cumsum_case((128, 2048), np.float32),
        _cumsum_case((64, 4, 1024), BF16),
        _moe_case(2, 4, 3072, 192, 4, None, True, "Swish"),
        _moe_case(2, 4, 3072, 192, 128, 4, False, "Swish"),
    ]


KERNELS = ("rmsnorm_tkg", "layernorm_tkg", "rope", "rope_hf", "router_topk", "qkv_tkg", "output_projection_tkg",
           "gen_mask_tkg", "cascaded_max", "cumsum", "moe_tkg")


def main(argv: list[str]) -> int:
    import logging
    import time

    logging.basicConfig(level=logging.ERROR)
    if nkilib_root() is None:
        print(f"{ENV} is not set to a directory holding the nkilib package", file=sys.stderr)
        return 2
    failed = 0
    for c in cases():
        if argv and not any(a in c.name for a in argv):
            continue
        t0 = time.perf_counter()
        try:
            errs = check(c)
            status = "ok    " + ", ".join(f"{k} max err {v:.3g}" for k, v in errs.items())
        except Exception as exc:  # noqa: BLE001 - a report line per case
            failed += 1
            status = f"FAIL  {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        print(f"{c.name:70s} {time.perf_counter() - t0:6.1f}s  {status}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
