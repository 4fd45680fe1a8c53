"""Tensor Engine instructions: nc_matmul and nc_transpose.

``nc_matmul``: ``dst[M, N] (+)= stationary[K, M].T @ moving[K, N]`` with K, M <= 128 and N <= 512 on trn2
(trn3: 4096 fp32 / 8192 bf16); stationary/moving in SBUF, dst in PSUM (fp32; trn3 also bf16); fp32/tf32 inputs
only pair with fp32/tf32.  Accumulation follows the documented rule, decided once per instruction (one
``acc_flags`` per matmul): ``accumulate=False`` overwrites, ``True`` adds, ``None`` accumulates when the whole
dst is in an open matmul accumulation group and overwrites when none of it is (a non-matmul write ends the
group); a partly accumulating dst is rejected.  ``accumulate=True`` onto never-written PSUM (any target) or onto
PSUM last written by a non-matmul instruction (trn2) is undefined and rejected.

fp8 Tensor Engine transposes (``nc_transpose`` on the PE, ``nc_matmul(is_transpose=True)``) on trn2 write
16-bit PSUM elements with a zero upper byte (Trainium2 architecture guide).

Tiling mode: ``tile_size=(rows, cols)`` in {32, 64, 128}, ``tile_position`` multiples of the sizes; the
stationary/moving operands must start on partition ``start_row`` and ``dst`` on PSUM partition
``start_col`` (PE column j writes PSUM partition j).  When only ``tile_position`` is given (as nki-library
does) the smallest legal tile size is inferred.
"""

from __future__ import annotations

import numpy as np

from . import access
from . import dtypes as dt
from . import enums as E
from .checks import PSUM, SBUF, Instr
from .enums import engine, matmul_perf_mode, require_enum
from .isa_common import mark_written, name_arg, psum_state_view
from .loops import static_choice
from .storage import PSUM_FRESH, PSUM_MATMUL, PSUM_OTHER

_FP32ISH = ("float32", "tfloat32")
_FP8 = ("float8_e4m3", "float8_e5m2")
_SIZES = (32, 64, 128)


def _tiling(I: Instr, tile_position, tile_size, K: int, M: int) -> tuple[int, int, int, int, bool]:
    pos = tuple(tile_position) if tile_position is not None else ()
    size = tuple(tile_size) if tile_size is not None else ()
    if not pos and not size:
        return 0, 0, 128, 128, False
    if size and not pos:
        raise I.fail("tile_size is set but tile_position is not; both must be set to enable tiling mode", "matmul-tile")
    if len(pos) != 2 or (size and len(size) != 2):
        raise I.fail(f"tile_position and tile_size must be 2-tuples, got {tile_position!r} / {tile_size!r}",
                     "matmul-tile")
    r0, c0 = int(pos[0]), int(pos[1])
    if size:
        rs, cs = int(size[0]), int(size[1])
    else:
        rs = next((s for s in _SIZES if s >= K and r0 % s == 0), 0)
        cs = next((s for s in _SIZES if s >= M and c0 % s == 0), 0)
        if not rs or not cs:
            raise I.fail(f"cannot infer a tile_size for tile_position {pos} with K={K}, M={M}", "matmul-tile")
    for what, v in (("row size", rs), ("column size", cs)):
        if v not in _SIZES:
            raise I.fail(f"tile {what} {v} must be one of 32, 64, 128", "matmul-tile")
    if r0 % rs or c0 % cs or not 0 <= r0 < 128 or not 0 <= c0 < 128:
        raise I.fail(
            f"tile_position {pos} must be multiples of tile_size ({rs}, {cs}) inside the 128x128 PE array",
            "matmul-tile",
        )
    if K > rs or M > cs:
        raise I.fail(
            f"stationary [K={K}, M={M}] does not fit the tile ({rs} rows x {cs} columns)", "matmul-tile"
        )
    return r0, c0, rs, cs, True


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=matmul_perf_mode.none, name=None):
    """dst[M, N] (+)= stationary[K, M].T @ moving[K, N] on the Tensor Engine."""
    I = Instr("nisa.nc_matmul")
    perf = require_enum(perf_mode, matmul_perf_mode, "perf_mode", I.name)
    if accumulate not in (None, True, False):
        raise I.fail(f"accumulate must be None, True or False, got {accumulate!r}", "matmul-accumulate")
    gd = I.onchip(dst, "dst", allowed=(PSUM,))
    gs = I.onchip(stationary, "stationary", allowed=(SBUF,))
    gm = I.onchip(moving, "moving", allowed=(SBUF,))
    double = perf is matmul_perf_mode.double_row
    _check_matmul_dtypes(I, stationary.dtype.name, moving.dtype.name, dst.dtype.name, is_transpose)
    K, M, N = _matmul_dims(I, gs, gm, gd, stationary, moving, dst, double)
    r0, c0, _, cs, tiled = _tiling(I, tile_position, tile_size, K, M)
    if double and tiled and cs != 128:
        raise I.fail("double_row perf mode cannot be combined with column tiling", "matmul-tile")
    _check_matmul_partitions(I, gs, gm, gd, r0, c0, tiled)
    dview = I.view(dst)
    wide = _fp8_pe_transpose_out(I, dview) if is_transpose else None
    # one static acc_flags per instruction: a replayed nl.dynamic_range iteration keeps the traced decision
    acc = static_choice(I.ctx, lambda: _accumulate_flag(I, accumulate, psum_state_view(dview)[..., 0].reshape(M, N)))
    if I.data:
        _matmul_data(I, dst, stationary, moving, dview, wide, (K, M, N), double, is_transpose, acc)
    if wide is not None:
        _mark_wide(dview, wide)
    else:
        mark_written(dst, by_matmul=True)
    I.record("nc_matmul", "tensor", K, N, dst.dtype.name, name_arg(name))


