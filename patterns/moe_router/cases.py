"""Test cases of the MoE router (:class:`~.lowering.Router`) against its pattern function and implementations
(``moe_router``: softmax in fp32, top-k, renormalized or not, cast back; ``rounded``: keras-hub's bf16 router with
every step rounded; ``fp32_weights``: HF Mixtral's, the weights left in fp32). The routing tiles (weights and
int32 expert ids) are read out to HBM (:meth:`Builder.store_routing`); the ids must equal ``torch.topk``'s. The
tie guard is not part of these cases (its tests: ``tests/codegen/test_router_ties.py``)."""
from __future__ import annotations

import torch

from fusegraph.codegen.api import BF16_TOL, Builder, CaseProgram, OpCase, ir, register_cases

from .lowering import Router
from .pattern import _fp32_weights, _rounded, moe_router

F32, BF16 = torch.float32, torch.bfloat16
REFERENCES = {"fp32": moe_router.fn, "rounded": _rounded, "fp32_weights": _fp32_weights}


def add_router(b: Builder, x: ir.Value, weight: torch.Tensor, top_k: int, normalize: bool,
               form: str = "fp32") -> tuple[ir.Value, ir.Value]:
    """Append a router over ``x`` (form: ``fp32``, ``rounded``, ``fp32_weights``, as the lowering picks by the
    pattern variant) to ``b``; its (weights, expert ids) routing tiles. Shared with the experts' cases, which need
    the kernel's own routing."""
    wdtype = torch.float32 if form == "fp32_weights" else x.dtype
    wts, ids = b.routing("rw", top_k, wdtype), b.routing("ri", top_k, torch.int32)
    b.ins.append(Router(x=x, weight=b.hbm("w_router", weight), weights=wts, indices=ids, top_k=top_k,
                        normalize=normalize, rounding="rounded" if form == "rounded" else "fp32", layer=0))
    return wts, ids


def router_weight(E: int, H: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (torch.randn(E, H, generator=torch.Generator().manual_seed(seed)) / H ** 0.25).to(dtype)


def _case(T: int, H: int, E: int, K: int, dtype: torch.dtype, normalize: bool, form: str = "fp32") -> CaseProgram:
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T * H + E)).to(dtype)
    w = router_weight(E, H, dtype, seed=E * K)
    b = Builder(T)
    wts, ids = add_router(b, b.act("x", x), w, K, normalize, form)
    b.store_routing(wts)
    b.store_routing(ids)

    def eager(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        top, idx = REFERENCES[form](t["x"], t["weight"], top_k=K, normalize=normalize)
        return {"rw": top, "ri": idx}

    return CaseProgram(b, {"x": x, "weight": w}, eager)


register_cases(__package__, [
    OpCase("E16_top4_norm_T2_H256_f32", lambda: _case(2, 256, 16, 4, F32, normalize=True)),
    OpCase("E8_top2_T3_H200_bf16", lambda: _case(3, 200, 8, 2, BF16, normalize=False), BF16_TOL),
    OpCase("rounded_E8_top2_norm_T4_H128_bf16", lambda: _case(4, 128, 8, 2, BF16, True, "rounded"), BF16_TOL),
    OpCase("fp32_weights_E8_top2_norm_T2_H256_bf16", lambda: _case(2, 256, 8, 2, BF16, True, "fp32_weights"),
           BF16_TOL),
    OpCase("E128_top8_norm_T2_H256_bf16", lambda: _case(2, 256, 128, 8, BF16, normalize=True), BF16_TOL),
])
