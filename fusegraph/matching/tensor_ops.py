"""Which ATen ops the *tensor path* of generic lowering computes: any shape, not only per-token vectors.

The SBUF-resident elementwise path (:mod:`.generic_ops`) takes per-token elementwise chains and feature reductions
on the hidden state's own layout; it is fast, and narrow. The tensor path takes what a decoder step holds beyond
that (router arithmetic over experts, convolution and SSM states, scores of an attention variant no pattern
knows, values that are per-sequence or constant): every value is a strided view of a buffer in the kernel's HBM
scratch, and every op reads its operands into SBUF tiles through DMA access patterns, computes on the engines,
and writes its result back. Correct for any shape; each op costs its DMAs, which the cost model prices and the
report shows, so the next pattern worth writing is the most expensive generic piece.

Matching owns this table because region formation needs it (an op the tensor path computes joins a region like a
match, so a decoder with an op no pattern knows still runs as one kernel) and matching never imports codegen;
codegen's tensor lowering (``fusegraph.codegen.tensor``) registers one emitter per op named here, and a test
checks that the two agree.

Categories: ``view`` (no data moves: a new view of the same buffer), ``pointwise`` (elementwise with
broadcasting), ``reduce`` (over any dims), ``matmul`` (any two operands), ``conv`` (1-D convolutions), ``move`` (data movement: concatenation,
padding, copies, writes of state), ``const`` (tensors whose value is known when the kernel is built), ``index``
(runtime indices: gathers and scatters by indirect DMA, in-place writes of state rows), ``select`` (top-k, max/min
with indices, argmax/argmin, sort of short rows), ``scan`` (cumsum, cumprod), ``grouped`` (HF's grouped-MoE
ops: the grouped matmul of each row against its expert's weights, the tokens-per-expert histogram).
"""
from __future__ import annotations

import math
from typing import Any

import networkx as nx

VIEW = {
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.unsqueeze.default",
    "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default", "aten.alias.default", "aten.expand.default",
    "aten.permute.default", "aten.transpose.int", "aten.t.default", "aten.slice.Tensor", "aten.select.int",
    "aten.narrow.default", "aten.split.Tensor", "aten.split_with_sizes.default", "aten.unbind.int", "getitem",
    "aten.unfold.default", "aten.detach.default", "aten.lift_fresh_copy.default", "aten.clone.default",
    "aten.contiguous.default",
}
POINTWISE = {
    # unary
    "aten.neg.default", "aten.abs.default", "aten.exp.default", "aten.log.default", "aten.sqrt.default",
    "aten.rsqrt.default", "aten.reciprocal.default", "aten.sigmoid.default", "aten.tanh.default", "aten.silu.default",
    "aten.gelu.default", "aten.relu.default", "aten.softplus.default", "aten.sign.default", "aten.erf.default",
    "aten.square.default", "aten.mish.default", "aten.logical_not.default", "aten.bitwise_not.default",
    "aten._to_copy.default", "aten.clamp.default", "aten.clamp_min.default", "aten.clamp_max.default",
    "aten.pow.Tensor_Scalar", "aten.masked_fill.Scalar", "aten.masked_fill.Tensor",
    "aten.log_sigmoid_forward.default", "aten.expm1.default", "aten.log1p.default",
    # binary (Tensor and Scalar forms) and comparisons
    "aten.add.Tensor", "aten.add.Scalar", "aten.sub.Tensor", "aten.sub.Scalar", "aten.rsub.Scalar",
    "aten.rsub.Tensor", "aten.mul.Tensor", "aten.mul.Scalar", "aten.div.Tensor", "aten.div.Scalar",
    "aten.maximum.default", "aten.minimum.default", "aten.pow.Tensor_Tensor", "aten.eq.Tensor", "aten.eq.Scalar",
    "aten.ne.Tensor", "aten.ne.Scalar", "aten.lt.Tensor", "aten.lt.Scalar", "aten.le.Tensor", "aten.le.Scalar",
    "aten.gt.Tensor", "aten.gt.Scalar", "aten.ge.Tensor", "aten.ge.Scalar", "aten.logical_and.default",
    "aten.logical_or.default", "aten.bitwise_and.Tensor", "aten.bitwise_or.Tensor", "aten.floor_divide.default",
    "aten.floor_divide.Scalar",
    # in place, on state only (tensor_reason): xLSTM's ``cache.seqlen_offset += 1``
    "aten.add_.Tensor", "aten.add_.Scalar", "aten.sub_.Tensor", "aten.sub_.Scalar", "aten.mul_.Tensor",
    "aten.mul_.Scalar",
    # ternary
    "aten.where.self",
}
REDUCE = {
    "aten.sum.dim_IntList", "aten.sum.default", "aten.mean.dim", "aten.mean.default", "aten.amax.default",
    "aten.amin.default", "aten.max.default", "aten.min.default", "aten._softmax.default",
    "aten._log_softmax.default", "aten.logsumexp.default", "aten.var.correction",
    "aten.linalg_vector_norm.default",
}
MATMUL = {"aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.baddbmm.default"}
MOVE = {
    "aten.cat.default", "aten.copy_.default", "aten.copy.default", "aten.constant_pad_nd.default",
    "aten.slice_scatter.default", "aten.select_scatter.default", "aten.roll.default", "aten.stack.default",
    "aten.repeat.default", "aten.fill.Scalar", "aten.zeros_like.default", "aten.ones_like.default",
    "aten.full_like.default", "aten.flip.default",
}
CONST = {
    "aten.full.default", "aten.zeros.default", "aten.ones.default", "aten.arange.default", "aten.arange.start",
    "aten.arange.start_step", "aten.scalar_tensor.default", "aten.empty.memory_format", "aten.new_zeros.default",
    "aten.new_ones.default", "aten.new_full.default", "get_attr", "aten.eye.default", "aten.new_empty.default",
    "aten.empty_like.default", "aten.new_empty_strided.default", "aten.empty.default",
}

