"""The execution strategies compared on one cost model, and the physical limit.

* (a) **per-op, XLA-style**: every ATen op of the captured program is its own kernel; its inputs come from HBM
  and its output goes back; one kernel/graph boundary (``boundary_sync``) per op. View ops are free.
* (b) **hybrid**: one kernel per region (here: per codegen instruction = pattern match), activations through
  HBM between kernels, a boundary per kernel; each kernel starts cold (its weight DMAs cannot be issued before
  it starts). The kernel bodies are the megakernel's own lines, so (b) and (c) differ only in structure.
* (b') **XLA + NKI MoE**: the published hybrid's structure — per-op everywhere except one NKI kernel for each
  layer's router + experts (the like-for-like analogue of "XLA + NKI MoE kernel").
* (c) **megakernel**: the generated kernel as one instruction stream (:func:`costmodel.estimate_kernel`).
* **physical limit**: the bytes a decode step must read (active weights, the KV cache, one embedding row) over
  the chip's HBM bandwidth.

Everything runs through :func:`costmodel.schedule`, with the same per-instruction and per-DMA costs.
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .costmodel import (Estimate, RegionIO, Work, dma_issue, dma_transfer, estimate, instruction_time,
                        kernel_works)
from .kernelview import KernelView, region_of
from .params import HardwareParams

log = logging.getLogger(__name__)

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
             "bool": 1, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}

#: ops that only change metadata (no kernel, no bytes): XLA folds them into their consumers
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "t", "transpose", "permute", "slice",
    "select", "alias", "detach", "getitem", "split", "split_with_sizes", "unbind", "as_strided", "view_as",
    "expand_as", "lift_fresh_copy", "_reshape_alias", "unflatten", "flatten", "narrow", "chunk",
})
MATMUL_OPS = frozenset({"mm", "bmm", "addmm", "matmul", "linear", "baddbmm"})
SCALAR_ENGINE_OPS = frozenset({"rsqrt", "exp", "silu", "sigmoid", "tanh", "gelu", "sin", "cos", "log", "sqrt",
                               "pow", "_softmax", "softmax", "erf", "relu", "square"})
GATHER_OPS = frozenset({"index", "embedding", "gather", "index_select"})
SCATTER_OPS = frozenset({"index_copy_", "index_copy", "index_put_", "index_put", "copy_", "scatter_", "scatter"})
TWO_INPUT = frozenset({"add", "sub", "mul", "div", "where", "maximum", "minimum", "le", "lt", "ge", "gt", "eq",
                       "ne", "add_", "mul_"})
REDUCTIONS = frozenset({"mean", "sum", "amax", "amin", "max", "_softmax", "softmax", "topk", "argmax", "var"})
#: free elements per instruction of a per-op kernel (one PSUM bank of fp32): a structural choice of the baseline
TILE_FREE = 512


def _short(op: str) -> str:
    """``aten.mm.default`` -> ``mm``."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else parts[-1]


def _numel(shape: Any) -> int:
    if not isinstance(shape, (tuple, list)) or not all(isinstance(s, int) for s in shape):
        return 0
    return math.prod(shape) if shape else 1


def _nbytes(shape: Any, dtype: Any) -> int:
    if isinstance(dtype, (tuple, list)):
        return sum(_nbytes(s, d) for s, d in zip(shape, dtype))
    return _numel(shape) * _ITEMSIZE.get(str(dtype), 4)