def _check_matmul_dtypes(I: Instr, sd: str, md: str, dd: str, is_transpose: bool) -> None:
    """The operand dtypes the target's Tensor Engine takes: matmul input dtypes, fp32/tf32 only with
    fp32/tf32, and a dst dtype of the target (transpose mode: the stationary's dtype)."""
    t = I.ctx.target
    for arg, d in (("stationary", sd), ("moving", md)):
        if d not in t.matmul_input_dtypes:
            raise I.fail(f"{arg} dtype {d} is not a matmul input dtype on {t.name} ({', '.join(t.matmul_input_dtypes)})",
                         "dtype")
    if (sd in _FP32ISH) != (md in _FP32ISH):
        raise I.fail(f"fp32/tf32 inputs must pair with fp32/tf32, got stationary {sd} and moving {md}", "dtype")
    if is_transpose:
        if dd != sd:
            raise I.fail(f"transpose mode needs dst dtype == stationary dtype, got {dd} and {sd}", "dtype")
    elif dd not in t.matmul_dst_dtypes:
        raise I.fail(f"dst must be {' or '.join(t.matmul_dst_dtypes)} on {t.name}, got {dd}", "dtype")


def _matmul_dims(I: Instr, gs, gm, gd, stationary, moving, dst, double: bool) -> tuple[int, int, int]:
    """``(K, M, N)`` of the matmul, checked against the PE array (K, M <= 128), the target's moving free size
    and the dst shape; ``double_row`` packs two rows per partition ([K, 2, M] / [K, 2, N], fp8 only)."""
    t = I.ctx.target
    sd, md, dd = stationary.dtype.name, moving.dtype.name, dst.dtype.name
    K = gs.partitions
    if gm.partitions != K:
        raise I.fail(f"stationary has {K} partitions but moving has {gm.partitions} (contraction dim)", "shape")
    if double:
        if sd not in _FP8 or md not in _FP8:
            raise I.fail(f"double_row perf mode needs fp8 inputs, got {sd} and {md}", "dtype")
        if len(stationary.shape) < 2 or stationary.shape[1] != 2 or len(moving.shape) < 2 or moving.shape[1] != 2:
            raise I.fail("double_row perf mode needs stationary [K, 2, M] and moving [K, 2, N]", "shape")
        M = gs.free_elems // 2
        N = gm.free_elems // 2
    else:
        M = gs.free_elems
        N = gm.free_elems
    if K > 128 or M > 128:
        raise I.fail(f"stationary [K={K}, M={M}] exceeds 128 x 128", "shape")
    fmax = t.matmul_moving_fmax_bf16 if dd == "bfloat16" else t.matmul_moving_fmax_fp32
    if N > fmax:
        raise I.fail(f"moving free size {N} exceeds {fmax} on {t.name}", "shape")
    if gd.partitions != M or gd.free_elems != N:
        raise I.fail(f"dst must be [{M}, {N}] (stationary free x moving free), got {dst.shape}", "shape")
    return K, M, N