CONV = {"aten.convolution.default"}
INDEX = {
    "aten.index_select.default", "aten.embedding.default", "aten.gather.default", "aten.index.Tensor",
    "aten.index_put.default", "aten.index_copy.default", "aten.scatter.src", "aten.scatter.value",
    "aten.scatter_add.default", "aten.index_fill.int_Scalar", "aten.index_fill.int_Tensor",
    # in place: only as writes of state rows (see STATE_WRITES)
    "aten.index_copy_.default", "aten.index_put_.default",
}
SELECT = {
    "aten.topk.default", "aten.max.dim", "aten.min.dim", "aten.argmax.default", "aten.argmin.default",
    "aten.sort.default", "aten.sort.stable",
}
SCAN = {"aten.cumsum.default", "aten.cumprod.default"}
#: HF's grouped-MoE path: the grouped matmul (transformers' fallback op in fp32, ``aten._grouped_mm`` in bf16) and
#: the tokens-per-expert histogram its offsets come from
GROUPED = {"transformers.grouped_mm_fallback.default", "aten._grouped_mm.default", "aten.histc.default"}
#: ops the tensor path computes in place into a state tensor (every other in-place op is refused)
STATE_WRITES = {"aten.copy_.default", "aten.index_copy_.default", "aten.index_put_.default"} | {
    f"aten.{n}_.{form}" for n in ("add", "sub", "mul") for form in ("Tensor", "Scalar")}  # a counter's ``+= 1``
#: the longest row a selection takes (longer than one tile, each chunk's top values are candidates: a vocabulary's
#: argmax is 16 chunks of 8), and the largest k (rounds of 8)
SELECT_MAX = 1 << 18
TOPK_MAX = 64
#: the longest row a sort takes (n / 8 rounds of max8 over the row)
SORT_MAX = 256

CATEGORY: dict[str, str] = {
    **{op: "view" for op in VIEW}, **{op: "conv" for op in CONV}, **{op: "pointwise" for op in POINTWISE}, **{op: "reduce" for op in REDUCE},
    **{op: "matmul" for op in MATMUL}, **{op: "move" for op in MOVE}, **{op: "const" for op in CONST},
    **{op: "index" for op in INDEX}, **{op: "select" for op in SELECT}, **{op: "scan" for op in SCAN},
    **{op: "grouped" for op in GROUPED},
}

#: element types the tensor path computes in (int64 indices are int32 in the kernel: NKI has no 64-bit integers)
DTYPES = ("float32", "bfloat16", "float16", "int32", "int64", "bool", "int8", "uint8", "int16")
#: the largest tensor the tensor path takes (elements): bigger values are weights or caches, which no generic op
#: rewrites whole in a decode step; a generic op over one would be a prefill or a bug worth a refusal
MAX_ELEMENTS = 1 << 26


def _numel(shape: Any) -> int:
    return math.prod(int(s) for s in shape)


def _shapes(d: dict) -> list[Any]:
    shape = d.get("shape")
    if shape is None:
        return []
    if isinstance(shape, tuple) and shape and isinstance(shape[0], (tuple, list)):
        return list(shape)
    return [shape]


def _dtypes(d: dict) -> list[Any]:
    dt = d.get("dtype")
    return list(dt) if isinstance(dt, (tuple, list)) else [dt]