def _refs(obj: Any) -> Iterable[Any]:
    from fusegraph.program.ir import Ref

    if isinstance(obj, Ref):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _refs(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _refs(x)


@dataclass
class OpCost:
    """What one ATen op costs as its own kernel (before scheduling)."""

    node: str
    op: str
    layer: int | None
    module: str | None
    engine: str
    instructions: int
    free: float
    partitions: int
    in_bytes: list[tuple[str, int, int]]  # (tensor label, bytes, partitions)
    out_bytes: int
    weight_bytes: int
    dtypes: tuple[str, ...] = ()
    #: per input: produced by an earlier op of the program (moved across a boundary) rather than a weight, state or
    #: program input
    in_boundary: tuple[bool, ...] = ()
    out_boundary: bool = False  # the output is read by a later op (stored across a boundary)


def _matmul_instructions(M: int, K: int, N: int, batch: int = 1) -> tuple[int, float]:
    """PE instructions and moving free size for [M,K]x[K,N]: the cheaper of weight-stationary and x-stationary."""
    a = math.ceil(K / 128) * math.ceil(N / 128) * math.ceil(M / 512)
    a_free = float(min(M, 512))
    b = math.ceil(K / 128) * math.ceil(M / 128) * math.ceil(N / 512)
    b_free = float(min(N, 512))
    cyc_a = a * max(a_free, 64)
    cyc_b = b * max(b_free, 64)
    return (a * batch, a_free) if cyc_a <= cyc_b else (b * batch, b_free)


def op_costs(program: Any) -> list[OpCost]:
    """Every kernel-launching ATen op of ``program`` in topological order, with its bytes and instructions."""
    G = program.graph
    out: list[OpCost] = []
    for n in program.topo_order():
        d = G.nodes[n]
        if d.get("kind") != "op":
            continue
        short = _short(str(d.get("op", "")))
        refs = list(_refs(d.get("args", ()))) + list(_refs(d.get("kwargs", {})))
        if short in VIEW_OPS or not refs:
            continue  # metadata only, or a constant XLA folds (arange, zeros, scalar_tensor)
        ins, crossing, weight = _op_inputs(G, refs)
        shape, dtype = d.get("shape"), d.get("dtype")
        out_b = _nbytes(shape, dtype)
        numel = _numel(shape[0] if isinstance(dtype, tuple) else shape)
        dtypes = tuple(dtype) if isinstance(dtype, tuple) else (str(dtype),)
        if short in GATHER_OPS:
            # reads the gathered rows (plus the indices), not the whole table
            ins = [(lbl, min(b, out_b) if i == 0 else b, p) for i, (lbl, b, p) in enumerate(ins)]
            weight = min(weight, out_b)
        consumed = any(G.nodes[m].get("kind") == "op" for m in G.successors(n))
        if short in SCATTER_OPS:
            # in place: reads the source rows, writes them into the state tensor
            src = ins[-1][1] if ins else 0
            ins = ins[1:]
            crossing = crossing[1:]
            consumed = False  # the write is to HBM state, a real DMA
            out_b = src
            numel = max(1, src // _ITEMSIZE.get(str(dtype), 4))
        engine, inst, free, parts = _op_instructions(G, short, refs, shape, numel)
        out.append(OpCost(n, short, d.get("layer"), d.get("module"), engine, inst, free, parts, ins, out_b, weight,
                          dtypes, tuple(crossing), consumed))
    return out


def _op_inputs(G: Any, refs: list) -> tuple[list[tuple[str, int, int]], list[bool], int]:
    """Per input of an op: (node, bytes, partitions), whether it is another op's output (crosses a kernel
    boundary), and the bytes of the weights and buffers it reads."""
    ins: list[tuple[str, int, int]] = []
    crossing: list[bool] = []
    weight = 0
    for r in refs:
        p = G.nodes.get(r.node, {})
        crossing.append(p.get("kind") == "op")
        shape, dtype = p.get("shape"), p.get("dtype")
        if r.index is not None and isinstance(dtype, tuple):
            shape, dtype = shape[r.index], dtype[r.index]
        nb = _nbytes(shape, dtype)
        kind = str(getattr(p.get("input_kind"), "value", p.get("input_kind") or ""))
        ins.append((r.node, nb, max(1, min(128, _numel(shape)))))
        if kind in ("weight", "buffer"):
            weight += nb
    return ins, crossing, weight


def _op_instructions(G: Any, short: str, refs: list, shape: Any, numel: int) -> tuple[str, int, float, int]:
    """``(engine, instructions, free size, partitions)`` of one op: a matmul on the PE (the cheaper
    stationary choice), anything else on the Vector or Scalar engine in tiles over up to 128 partitions."""
    if short in MATMUL_OPS:
        a_shape = G.nodes.get(refs[0].node, {}).get("shape") or ()
        o = shape if isinstance(shape, tuple) else ()
        K = int(a_shape[-1]) if a_shape else 1
        N = int(o[-1]) if o else 1
        M = int(o[-2]) if len(o) >= 2 else 1
        batch = _numel(o[:-2]) if len(o) > 2 else 1
        inst, free = _matmul_instructions(M, K, N, batch)
        return "tensor", inst, free, 128
    engine = "scalar" if short in SCALAR_ENGINE_OPS else "vector"
    elems = numel
    if short in REDUCTIONS and refs:
        src = G.nodes.get(refs[0].node, {})
        elems = max(numel, _numel(src.get("shape")))  # a reduction streams its whole input
    parts = max(1, min(128, elems))
    per_part = math.ceil(elems / parts)
    inst = max(1, math.ceil(per_part / TILE_FREE))
    free = per_part / inst
    if short in ("_softmax", "softmax"):
        inst *= 3  # max, exp-with-sum, normalize
    return engine, inst, free, parts


def op_works(costs: Iterable[OpCost], hw: HardwareParams, start_index: int = 0) -> list[Work]:
    """Each op as its own kernel: load every input, compute, store the output (region = the op).

    An activation passed from one op to the next (stored by the producer, reloaded by the consumer) moves its bytes
    on the DMA bandwidth but pays neither a trigger on Sync nor the fixed latency: both are inside the measured
    per-boundary cost the schedule charges (``boundary_sync``, ``boundary_wall``: O1's 34.47 us of Sync and
    30.80 us of wall per layer over ~98 boundaries). Charging them again counted a boundary's Sync time twice and
    put 2 x 1.3 us of DMA latency on the critical path of every op. Weights, state and program inputs are real
    DMAs with their issue and latency."""
    works: list[Work] = []
    i = start_index
    for c in costs:
        region = f"op:{c.node}"
        engine, per = dma_issue(hw, "unknown", "auto", None)
        loaded = []
        for k, (lbl, nb, parts) in enumerate(c.in_bytes):
            tr = dma_transfer(hw, nb, 1, parts, parts)
            var = f"{c.node}:in{k}"
            loaded.append(var)
            boundary = k < len(c.in_boundary) and c.in_boundary[k]
            works.append(Work(i, "dma", engine, "dma_copy", 1, 0.0 if boundary else per, region, c.layer,
                              f"{c.op} load {lbl}", None,
                              (), (var,), nbytes=nb, occupancy=tr["occupancy"], own=tr["own"],
                              latency=0.0 if boundary else hw.dma_fixed_latency, ideal=tr["ideal"], hbm_read=nb,
                              bytes_per_partition=tr["bytes_per_partition"],
                              descriptor_bytes=tr["descriptor_bytes"], efficiency=tr["efficiency"], tensor=lbl))
            i += 1
        t, ii = instruction_time(hw, c.engine, c.op, c.partitions, c.free, c.dtypes)
        works.append(Work(i, "compute", c.engine, c.op, c.instructions, t * c.instructions, region, c.layer,
                          f"{c.op} {c.module or ''}".strip(), None, tuple(loaded), (f"{c.node}:out",), dep_ii=ii))
        i += 1
        parts = max(1, min(128, c.out_bytes // 2 or 1))
        tr = dma_transfer(hw, c.out_bytes, 1, parts, parts)
        works.append(Work(i, "dma", engine, "dma_copy", 1, 0.0 if c.out_boundary else per, region, c.layer,
                          f"{c.op} store", None,
                          (f"{c.node}:out",), (f"{c.node}:hbm",), nbytes=c.out_bytes, occupancy=tr["occupancy"],
                          own=tr["own"], latency=0.0 if c.out_boundary else hw.dma_fixed_latency, ideal=tr["ideal"],
                          hbm_write=c.out_bytes,
                          bytes_per_partition=tr["bytes_per_partition"], descriptor_bytes=tr["descriptor_bytes"],
                          efficiency=tr["efficiency"]))
        i += 1
    return works


def per_op(program: Any, hw: HardwareParams) -> Estimate:
    """(a) every ATen op a kernel, activations through HBM, a boundary per op."""
    works = op_works(op_costs(program), hw)
    return estimate(works, hw, label="per-op (XLA-style)", barriers=True)


# ---- hybrid: one kernel per region ------------------------------------------------------------------------------
def instruction_key(ins: Any) -> str:
    """The region key of a codegen instruction, as the emitters name its kernel instructions."""
    try:  # the emitters' own naming, when available
        from fusegraph.codegen.emitters import inst_name

        return region_of(inst_name(ins))[0]
    except Exception:  # noqa: BLE001 - fall back to the documented scheme
        tail = (getattr(ins, "module", None) or ins.opcode).rsplit(".", 1)[-1]
        prefix = f"L{ins.layer}" if getattr(ins, "layer", None) is not None else "top"
        return f"{prefix}.{tail}.{ins.opcode}"


def region_io(generated: Any) -> dict[str, RegionIO]:
    """Activation bytes each region would load/store if it were its own kernel (from the kernel program)."""
    prog = generated.program
    layouts = getattr(generated, "layouts", {}) or {}
    T = prog.tokens
    producer: dict[str, str] = {}
    consumers: dict[str, set[str]] = defaultdict(set)
    keys = [instruction_key(ins) for ins in prog.instructions]
    on_chip = ("act", "routing")
    for key, ins in zip(keys, prog.instructions):
        for v in ins.reads():
            if v.kind in on_chip:
                consumers[v.name].add(key)
        for v in ins.writes():
            if v.kind in on_chip:
                producer[v.name] = key
    values = {v.name: v for ins in prog.instructions for v in ins.reads() + ins.writes()}
    io: dict[str, RegionIO] = defaultdict(RegionIO)

    def size(name: str) -> tuple[int, int]:
        v = values[name]
        import torch

        nb = T * v.features * torch.empty((), dtype=v.dtype).element_size()
        lay = layouts.get(name)
        return nb, (lay.P if lay is not None else max(1, T))

    for name, key in producer.items():
        outside = consumers.get(name, set()) - {key}
        if outside:
            io[key].stores.append(size(name))
        for c in outside:
            io[c].loads.append(size(name))
    return dict(io)


def regroup(works: list[Work]) -> list[Work]:
    """Order works region by region (a region's prefetched weight DMAs move into its own kernel)."""
    first: dict[str, int] = {}
    for w in works:
        if w.kind == "compute":
            first.setdefault(w.region, w.index)
    for w in works:
        first.setdefault(w.region, w.index)
    ordered = sorted(works, key=lambda w: (first[w.region], w.index))
    return ordered


def hybrid(view: KernelView, generated: Any, hw: HardwareParams) -> Estimate:
    """(b) one kernel per region (codegen instruction), activations through HBM, boundaries between them."""
    works = regroup(kernel_works(hw, view))
    return estimate(works, hw, label="hybrid (kernel per region)", barriers=True, buffers=view.buffers,
                    allocs=_allocs_by_work(view, works), region_io=region_io(generated))


def _allocs_by_work(view: KernelView, works: list[Work]) -> dict[int, list]:
    """Allocation events re-keyed to the positions of the (reordered) works."""
    pos = {w.index: k for k, w in enumerate(works)}
    return {pos[i]: v for i, v in view.allocs.items() if i in pos}


MOE_MARKERS = (".mlp.gate", ".mlp.experts", ".mlp.shared_expert")


def xla_nki_moe(program: Any, view: KernelView, generated: Any, hw: HardwareParams) -> Estimate:
    """(b') per-op everywhere, except one kernel per layer for the MoE block (router + experts)."""
    costs = op_costs(program)
    kworks = kernel_works(hw, view)
    moe_keys = {w.region for w in kworks if w.region.endswith(".router") or w.region.endswith(".experts")}
    moe_by_layer: dict[int | None, list[Work]] = defaultdict(list)
    for w in kworks:
        if w.region in moe_keys:
            moe_by_layer[w.layer].append(w)
    works: list[Work] = []
    placed: set = set()
    for c in costs:
        is_moe = c.module is not None and any(m in c.module for m in MOE_MARKERS) and c.layer in moe_by_layer
        if is_moe:
            if c.layer not in placed:
                placed.add(c.layer)
                for w in regroup(moe_by_layer[c.layer]):
                    works.append(_rename_region(w, f"L{c.layer}.moe", len(works)))
            continue
        works.extend(op_works([c], hw, start_index=len(works)))
    for i, w in enumerate(works):
        w.index = i
    io = region_io(generated)
    moe_io: dict[str, RegionIO] = {}
    for key in moe_keys:
        _, layer = region_of(key)
        r = moe_io.setdefault(f"L{layer}.moe", RegionIO())
        src = io.get(key)
        if src and key.endswith(".router"):
            r.loads += src.loads
        if src and key.endswith(".experts"):
            r.stores += src.stores
    return estimate(works, hw, label="XLA + NKI MoE", barriers=True, buffers=view.buffers, region_io=moe_io)


def _rename_region(w: Work, region: str, index: int) -> Work:
    from dataclasses import replace

    return replace(w, region=region, index=index)


# ---- physical limit ----------------------------------------------------------------------------------------------
def _cfg(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def bytes_per_token(config: Any, seq_len: int, dtype_bytes: int | None = None) -> dict[str, int]:
    """The bytes one decode token must read: active weights, KV cache (``seq_len`` positions), one embedding row.

    For Qwen3-30B-A3B in bf16 at 640 positions this is 6,146,654,208 B (perf_anchors.md §5). ``dtype_bytes``
    defaults to the config's ``dtype`` (bf16 when absent).
    """
    if dtype_bytes is None:
        dtype_bytes = _ITEMSIZE.get(str(_cfg(config, "dtype", "bfloat16")).replace("torch.", ""), 2)
    H = int(_cfg(config, "hidden_size"))
    Hq = int(_cfg(config, "num_attention_heads"))
    Hkv = int(_cfg(config, "num_key_value_heads", Hq))
    D = int(_cfg(config, "head_dim", None) or H // Hq)
    L = int(_cfg(config, "num_hidden_layers"))
    V = int(_cfg(config, "vocab_size"))
    E = int(_cfg(config, "num_experts", 0) or 0)
    qk_norm = E > 0 or _cfg(config, "model_type", "") in ("qwen3", "qwen3_moe")
    attn = H * Hq * D + 2 * H * Hkv * D + Hq * D * H
    norms = 2 * H + (2 * D if qk_norm else 0)
    if E:
        K = int(_cfg(config, "num_experts_per_tok"))
        inter = int(_cfg(config, "moe_intermediate_size"))
        mlp = E * H + K * 3 * H * inter
    else:
        mlp = 3 * H * int(_cfg(config, "intermediate_size"))
    per_layer = attn + norms + mlp
    weights = L * per_layer + V * H + H + H  # + LM head, final norm, one embedding row
    kv = seq_len * L * 2 * Hkv * D
    return {"weight_bytes": weights * dtype_bytes, "kv_bytes": kv * dtype_bytes,
            "total_bytes": (weights + kv) * dtype_bytes, "per_layer_bytes": (per_layer + seq_len * 2 * Hkv * D) * dtype_bytes,
            "layers": L}


def physical_limit(config: Any, seq_len: int, hw: HardwareParams) -> dict[str, float]:
    """Seconds per token and per layer at the chip's HBM bandwidth (all cores), and at one core's DMA bandwidth."""
    b = bytes_per_token(config, seq_len)
    return {
        **b,
        "seconds_per_token": b["total_bytes"] / hw.hbm_bandwidth_chip,
        "seconds_per_layer": b["per_layer_bytes"] / hw.hbm_bandwidth_chip,
        "one_core_seconds_per_token": b["total_bytes"] / hw.dma_bandwidth_core,
        "one_core_seconds_per_layer": b["per_layer_bytes"] / hw.dma_bandwidth_core,
    }
