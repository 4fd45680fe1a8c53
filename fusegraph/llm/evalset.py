"""The fixed, versioned problem set of ``fusegraph llm-eval``: small NKI tasks a kernel-writing model must solve.

Why a fixed set: a score is only comparable across models, prompts and fine-tuning runs when the tasks, their
shapes, their input cases and their references never change silently. Every problem is a
:class:`~fusegraph.llm.task.KernelTask` in the writer's own format (so the model sees exactly the prompt the
compile pipeline would send), and :data:`EVALSET_VERSION` changes whenever any problem does. The reference of
each problem is written once, as source text; the callable verification runs is that very text executed, so
what the model reads and what it is checked against cannot drift.

The problems cover the seed's level-1 set (scalar-matrix multiply, an elementwise chain, row softmax, RMSNorm,
LayerNorm, SiLU/GELU gates, a matmul with PSUM accumulation over K, transpose, cumsum, top-k, a gather by index,
a KV-row write) at shapes that need tiling — 256+ rows (several 128-partition tiles), K > 128 (accumulation in
PSUM), free sizes > 512 (several matmul moving tiles) — plus LNC=2 variants launched as ``kernel[2]``. The
interfaces are plain tensors, not the template library's layouts, so the set stays held out from the
``export-sft`` training data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .examples import load_reference
from .task import KernelTask, TensorSpec

EVALSET_VERSION = "1"
"""Bump whenever a problem, shape, range, case list or reference changes (scores of different versions are not
comparable)."""

HEADER = "import torch\nimport torch.nn.functional as F\n\n\n"
f32, bf16, i64 = torch.float32, torch.bfloat16, torch.int64


@dataclass(frozen=True)
class Problem:
    """One problem of the set: a stable id, what it exercises, and how to build its task."""

    name: str
    summary: str
    build: Callable[[], KernelTask]
    lnc: int = 1

    def task(self) -> KernelTask:
        return self.build()


def _task(name: str, body: str, params: str, inputs: list[TensorSpec], outputs: list[TensorSpec], context: str,
          *, lnc: int = 1, cases: tuple[str, ...] | None = None, data_movement_only: bool = False) -> KernelTask:
    src = f"{HEADER}def reference({params}):\n{body}"
    kw = {} if cases is None else {"cases": cases}
    return KernelTask(name=name, reference_source=src, reference=load_reference(src), inputs=inputs, outputs=outputs,
                      model=f"llm-eval v{EVALSET_VERSION}", context=context, lnc=lnc,
                      data_movement_only=data_movement_only, **kw)


def _suffix(lnc: int) -> str:
    return "" if lnc == 1 else f"_lnc{lnc}"


# ---- the problems ---------------------------------------------------------------------------------------------
def scale_matrix() -> KernelTask:
    R, C = 256, 1024
    return _task("scale_matrix", "    return 3.5 * x\n", "x", [TensorSpec("x", (R, C), f32)],
                 [TensorSpec("y", (R, C), f32)], "scalar times matrix")


def elementwise_chain() -> KernelTask:
    R, C = 384, 768
    return _task("elementwise_chain",
                 "    return (torch.tanh(a.float() * b.float() + c.float()) * 0.5).to(a.dtype)\n", "a, b, c",
                 [TensorSpec(n, (R, C), bf16) for n in "abc"], [TensorSpec("y", (R, C), bf16)],
                 "an elementwise chain: 0.5 * tanh(a * b + c)")


def row_softmax(lnc: int = 1) -> KernelTask:
    R, C = 256, 640
    return _task(f"row_softmax{_suffix(lnc)}", "    return torch.softmax(x, dim=-1)\n", "x",
                 [TensorSpec("x", (R, C), f32)], [TensorSpec("y", (R, C), f32)],
                 "softmax over each row", lnc=lnc)


def rmsnorm(lnc: int = 1) -> KernelTask:
    R, C = 256, 2048
    body = ("    xf = x.float()\n"
            "    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)\n"
            "    return w * y\n")
    return _task(f"rmsnorm{_suffix(lnc)}", body, "x, w",
                 [TensorSpec("x", (R, C), bf16),
                  TensorSpec("w", (C,), bf16, value_range=(0.5, 1.5), edge_values=False, description="norm weight")],
                 [TensorSpec("y", (R, C), bf16)], "RMSNorm of each row, eps 1e-6", lnc=lnc)


def layernorm() -> KernelTask:
    R, C = 256, 768
    return _task("layernorm", "    return F.layer_norm(x, (768,), w, b, 1e-5)\n", "x, w, b",
                 [TensorSpec("x", (R, C), f32),
                  TensorSpec("w", (C,), f32, value_range=(0.5, 1.5), edge_values=False, description="weight"),
                  TensorSpec("b", (C,), f32, value_range=(-1, 1), edge_values=False, description="bias")],
                 [TensorSpec("y", (R, C), f32)], "LayerNorm of each row, eps 1e-5")


def silu_gate() -> KernelTask:
    R, C = 384, 1024
    return _task("silu_gate", "    return F.silu(gate) * up\n", "gate, up",
                 [TensorSpec("gate", (R, C), f32), TensorSpec("up", (R, C), f32)], [TensorSpec("y", (R, C), f32)],
                 "SwiGLU activation silu(gate) * up")


def gelu_tanh_gate() -> KernelTask:
    R, C = 256, 1536
    return _task("gelu_tanh_gate", "    return F.gelu(gate, approximate=\"tanh\") * up\n", "gate, up",
                 [TensorSpec("gate", (R, C), bf16), TensorSpec("up", (R, C), bf16)], [TensorSpec("y", (R, C), bf16)],
                 "GeGLU activation gelu_tanh(gate) * up")


def matmul_psum(lnc: int = 1) -> KernelTask:
    M, K, N = 256, 384, 640
    return _task(f"matmul_psum{_suffix(lnc)}", "    return (x.float() @ w.float()).to(x.dtype)\n", "x, w",
                 [TensorSpec("x", (M, K), bf16),
                  TensorSpec("w", (K, N), bf16, value_range=(-1, 1), edge_values=False, description="weight")],
                 [TensorSpec("y", (M, N), bf16)],
                 f"matmul [{M}, {K}] @ [{K}, {N}]: K > 128 accumulates in PSUM, N > 512 needs two moving tiles",
                 lnc=lnc)


def transpose() -> KernelTask:
    R, C = 256, 384
    return _task("transpose", "    return x.t().contiguous()\n", "x", [TensorSpec("x", (R, C), f32)],
                 [TensorSpec("y", (C, R), f32)], "matrix transpose", data_movement_only=True)


def cumsum() -> KernelTask:
    R, C = 256, 512
    return _task("cumsum", "    return torch.cumsum(x, dim=-1)\n", "x", [TensorSpec("x", (R, C), f32)],
                 [TensorSpec("y", (R, C), f32, atol=1e-3)], "inclusive prefix sum along each row")


def topk() -> KernelTask:
    R, C, K = 256, 512, 8
    return _task("topk", f"    values, indices = torch.topk(x, {K}, dim=-1)\n    return values, indices\n", "x",
                 [TensorSpec("x", (R, C), f32)],
                 [TensorSpec("values", (R, K), f32, description="descending"),
                  TensorSpec("indices", (R, K), i64, description="column of each value")],
                 f"the {K} largest values of each row and their columns", cases=("random", "negative", "large"))


def gather_rows() -> KernelTask:
    V, H, T = 1024, 256, 256
    return _task("gather_rows", "    return table[idx.long()]\n", "table, idx",
                 [TensorSpec("table", (V, H), f32), TensorSpec("idx", (T,), i64, index=True, value_range=(0, V),
                                                               description="row of the table to gather")],
                 [TensorSpec("y", (T, H), f32)], "gather table rows by index", data_movement_only=True)


def kv_row_write() -> KernelTask:
    B, H, L, D = 4, 8, 256, 64
    body = (f"    cache[torch.arange({B}), :, pos.long(), :] = k  # row pos[b] of every head of sequence b\n"
            "    return cache\n")
    return _task("kv_row_write", body, "cache, k, pos",
                 [TensorSpec("cache", (B, H, L, D), bf16, description="KV cache, written in place"),
                  TensorSpec("k", (B, H, D), bf16, description="this step's key of each sequence and head"),
                  TensorSpec("pos", (B,), i64, index=True, value_range=(0, L),
                             description="cache position of each sequence")],
                 [TensorSpec("cache", (B, H, L, D), bf16, alias_of="cache", description="written in place")],
                 "write this decode step's key rows into a static KV cache", data_movement_only=True)


PROBLEMS: tuple[Problem, ...] = (
    Problem("scale_matrix", "3.5 * x, fp32 [256, 1024]", scale_matrix),
    Problem("elementwise_chain", "0.5 * tanh(a * b + c), bf16 [384, 768]", elementwise_chain),
    Problem("row_softmax", "softmax per row, fp32 [256, 640]", row_softmax),
    Problem("rmsnorm", "RMSNorm, bf16 [256, 2048]", rmsnorm),
    Problem("layernorm", "LayerNorm with weight and bias, fp32 [256, 768]", layernorm),
    Problem("silu_gate", "silu(gate) * up, fp32 [384, 1024]", silu_gate),
    Problem("gelu_tanh_gate", "gelu_tanh(gate) * up, bf16 [256, 1536]", gelu_tanh_gate),
    Problem("matmul_psum", "[256, 384] @ [384, 640], bf16, PSUM accumulation over K", matmul_psum),
    Problem("transpose", "x.T, fp32 [256, 384]", transpose),
    Problem("cumsum", "cumsum per row, fp32 [256, 512]", cumsum),
    Problem("topk", "top-8 values and indices per row, fp32 [256, 512]", topk),
    Problem("gather_rows", "table[idx], fp32 [1024, 256] by 256 indices", gather_rows),
    Problem("kv_row_write", "KV cache row write in place, bf16 [4, 8, 256, 64]", kv_row_write),
    Problem("row_softmax_lnc2", "row_softmax launched as kernel[2]", lambda: row_softmax(2), lnc=2),
    Problem("rmsnorm_lnc2", "rmsnorm launched as kernel[2]", lambda: rmsnorm(2), lnc=2),
    Problem("matmul_psum_lnc2", "matmul_psum launched as kernel[2]", lambda: matmul_psum(2), lnc=2),
)


def problem_names() -> list[str]:
    return [p.name for p in PROBLEMS]


def select(names: list[str] | None = None) -> list[Problem]:
    """The problems named (all when ``names`` is empty), in set order; unknown names raise ``KeyError``."""
    if not names:
        return list(PROBLEMS)
    known = {p.name: p for p in PROBLEMS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise KeyError(f"unknown problem(s) {', '.join(unknown)} (known: {', '.join(known)})")
    wanted = set(names)
    return [p for p in PROBLEMS if p.name in wanted]