def tensor_reason(G: nx.DiGraph, node: str) -> str | None:
    """Why the tensor path cannot compute this op (None: it can). Checks the op is in the table, its shapes are
    static and its element types are ones the kernel computes in; what an op's emitter further requires (a
    matmul's operand ranks, a reduction's dims) is checked when it is lowered, naming the op."""
    d = G.nodes[node]
    op = d.get("op")
    if d.get("kind") != "op":
        return f"{node} is not an op"
    if op not in CATEGORY:
        return f"{op} is not an op generic lowering computes"
    if d.get("writes_state") and op not in STATE_WRITES:
        return f"{op} writes state in place"
    if op.endswith("_.default") and op in CATEGORY and op not in ("aten.copy_.default",) and not d.get("writes_state"):
        return f"{op} in place on a value that is not state"
    if d.get("shape") is None:
        return f"{op} produces no tensor (a Python number: a symbolic size, say)"
    for shape in _shapes(d):
        if shape is None or any(not isinstance(s, int) for s in shape):
            return f"{op} with a dynamic shape {shape}"
        if _numel(shape) > MAX_ELEMENTS:
            return f"{op} of {_numel(shape)} elements"
    for dt in _dtypes(d):
        if dt is not None and dt not in DTYPES:
            return f"{op} in {dt}"
    if op in CONV:
        args = list(d.get("args", ()))
        src = G.nodes[args[0].node].get("shape") if hasattr(args[0], "node") else None
        if len(args) < 9 or args[6] or src is None or len(src) != 3:
            return f"{op}: only 1-D, non-transposed convolutions"
    for ref in [a for a in _flat(list(d.get("args", ())) + list(d.get("kwargs", {}).values())) if hasattr(a, "node")]:
        src = G.nodes[ref.node]
        if src.get("shape") is None and CATEGORY[op] != "pointwise":
            return f"{op} with a runtime number as an argument"  # sizes and indices must be known at build time
        for dt in _dtypes(src):
            if dt is not None and dt not in DTYPES:
                return f"{op} reads a {dt} value"
    if op in INDEX or op in SELECT:
        return _index_reason(G, d, op)
    if op in GROUPED:
        return _grouped_reason(d, op)
    if op.startswith("aten.floor_divide") and hasattr(_arg(d, 1, "other", None), "node"):
        return f"{op} by a tensor (the tensor path divides by a number known when the kernel is built)"
    return None


def _grouped_reason(d: dict, op: str) -> str | None:
    """What the grouped emitters need (``fusegraph.codegen.tensor.grouped`` says why)."""
    if op == "aten.histc.default":
        lo, hi = _arg(d, 2, "min", 0), _arg(d, 3, "max", 0)
        if not float(hi) > float(lo):
            return "histc without a static range (min >= max: eager takes the data's own)"
        return None
    if _arg(d, 3, "bias", None) is not None or _arg(d, 4, "out_dtype", None) is not None:
        return f"{op} with a bias or an out_dtype"
    return None


def _arg(d: dict, i: int, key: str, default: Any) -> Any:
    args = d.get("args", ())
    return args[i] if len(args) > i else d.get("kwargs", {}).get(key, default)


def _src(G: nx.DiGraph, a: Any) -> dict | None:
    return G.nodes[a.node] if hasattr(a, "node") else None


def _index_reason(G: nx.DiGraph, d: dict, op: str) -> str | None:
    """What the index and select emitters need beyond the table (``fusegraph.codegen.tensor.index`` / ``.select``
    say why)."""
    args = d.get("args", ())
    if op in ("aten.index.Tensor", "aten.index_put.default", "aten.index_put_.default"):
        for t in _arg(d, 1, "indices", ()) or ():
            s = _src(G, t) if t is not None else None
            if s is not None and s.get("dtype") in ("bool", "uint8"):
                return f"{op} with a boolean mask (its result's shape depends on the mask)"
        if op != "aten.index.Tensor" and _arg(d, 3, "accumulate", False):
            return f"{op} with accumulate=True (duplicate indices must add up: not on the tensor path)"
    if op in ("aten.scatter.src", "aten.scatter.value") and d.get("kwargs", {}).get("reduce") is not None:
        return f"{op} with reduce="
    if op in SELECT:
        x = _src(G, args[0]) if args else None
        if x is None or x.get("dtype") not in ("float32", "bfloat16", "float16", "int32", "int64", "int16", "int8",
                                               "uint8"):
            return f"{op} of {x and x.get('dtype')} values"
        shape = tuple(x.get("shape") or ())
        if op == "aten.topk.default":
            dim = _arg(d, 2, "dim", -1)
        elif op == "aten.sort.stable":
            dim = d.get("kwargs", {}).get("dim", -1)
        elif op == "aten.sort.default":
            dim = _arg(d, 1, "dim", -1)
        else:  # max.dim / min.dim / argmax / argmin (None: over every element)
            dim = _arg(d, 1, "dim", None)
        n = math.prod(shape) if dim is None or not shape else int(shape[dim])
        limit = SORT_MAX if op.startswith("aten.sort") else SELECT_MAX
        if n > limit:
            return f"{op} over {n} values (the tensor path selects along rows of up to {limit})"
        if op == "aten.topk.default" and not 1 <= int(args[1]) <= TOPK_MAX:
            return f"top-{args[1]} (the tensor path selects 1 to {TOPK_MAX} by rounds of max8)"
    return None


def _flat(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        return [y for e in x for y in _flat(e)]
    return [x]


__all__ = ["CATEGORY", "CONST", "CONV", "DTYPES", "GROUPED", "INDEX", "MATMUL", "MAX_ELEMENTS", "MOVE", "POINTWISE", "REDUCE",
           "SCAN", "SELECT", "STATE_WRITES", "VIEW", "tensor_reason"]
