"""NKI API facts for prompts and fact cards: signatures from the official tables, semantics notes from here.

Signatures are generated, never written by hand: a parameter is listed only if it exists in *every* version the
conformance check enforces (0.3.0 and 0.6.0), in 0.3.0's order, with its default, so a model that copies a
signature writes a conforming call. The notes are one paragraph each, written from the official stub docstrings
as summarised in ``shared/reference/nki_api.md``; their first sentence is the one-line fact used in prompts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from fusegraph.nkiapi import load_table

VERSIONS = ("0.3.0", "0.6.0")
SHORT = {"nki.isa": "nisa", "nki.language": "nl", "nki": "nki", "nki.collectives": "nccl"}

NOTES: dict[str, str] = {
    "nki.isa.dma_copy": (
        "Copies `src` to `dst` with a DMA engine: HBM->SBUF, SBUF->HBM, SBUF->SBUF or HBM->HBM, never PSUM. "
        "Both sides hold the same number of elements (shapes may differ); dtypes may differ (converted through "
        "fp32) except with `dge_mode=nisa.dge_mode.hwdge`, which needs equal dtypes. It is how a kernel reads its "
        "HBM inputs into SBUF tiles and writes results to its `nl.shared_hbm` outputs. A row gather by a runtime "
        "index copies row `idx[j]` of a [V, H] table into a [1, H] tile with `src=table.ap(pattern=[[H, 1], [1, H]], "
        "offset=0, scalar_offset=idx_tile[0:1, j:j + 1], indirect_dim=0)` (the int32 index tile is in SBUF)."),
    "nki.isa.tensor_copy": (
        "Copies an on-chip tile (SBUF or PSUM) into another on-chip tile on the Vector, Scalar or GpSimd engine, "
        "converting the dtype on write. The standard use is evicting a matmul result from PSUM to SBUF (often "
        "casting fp32 to bf16) before it is used further or DMA'd out. Source and destination need the same "
        "partition count and elements per partition; GpSimd cannot access PSUM."),
    "nki.isa.tensor_tensor": (
        "Element-wise `dst = data1 <op> data2` of two on-chip tiles on the Vector (or GpSimd) engine, computed "
        "in fp32 and rounded to dst's dtype. `op` is an ALU token: nl.add, nl.subtract, nl.multiply, nl.maximum, "
        "nl.minimum, or a comparison (nl.equal, nl.greater, nl.less, ... giving 1.0/0.0); there is no divide. "
        "Both inputs need the same partition count and elements per partition: there is no broadcasting (use "
        "nisa.tensor_scalar with a [P, 1] operand, or a stride-0 `.ap()` view). At most one input may be in PSUM."),
    "nki.isa.tensor_scalar": (
        "Computes `dst = (data <op0> operand0) <op1> operand1` with scalar operands on the Vector engine: each "
        "operand is a Python float (same for every element) or a float32 [P, 1] tile (one value per partition, "
        "broadcast along the free axis). `reverse0=True` computes `operand0 <op0> data` instead; `op1`/"
        "`operand1` are optional. Typical uses: scale by a constant, add a per-row bias, multiply every row by "
        "its own normaliser."),
    "nki.isa.scalar_tensor_tensor": (
        "Computes `dst = (data <op0> operand0) <op1> operand1` in one Vector-engine instruction, where operand0 "
        "is a scalar (a float or a float32 [P, 1] tile) and operand1 a tile shaped like data, e.g. "
        "`scores * scale + mask`."),
    "nki.isa.activation": (
        "Applies an activation on the Scalar engine: `dst = op(data * scale + bias)`, in fp32, rounded to dst's "
        "dtype. `op` is an activation token: nl.copy, nl.exp, nl.log, nl.square, nl.sqrt, nl.rsqrt, "
        "nl.reciprocal, nl.silu, nl.gelu, nl.gelu_apprx_tanh, nl.sigmoid, nl.tanh, nl.relu, nl.softplus, "
        "nl.sin, nl.abs, ... `scale` is a float or a float32 [P, 1] tile and `bias` a float32 [P, 1] tile (or a "
        "float). With `reduce_op=nl.add, reduce_res=<[P, 1] tile>, reduce_cmd=nisa.reduce_cmd.reset_reduce` it "
        "also sums the results along the free axis (a softmax denominator in the same instruction)."),
    "nki.isa.tensor_reduce": (
        "Reduces a tile along its free axes: `dst = op-reduction of data over axis` with op nl.add, "
        "nl.maximum, nl.minimum or nl.multiply, computed in fp32. `axis` names free axes (1 for a 2-D tile, or a "
        "tuple of the trailing axes), never axis 0, the partition axis; `keepdims=True` keeps size-1 axes "
        "(a [P, 1] result) and `negate=True` returns the negated result (a ready -max bias for softmax). Sums "
        "across partitions need a matmul with a ones matrix or a transpose first."),
    "nki.isa.nc_matmul": (
        "Tensor-engine matrix multiply `dst[M, N] = stationary[K, M].T @ moving[K, N]`: the contraction K is the "
        "partition axis of both inputs (K <= 128), M <= 128 becomes dst's partition axis and N <= 512 its free "
        "size. Stationary and moving are in SBUF, dst is a float32 PSUM tile (at most 2 KiB per partition). "
        "`accumulate=False` overwrites dst and `True` adds to it, so a loop over K tiles passes "
        "`accumulate=(k != 0)`. Inputs are bf16/fp16/fp8 or fp32 (fp32 only with fp32). For `x @ W.T` with x "
        "[T, K] and W [N, K], load x.T [K, T] as stationary and W.T [K, N] as moving: dst is [T, N]. Copy the "
        "PSUM result to SBUF with nisa.tensor_copy before using it."),
    "nki.isa.nc_transpose": (
        "Transposes a tile between its partition axis and its flattened free axis: `dst[F, P] = data[P, F].T`. "
        "On the Tensor engine the tile is at most 128x128, data in SBUF, dst in PSUM with data's dtype (copy it "
        "to SBUF with nisa.tensor_copy); the Vector engine handles tiles up to 32x32."),
    "nki.isa.reciprocal": (
        "Element-wise `dst = 1 / data` on the Vector engine. NKI has no divide: `a / b` is `a * (1 / b)`; for a "
        "per-row divisor compute the [P, 1] reciprocal and use nisa.tensor_scalar(op0=nl.multiply, "
        "operand0=recip)."),
    "nki.isa.memset": (
        "Fills `dst` with the compile-time constant `value` (Vector or GpSimd engine). The value's type matches "
        "dst's: an int literal for integer tiles, a float for float tiles. Fresh allocations hold garbage (NaN "
        "in the simulator), so accumulators are memset before anything is added into them."),
    "nki.isa.iota": (
        "Writes an affine integer pattern into an SBUF tile: `dst[p, i0, i1, ...] = offset + p * "
        "channel_multiplier + sum_k step_k * i_k` for `pattern=[[step0, n0], [step1, n1], ...]` over the free "
        "dims, computed in int32 and cast to dst's dtype. It builds position indices and masks on chip."),
    "nki.isa.affine_select": (
        "Selects `on_true_tile` where `cmp_op(offset + p * channel_multiplier + sum_k step_k * i_k, 0)` holds "
        "and the float scalar `on_false_value` elsewhere (the affine expression is iota's), e.g. a causal or "
        "length mask built without loading one from HBM."),
    "nki.isa.max8": (
        "Finds the 8 largest values in each partition of `src` (8 to 16384 elements per partition), in "
        "descending order, into `dst[P, 8]`. With nisa.nc_find_index8 it gives top-k for k <= 8 with the rows "
        "(tokens) on partitions and the candidates along the free axis."),
    "nki.isa.nc_find_index8": (
        "For each partition, writes the uint32 index of the first occurrence in `data` of each of the 8 values "
        "of `vals` ([P, 8], e.g. from nisa.max8) into `dst[P, 8]`. Looking up a value that does not occur is "
        "undefined on hardware (the interpreter raises)."),
    "nki.isa.dma_transpose": (
        "A DMA that swaps the two axes of a 2-byte or 4-byte block while copying (HBM->SBUF or SBUF->SBUF), e.g. "
        "loading K [L, D] from HBM as K^T [D, L] in SBUF without a Tensor-engine transpose."),
    "nki.isa.tensor_copy_predicated": (
        "Copies the elements of `src` into `dst` where `predicate` (a tile of dst's shape) is non-zero, or where "
        "it is zero with `reverse_pred=True`; the other elements of dst keep their values (a masked select)."),
    "nki.language.ndarray": (
        "Allocates an uninitialised tensor: `nl.ndarray(shape=(P, F), dtype=nl.float32, buffer=nl.sbuf)`. "
        "Buffers: nl.sbuf (on-chip working memory; dim 0 is the partition axis, at most 128), nl.psum (matmul "
        "results: float32, at most 2 KiB per partition per tile), nl.shared_hbm (kernel outputs: every returned "
        "tensor is allocated there) and nl.hbm (scratch in device memory). Shapes and dtypes are compile-time "
        "constants; `name=` labels the tensor in errors and profiles."),
    "nki.language.ds": (
        "`nl.ds(start, size)` selects `size` elements from `start` when indexing a tensor: `t[nl.ds(s, n), :]` is "
        "`t[s:s + n, :]`, convenient when the start is a loop variable."),
    "nki.language.zeros": (
        "Allocates a tensor filled with zeros (a convenience for nl.ndarray followed by nisa.memset): "
        "`nl.zeros(shape=(P, F), dtype=nl.float32, buffer=nl.sbuf)`."),
}
"""Semantics notes; the first sentence of each is its one-line prompt fact."""

TENSOR_METHODS_NOTE = (
    "In NKI 0.3 (SDK 2.29) a tensor supports slicing (`t[a:b, c]`, `nl.ds(start, size)`; an int index on the "
    "partition axis of an on-chip tile keeps a size-1 axis), `.reshape(shape)` (no copy), `.view(dtype)` (bit "
    "reinterpretation; the last axis scales) and `.ap(pattern, offset=0, scalar_offset=None, vector_offset=None, "
    "indirect_dim=0, dtype=None)`, a raw access pattern: `pattern=[[stride, count], ...]` in elements, the first "
    "pair being the partition axis for on-chip tiles; a stride of 0 repeats (broadcasts) data and "
    "`scalar_offset`/`vector_offset` add a runtime index read from SBUF. Attributes: `.shape`, `.dtype`, "
    "`.buffer`, `.ndim`. `.permute`, `.broadcast`, `.slice`, `.select` and the other view methods only exist from "
    "NKI 0.5 (SDK 2.31).")


_SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z`(])")


@dataclass(frozen=True)
class Fact:
    qualname: str
    signature: str
    note: str

    @property
    def short(self) -> str:
        """The first sentence of the note (or the table's summary)."""
        m = _SENTENCE_END.search(self.note)
        return self.note if m is None else self.note[: m.start() + 1]


def short_name(qualname: str) -> str:
    module, _, name = qualname.rpartition(".")
    return f"{SHORT.get(module, module)}.{name}"


def _default(module: str, text: str, enums: set[str]) -> str:
    if text.startswith("MemoryRegion."):
        return "nl." + text.split(".", 1)[1]
    head = text.split(".", 1)[0]
    if "." in text and head in enums:
        return f"{SHORT.get(module, module)}.{text}"
    return text


def signature(qualname: str) -> str:
    """``nisa.tensor_tensor(dst, data1, data2, op, engine=nisa.engine.unknown, name=None)`` from the tables:
    parameters present in every version of :data:`VERSIONS`, in the first version's order."""
    module, _, name = qualname.rpartition(".")
    tables = [load_table(v) for v in VERSIONS]
    sigs = [t.function(module, name) for t in tables]
    if any(s is None for s in sigs):
        missing = [v for v, s in zip(VERSIONS, sigs) if s is None]
        raise KeyError(f"{qualname} is not in NKI {', '.join(missing)}")
    common = set.intersection(*({p.name for p in s.params} for s in sigs))
    enums = set(tables[0].modules[module].classes)
    parts = []
    for p in sigs[0].params:
        if p.name not in common or p.is_variadic:
            continue
        parts.append(p.name if p.default is None else f"{p.name}={_default(module, p.default, enums)}")
    return f"{short_name(qualname)}({', '.join(parts)})"


def fact(qualname: str) -> Fact:
    module, _, name = qualname.rpartition(".")
    note = NOTES.get(qualname)
    if note is None:
        sig = load_table(VERSIONS[0]).function(module, name)
        note = sig.summary if sig is not None else ""
    return Fact(qualname, signature(qualname), note)


def card_functions() -> list[str]:
    """The functions that get a fact card (every function with a note)."""
    return list(NOTES)