def _check_matmul_partitions(I: Instr, gs, gm, gd, r0: int, c0: int, tiled: bool) -> None:
    """Operands on the partitions the PE tile reads: stationary and moving start together (on the tile's row
    in tiling mode) and dst starts on the PSUM partition of the tile's first PE column."""
    if gs.start_partition != gm.start_partition:
        raise I.fail(
            f"stationary (start partition {gs.start_partition}) and moving (start partition {gm.start_partition}) "
            f"must start on the same partition",
            "partition-alignment",
        )
    if tiled and gs.start_partition != r0:
        raise I.fail(
            f"stationary/moving start at partition {gs.start_partition} but tile_position row is {r0}",
            "matmul-tile",
        )
    if gd.start_partition != c0:
        raise I.fail(
            f"dst starts at PSUM partition {gd.start_partition} but the PE columns start at {c0}; set "
            f"tile_position=(row, {gd.start_partition}) (PE column j writes PSUM partition j)",
            "matmul-tile",
        )


def _matmul_data(I: Instr, dst, stationary, moving, dview, wide, dims: tuple[int, int, int], double: bool,
                 is_transpose: bool, acc: bool) -> None:
    """The arithmetic (data runs only): the product (or exact transpose) in fp32, overwritten or accumulated
    into dst, or written as the trn2 fp8 transpose's wide PSUM elements."""
    K, M, N = dims
    s = access.read_f32(I.ctx, stationary).reshape(K, -1)
    m = access.read_f32(I.ctx, moving).reshape(K, -1)
    if double:
        s = s.reshape(K, 2, M).transpose(1, 0, 2).reshape(2 * K, M)
        m = m.reshape(K, 2, N).transpose(1, 0, 2).reshape(2 * K, N)
    res = _transpose_exact(s, m) if is_transpose else s.T @ m
    if wide is not None:
        _write_wide(dview, wide, res)
    else:
        out = access.read_f32(I.ctx, dst).reshape(M, N) + res if acc else res
        access.write(I.ctx, dst, out.reshape(dst.shape))


def _accumulate_flag(I: Instr, accumulate, state: np.ndarray) -> bool:
    """The single overwrite/accumulate decision of one nc_matmul (the instruction has one ``acc_flags``).

    ``None`` auto-detects per instruction (nc_matmul stub: "the first write to a PSUM location overwrites, and
    subsequent writes to the same location accumulate"): it accumulates when every dst element is in an open
    matmul accumulation group and overwrites when none is; a dst that is partly inside a group has no single
    flag and is rejected.  ``True`` needs PSUM that was written before (never-written PSUM is undefined memory;
    on trn2 also not last written by a non-matmul instruction)."""
    t = I.ctx.target
    if accumulate is True:
        fresh = state == PSUM_FRESH
        if fresh.any():
            raise I.fail(
                f"accumulate=True onto PSUM never written since allocation ({int(fresh.sum())} of {state.size} dst "
                f"elements): the sum would start from undefined memory; start the accumulation group with "
                f"accumulate=False (or None)",
                "matmul-accumulate",
            )
        if not t.psum_accumulate_after_non_matmul_write and (state == PSUM_OTHER).any():
            raise I.fail(
                f"accumulate=True onto PSUM last written by a non-matmul instruction (memset/tensor_copy/...) is "
                f"undefined on {t.name}",
                "matmul-accumulate",
            )
        return True
    if accumulate is False:
        return False
    in_group = state == PSUM_MATMUL
    if in_group.all():
        return True
    if not in_group.any():
        return False
    raise I.fail(
        f"accumulate=None: {int(in_group.sum())} of {state.size} dst elements are in an open matmul accumulation "
        f"group and the others are not; one nc_matmul either overwrites or accumulates its whole dst, so pass "
        f"accumulate=True/False explicitly (or split the matmul)",
        "matmul-accumulate",
    )


def _fp8_pe_transpose_out(I: Instr, dst):
    """Byte layout of an fp8 Tensor Engine transpose output on NeuronCore-v3 (trn2), else None.

    trainium2_arch.rst: "NeuronCore-v3 TensorE transpose mode for FP8 input data produces 16-bit output elements
    in PSUM, with the upper 8 bits filled with zeros."  Element ``i`` of ``dst``'s access pattern is written as
    a 16-bit word (fp8 bits, then a zero byte): the free-dim strides double in bytes, so the write covers twice
    the bytes of the fp8 tile and must stay inside each partition's allocation.  Not stated for NeuronCore-v4
    (trn3), which keeps packed bytes here."""
    if I.ctx.target.nc_version is not E.nc_version.gen3 or dst.dtype.itemsize != 1 or not dst.dtype.is_float:
        return None
    st = dst._st
    fb = st.free_bytes
    byte_off = dst._offset
    f0 = byte_off % fb if fb else 0
    lo, hi = f0, f0
    for n, stp in zip(dst.shape[1:], dst._strides[1:]):
        if n > 1:
            d = (n - 1) * stp * 2
            lo, hi = (lo + d, hi) if d < 0 else (lo, hi + d)
    if lo < 0 or hi + 2 > fb:
        raise I.fail(
            f"an fp8 Tensor Engine transpose on {I.ctx.target.name} writes 16-bit PSUM elements (upper byte zero), "
            f"bytes [{lo}, {hi + 2}) of each partition, but dst '{st.label}' has {fb} bytes per partition; allocate "
            f"twice the fp8 free size (or transpose in bf16)",
            "partition-bounds",
        )
    strides = (dst._strides[0],) + tuple(s * 2 for s in dst._strides[1:])
    return dst.shape, byte_off, strides


