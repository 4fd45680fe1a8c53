"""DMA instructions: dma_copy, dma_transpose, dma_compute.

Rules enforced (SDK 2.29): no DMA from or to PSUM (copy PSUM->SBUF with ``tensor_copy`` first);
``dge_mode=hwdge`` requires identical src/dst dtypes (HWDGE moves raw bytes; use ``.view``); ``engine=`` only
with hwdge (sync or scalar queue); vector-offset gathers/scatters need software DGE (``swdge``, or ``unknown``
for the compiler to pick); runtime offsets need a DGE mode (not ``none``); an on-chip ``.ap()`` endpoint keeps
the partition step equal to the tensor's free size; an indirect ``dma_transpose`` checks its index tile ("DMA
Indirect Transpose Constraints") and gathers rows in ``indices.T.flatten()`` order.  Element counts must match;
values are converted through float32 when dtypes differ (swdge/none/unknown).

Profile: one DMA instruction per call with its bytes (read, written, and their mean as the bytes moved),
partitions, bytes per partition and an estimate of the descriptor count (one per contiguous run:
``elements / min(contiguous run of src, dst)``, runs never crossing a partition of an on-chip side), its queue,
DGE mode and indirection (``vector`` when an endpoint has a runtime ``vector_offset``, else ``scalar`` for a runtime
``scalar_offset``, else none), plus the HBM bytes read/written per tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import access
from . import dtypes as dt
from .checks import PSUM, SBUF, Instr
from . import enums as E
from .enums import dge_mode, engine, oob_mode, require_enum
from .isa_common import name_arg
from .opsdef import spec_of
from .tensor import NkiTensor

_DGE = {dge_mode.unknown: "unknown", dge_mode.swdge: "swdge", dge_mode.hwdge: "hwdge", dge_mode.none: "none"}


def _endpoint(I: Instr, t: Any, arg: str) -> NkiTensor:
    t = I.tensor(t, arg)
    if t.buffer is PSUM:
        raise I.fail(
            f"{arg} is in PSUM; DMA cannot read or write PSUM since SDK 2.29 (copy PSUM->SBUF with "
            f"nisa.tensor_copy first)",
            "dma-psum",
        )
    if t.on_chip:
        g = I.onchip(t, arg, compute=False)
        if t._ap and not g.partition_stride_ok:
            # access-pattern guide, "Restriction on SBUF/PSUM Tensors": the partition step of an on-chip .ap must
            # be the element count of the tensor's whole free dimension (partitions are accessed contiguously)
            raise I.fail(
                f"{arg} is an .ap() of on-chip tensor '{t._st.label}' with partition step {t._strides[0]} elements; "
                f"the partition step must be {t._st.free_bytes // t.dtype.itemsize} (the free size of the tensor: "
                f"partitions cannot be skipped or repeated)",
                "partition-stride",
            )
    return t


def _check_indirect_mode(I: Instr, t: NkiTensor, arg: str, mode: dge_mode) -> None:
    ind = t._ind
    if ind is None:
        return
    if ind.kind == "vector" and mode not in (dge_mode.swdge, dge_mode.unknown):
        raise I.fail(
            f"{arg} uses vector_offset (gather/scatter) which needs software DGE; dge_mode={mode} is not allowed "
            f"(use nisa.dge_mode.swdge or leave it unknown)",
            "dge-mode",
        )
    if ind.kind == "scalar" and mode is dge_mode.none:
        raise I.fail(
            f"{arg} uses a runtime scalar_offset which needs a DGE mode (swdge/hwdge); dge_mode.none has static "
            f"descriptors",
            "dge-mode",
        )


def _partitions(dst: NkiTensor, src: NkiTensor) -> int:
    for t in (dst, src):
        if t.on_chip:
            return t.shape[0] if t.shape else 1
    return dst.shape[0] if dst.shape else 1


def _descriptors(dst: NkiTensor, src: NkiTensor, elements: int, partitions: int) -> int:
    run = min(access.contiguous_run(src, src.on_chip), access.contiguous_run(dst, dst.on_chip))
    return max(-(-elements // max(run, 1)), partitions if (dst.on_chip or src.on_chip) else 1)


def _account(I: Instr, opcode: str, dst: NkiTensor, src: NkiTensor | list[NkiTensor], queue: str, dge: str,
             name: Any) -> None:
    rec = I.ctx.rec
    site = I.ctx.site()
    srcs = src if isinstance(src, list) else [src]
    elements = dst.size
    partitions = _partitions(dst, srcs[0])
    # bytes read and written are counted separately: a converting DMA (bf16 -> fp32) reads 2 and writes 4 bytes per
    # element; what it moves is their mean (the size of a same-dtype copy), not the larger element size
    read_bytes = sum(s.size * s.dtype.itemsize for s in srcs)
    write_bytes = elements * dst.dtype.itemsize
    nbytes = -(-(read_bytes + write_bytes) // 2)
    desc = max(_descriptors(dst, s, elements, partitions) for s in srcs)
    for s in srcs:
        if s.buffer.is_hbm:
            rec.hbm_traffic(s._st.label, s._st.kind, read=s.size * s.dtype.itemsize)
    if dst.buffer.is_hbm:
        rec.hbm_traffic(dst._st.label, dst._st.kind, write=elements * dst.dtype.itemsize)
    s0 = srcs[0]
    kinds = {t._ind.kind for t in (dst, *srcs) if t._ind is not None}
    indirect = "vector" if "vector" in kinds else ("scalar" if kinds else "")
    rec.dma(site, opcode, (s0.buffer.name, _label(s0)), (dst.buffer.name, _label(dst)), queue, dge, nbytes,
            partitions, desc, indirect, read_bytes=read_bytes, write_bytes=write_bytes)
    rec.instr(site, opcode, "dma", partitions, elements // max(partitions, 1), dst.dtype.name, name_arg(name),
              tuple(I.inputs.items()))


def _label(t: NkiTensor) -> str:
    """HBM tensors by label (kernel argument name); on-chip tiles only by their name= (aggregation key)."""
    st = t._st
    return st.label if st.buffer.is_hbm else st.name


def _convert(values: np.ndarray, src: dt.DType, dst: dt.DType) -> np.ndarray:
    if src is dst:
        return values
    if src.is_packed or dst.is_packed:
        raise ValueError(f"cannot convert {src.name} to {dst.name}")
    return dt.cast_to(dt.to_f32(np.asarray(values)), dst)


def dma_copy(dst, src, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown, name=None):
    """dst = src through a DMA engine (HBM<->SBUF, SBUF<->SBUF, HBM<->HBM)."""
    I = Instr("nisa.dma_copy")
    mode = require_enum(dge_mode, E.dge_mode, "dge_mode", I.name)
    oob = require_enum(oob_mode, E.oob_mode, "oob_mode", I.name)
    eng = require_enum(engine, E.engine, "engine", I.name)
    d = _endpoint(I, dst, "dst")
    s = _endpoint(I, src, "src")
    if d.size != s.size:
        raise I.fail(f"dst has {d.size} elements ({d.shape}) but src has {s.size} ({s.shape})", "shape")
    if mode is E.dge_mode.hwdge and d.dtype is not s.dtype:
        raise I.fail(
            f"dge_mode=hwdge requires identical dtypes (HWDGE moves raw bytes), got src {s.dtype.name} and dst "
            f"{d.dtype.name}; use .view(dtype) to reinterpret or a swdge/none DMA to cast",
            "dma-dtype",
        )
    if eng is not E.engine.unknown:
        if mode is not E.dge_mode.hwdge:
            raise I.fail(f"engine={eng} is only valid with dge_mode=hwdge", "engine")
        if eng not in (E.engine.sync, E.engine.scalar):
            raise I.fail(f"engine={eng}: HWDGE DMAs are triggered from engine.sync or engine.scalar", "engine")
    if (d.dtype.is_packed or s.dtype.is_packed) and d.dtype is not s.dtype:
        raise I.fail(f"cannot convert between {s.dtype.name} and {d.dtype.name} in a DMA", "dtype")
    _check_indirect_mode(I, d, "dst", mode)
    _check_indirect_mode(I, s, "src", mode)
    rs = access.resolve_indirect(I.ctx, s, oob, I.name, I.where) if s._ind is not None else None
    rd = access.resolve_indirect(I.ctx, d, oob, I.name, I.where) if d._ind is not None else None
    skipped = (rs is not None and rs.skip) or (rd is not None and rd.skip)
    if I.data and not skipped:
        vals = _convert(np.asarray(access.read(I.ctx, s, rs)), s.dtype, d.dtype).reshape(d.shape)
        if rs is not None and rs.valid is not None:
            if d.shape[0] != s.shape[0]:
                raise I.fail("oob_mode.skip with differently shaped src/dst is not supported", "not-implemented")
            keep = rs.valid.reshape((-1,) + (1,) * (len(d.shape) - 1))
            cur = np.array(access.read(I.ctx, d, rd, check=False))  # rows skipped keep what they held
            vals = np.where(keep, vals, cur)
            before = access.written_before(d) if rd is None else None
            access.write(I.ctx, d, vals, rd)
            access.keep_unwritten(d, before, keep)
        else:
            access.write(I.ctx, d, vals, rd)
    queue = "auto" if eng is E.engine.unknown else eng.name
    if mode is E.dge_mode.swdge:
        queue = "gpsimd"
    _account(I, "dma_copy", d, s, queue, _DGE[mode], name)


_DEFAULT_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def dma_transpose(dst, src, axes=None, dge_mode=dge_mode.unknown, oob_mode=oob_mode.error, name=None):
    """Transpose through the DMA engine (HBM/SBUF -> SBUF); axes (1,0), (2,1,0) or (3,1,2,0)."""
    I = Instr("nisa.dma_transpose")
    mode = require_enum(dge_mode, E.dge_mode, "dge_mode", I.name)
    oob = require_enum(oob_mode, E.oob_mode, "oob_mode", I.name)
    d = _endpoint(I, dst, "dst")
    s = _endpoint(I, src, "src")
    if d.buffer is not SBUF:
        raise I.fail(f"dst must be in SBUF, got {d.buffer.name}", "buffer")
    if d.dtype is not s.dtype:
        raise I.fail(f"src.dtype ({s.dtype.name}) must equal dst.dtype ({d.dtype.name})", "dtype")
    if d.dtype.itemsize not in (2, 4):
        raise I.fail(f"DMA transpose supports 2- and 4-byte dtypes, got {d.dtype.name}", "dtype")
    rank = len(s.shape)
    if rank not in _DEFAULT_AXES:
        raise I.fail(f"src must be 2-, 3- or 4-D, got shape {s.shape}", "shape")
    ax = _DEFAULT_AXES[rank] if axes is None else tuple(int(a) for a in axes)
    if ax != _DEFAULT_AXES[rank]:
        raise I.fail(f"axes={axes!r} is not supported for a {rank}-D src (supported: {_DEFAULT_AXES[rank]})", "shape")
    out_shape = tuple(s.shape[a] for a in ax)
    if d.size != s.size or (len(d.shape) == rank and d.shape != out_shape):
        raise I.fail(f"dst shape {d.shape} does not match the transposed src shape {out_shape}", "shape")
    if s._ind is not None:
        if mode not in (E.dge_mode.swdge, E.dge_mode.unknown):
            raise I.fail(f"an indirect src needs dge_mode swdge (or unknown), got {mode}", "dge-mode")
        if s.dtype.itemsize != 2 or s.shape[-1] > 128 or not s.buffer.is_hbm:
            raise I.fail("indirect DMA transpose needs a 2-byte HBM src with last dim <= 128", "dge-mode")
        _check_transpose_indices(I, s)
    else:
        # the docstring lists unknown and hwdge; nki-library's hardware-tested mlp_tkg gate/up bias load issues a
        # direct transpose with dge_mode=3 (none: descriptors prebuilt by the runtime), so none is accepted too
        if mode not in (E.dge_mode.hwdge, E.dge_mode.unknown, E.dge_mode.none):
            raise I.fail(f"direct DMA transpose supports dge_mode unknown, hwdge (or none), got {mode}", "dge-mode")
        if oob is E.oob_mode.skip:
            raise I.fail("oob_mode.skip is only valid when src uses indirect indexing", "dge-mode")
        if mode is E.dge_mode.hwdge and (s.shape[0] != 16 or s.shape[-1] % 128 or s.dtype.itemsize != 2):
            raise I.fail(
                f"hwdge DMA transpose needs src.shape[0] == 16, src.shape[-1] % 128 == 0 and a 2-byte dtype; got "
                f"{s.shape} {s.dtype.name}",
                "dge-mode",
            )
    rs = (access.resolve_indirect(I.ctx, s, oob, I.name, I.where, gather_transpose=s._ind.kind == "vector")
          if s._ind is not None else None)
    if I.data:
        vals = np.transpose(np.asarray(access.read(I.ctx, s, rs)), ax)
        access.write(I.ctx, d, np.ascontiguousarray(vals).reshape(d.shape))
    _account(I, "dma_transpose", d, s, "gpsimd" if mode is E.dge_mode.swdge else "auto", _DGE[mode], name)


def _check_transpose_indices(I: Instr, s: NkiTensor) -> None:
    """The "DMA Indirect Transpose Constraints" of the dma_transpose stub (SDK 2.29) on the index tile."""
    if s._ind.kind != "vector":
        return
    idx = s._ind.index
    P = s.shape[0]
    if len(s.shape) == 4 and s.shape[1] != 1 and s.shape[2] != 1:
        raise I.fail(f"a 4-D indirect src needs src.shape[1] or src.shape[2] == 1, got {s.shape}", "shape")
    if idx.dtype is not dt.uint32:
        raise I.fail(f"indices (the vector_offset tile) must be uint32, got {idx.dtype.name}", "dtype")
    if len(idx.shape) != 2:
        raise I.fail(f"indices must be 2-D, got shape {idx.shape}", "shape")
    ip, ic = idx.shape
    if not 16 <= ip <= 128:
        raise I.fail(f"indices.shape[0] must be in [16, 128], got {ip}", "shape")
    if ip % 16:
        raise I.fail(f"indices.shape[0] must be divisible by 16, got {ip}", "shape")
    if ic > 1 and ip != 128:
        raise I.fail(f"indices.shape[0] must be exactly 128 when indices.shape[1] > 1, got {idx.shape}", "shape")
    if P % 16:
        raise I.fail(f"src.shape[0] must be divisible by 16, got {P}", "shape")
    if ip * ic < P:
        raise I.fail(f"indices.shape[0] * indices.shape[1] = {ip * ic} must be >= src.shape[0] = {P}", "shape")


def dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True, name=None):
    """dst = sum(srcs[i] * scales[i]) computed in the DMA engines (reduce_op must be nl.add, scales 1.0)."""
    I = Instr("nisa.dma_compute")
    spec = spec_of(reduce_op)
    if spec is None or spec.name != "add":
        raise I.fail(f"reduce_op must be nl.add (the only supported reduction), got {reduce_op!r}", "op")
    if not isinstance(srcs, (list, tuple)) or not srcs:
        raise I.fail("srcs must be a non-empty list of tensors", "shape")
    if len(srcs) > 16:
        raise I.fail(f"at most 16 source tensors, got {len(srcs)}", "shape")
    if scales is not None:
        if len(scales) != len(srcs) or any(float(x) != 1.0 for x in scales):
            raise I.fail("all scales must be 1.0 (or scales=None)", "shape")
    d = _endpoint(I, dst, "dst")
    ss = [_endpoint(I, x, f"srcs[{i}]") for i, x in enumerate(srcs)]
    for i, x in enumerate(ss):
        if x.size != d.size:
            raise I.fail(f"srcs[{i}] has {x.size} elements but dst has {d.size}", "shape")
    indirect = [t for t in [d, *ss] if t._ind is not None]
    if indirect:
        if len(ss) != 2:
            raise I.fail("read-modify-write with vector_offset needs exactly 2 sources", "shape")
        if not unique_indices:
            raise I.fail("unique_indices must be True with vector_offset (non-unique indices not supported)", "shape")
    oob = E.oob_mode.error
    res = [access.resolve_indirect(I.ctx, x, oob, I.name, I.where) if x._ind is not None else None for x in ss]
    rd = access.resolve_indirect(I.ctx, d, oob, I.name, I.where) if d._ind is not None else None
    if I.data:
        acc = np.zeros(d.size, dtype=np.float32)
        for x, r in zip(ss, res):
            acc += dt.to_f32(np.asarray(access.read(I.ctx, x, r))).reshape(-1)
        access.write(I.ctx, d, acc.reshape(d.shape), rd)
    _account(I, "dma_compute", d, ss, "auto", "unknown", name)