def _write_wide(dst, wide, values: np.ndarray) -> None:
    shape, off, strides = wide
    bits = dt.cast_to(np.asarray(values, dtype=np.float32), dst.dtype).view(np.uint8).astype("<u2")
    np.ndarray(shape, dtype="<u2", buffer=dst._st.buf, offset=off, strides=strides)[...] = bits.reshape(shape)
    access.mark_bytes(dst._st, shape + (2,), off, strides + (1,))


def _mark_wide(dst, wide) -> None:
    shape, off, strides = wide
    state = dst._st.ensure_psum_state()
    np.ndarray(shape + (2,), dtype=np.uint8, buffer=state, offset=off, strides=strides + (1,))[...] = PSUM_MATMUL


def _transpose_exact(s: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Bit-accurate PE transpose when ``moving`` is a 0/1 selection matrix (identity); else a plain matmul."""
    sel = m != 0
    if np.all(sel.sum(axis=0) == 1) and np.all((m == 0) | (m == 1)):
        rows = np.argmax(sel, axis=0)
        return s[rows, :].T
    return s.T @ m


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """2-D transpose of partition and (flattened) free axes: TensorE (<=128x128, SBUF->PSUM) or VectorE (<=32x32)."""
    I = Instr("nisa.nc_transpose")
    e = require_enum(engine, E.engine, "engine", I.name)
    gd = I.onchip(dst, "dst")
    g = I.onchip(data, "data")
    if dst.dtype is not data.dtype:
        raise I.fail(f"dst dtype ({dst.dtype.name}) must equal data dtype ({data.dtype.name})", "dtype")
    P, F = g.partitions, g.free_elems
    if gd.partitions != F or gd.free_elems != P:
        raise I.fail(f"dst must be [{F}, {P}] for data of shape {data.shape}, got {dst.shape}", "shape")
    use_pe = data.buffer is SBUF and dst.buffer is PSUM and P <= 128 and F <= 128
    use_ve = P <= 32 and F <= 32
    if e is E.engine.tensor:
        if not use_pe:
            raise I.fail("the Tensor Engine transposes at most [128, 128] from SBUF into PSUM", "engine")
        use_ve = False
    elif e is E.engine.vector:
        if not use_ve:
            raise I.fail("the Vector Engine transposes at most [32, 32]", "engine")
        use_pe = False
    elif e is not E.engine.unknown:
        raise I.fail(f"engine={e} cannot transpose (use engine.tensor or engine.vector)", "engine")
    if not use_pe and not use_ve:
        raise I.fail(
            f"data [{P}, {F}] {data.buffer.name}->{dst.buffer.name}: TensorE needs <=[128,128] SBUF->PSUM, "
            f"VectorE needs <=[32,32]",
            "shape",
        )
    if use_ve:
        I.align([("data", g)], ("dst", gd))
    wide = _fp8_pe_transpose_out(I, I.view(dst)) if use_pe else None
    if I.data:
        vals = np.ascontiguousarray(np.asarray(access.read(I.ctx, data)).reshape(P, F).T)
        if wide is not None:
            shape, off, strides = wide
            np.ndarray(shape, dtype="<u2", buffer=dst._st.buf, offset=off, strides=strides)[...] = (
                vals.view(np.uint8).astype("<u2").reshape(shape))
            access.mark_bytes(dst._st, shape + (2,), off, strides + (1,))
        else:
            access.write(I.ctx, dst, vals.reshape(dst.shape))
    if wide is not None:
        _mark_wide(I.view(dst), wide)
    else:
        mark_written(dst, by_matmul=use_pe)
    I.record("nc_transpose", "tensor" if use_pe else "vector", P, F, dst.dtype.name, name_arg(name))
