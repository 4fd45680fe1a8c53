"""Shared operand checks of the ISA instructions (the hardware rules the official simulator lacks).

Every failed check raises :class:`~fusegraph.nkisim.errors.NkiValidationError` naming the rule and the
kernel ``file:line``.  Rules (identifier: meaning):

``partition-dim``       partition dim (dim 0) of an on-chip operand > 128
``start-partition``     an on-chip compute operand with >64 partitions must start at partition 0, 33-64 at 0/64,
                        <=32 at 0/32/64/96
``partition-alignment`` two inputs of a Vector/Scalar/GpSimd instruction in the same memory (both SBUF or both PSUM)
                        with more than 32 partitions must start on the same partition (an SBUF and a PSUM input may
                        start on different halves); the output may start elsewhere only for <=64 partitions
                        (cross-half / cross-quadrant movement)
``partition-stride``    an on-chip compute operand must occupy consecutive partitions (no partition striding)
``partition-bounds``    a free-dim access pattern leaves its partition's allocation
``access-pattern``      more than 4 free dims after merging, a stride beyond int16 or a size beyond uint16
``buffer``              an operand lives in a memory the instruction cannot access
``dtype``               operand dtype not allowed by the instruction
``shape``               operand shapes / element counts do not match the instruction's rules
``engine``              engine restriction (e.g. GpSimd cannot access PSUM)
"""

from __future__ import annotations

from typing import Any

from .access import Geo, cached_engine_view, geometry, merged_dims, resolve_engine_offset
from .context import ProgramContext, current
from .enums import MemoryRegion
from .errors import NkiValidationError
from .tensor import NkiTensor, check_bounds
from .trace import covers_storage, storage_key

SBUF = MemoryRegion.sbuf
PSUM = MemoryRegion.psum
ON_CHIP = (SBUF, PSUM)

MAX_PARTITIONS = 128
MAX_FREE_DIMS = 4
INT16_MAX = 32767
UINT16_MAX = 65535


def start_partition_ok(start: int, n: int) -> bool:
    if n > 64:
        return start == 0
    if n > 32:
        return start in (0, 64)
    return start in (0, 32, 64, 96)


#: tensor arguments an instruction writes (every other tensor argument is an input; ``dsts[i]`` too)
OUTPUT_ARGS = frozenset({"dst", "reduce_res", "result"})


class Instr:
    """Validation/bookkeeping helper for one instruction call.

    ``inputs`` maps every input tensor argument seen by :meth:`tensor` / :meth:`onchip` to its dtype name
    (``{"stationary": "bfloat16", "moving": "bfloat16"}``); :meth:`record` hands it to the profile.
    """

    __slots__ = ("name", "ctx", "inputs", "buffers")

    def __init__(self, name: str):
        self.name = name
        self.ctx: ProgramContext = current(name)
        self.ctx.instr_name = name  # names the instruction in access.py's uninitialized-read error
        self.inputs: dict[str, str] = {}
        self.buffers: dict[str, MemoryRegion] = {}  # on-chip operand -> its memory (the alignment rule needs it)
        if self.ctx.ind_cache:
            self.ctx.ind_cache.clear()
        if self.ctx.rec.tracer is not None:
            self.ctx.rec.tracer.begin()

    @property
    def data(self) -> bool:
        return not self.ctx.shape_only

    def fail(self, msg: str, rule: str) -> NkiValidationError:
        return NkiValidationError(f"{self.name}: {msg}", rule=rule, location=self.ctx.where())

    def where(self) -> str:
        return self.ctx.where()

    # ------------------------------------------------------------------ operands
    def tensor(self, x: Any, arg: str) -> NkiTensor:
        if not isinstance(x, NkiTensor):
            raise self.fail(f"{arg} must be an NKI tensor, got {type(x).__name__}", "shape")
        m = x._st.mem
        if m is not None:
            m.last_use = self.ctx.rec.count
        is_input = arg not in OUTPUT_ARGS and not arg.startswith("dst")
        if is_input:
            self.inputs[arg] = x.dtype.name
        tr = self.ctx.rec.tracer
        if tr is not None:
            tr.touch(storage_key(x), not is_input, not covers_storage(x), "hbm" if x._st.buffer.is_hbm else
                     x._st.buffer.name)
        if x._ap and x._ind is None:
            try:
                check_bounds(x)
            except NkiValidationError as exc:
                raise self.fail(f"{arg}: {exc.detail}", "out-of-bounds") from None
        return x

    def onchip(self, x: Any, arg: str, allowed: tuple[MemoryRegion, ...] = ON_CHIP, compute: bool = True) -> Geo:
        """Validate an on-chip operand of a compute instruction and return its geometry."""
        t = self.tensor(x, arg)
        buf = t._st.buffer
        if buf not in allowed:
            names = "/".join(b.name.upper() for b in allowed)
            raise self.fail(f"{arg} must be in {names}, got a tensor in {buf.name}", "buffer")
        self.buffers[arg] = buf
        if t._ind is not None and compute:
            t = self._engine_view(t, arg)
        g = geometry(t)
        if g.partitions > MAX_PARTITIONS:
            raise self.fail(f"{arg} partition dimension {g.partitions} exceeds maximum {MAX_PARTITIONS}", "partition-dim")
        if g.start_partition + g.partitions > MAX_PARTITIONS:
            raise self.fail(
                f"{arg} occupies partitions [{g.start_partition}, {g.start_partition + g.partitions}) beyond 128",
                "partition-dim",
            )
        if compute and not g.partition_stride_ok:
            raise self.fail(
                f"{arg} strides across partitions (stride {t._strides[0]} elements); on-chip operands must occupy "
                f"consecutive partitions",
                "partition-stride",
            )
        if g.free_lo < 0 or g.free_hi > t._st.free_bytes:
            raise self.fail(
                f"{arg} free-dim access covers bytes [{g.free_lo}, {g.free_hi}) of a partition but its allocation "
                f"'{t._st.label}' has {t._st.free_bytes} bytes per partition",
                "partition-bounds",
            )
        if compute:
            if not start_partition_ok(g.start_partition, g.partitions):
                raise self.fail(
                    f"{arg} starts at partition {g.start_partition} with {g.partitions} partitions; "
                    f"start-partition rule: >64 partitions start at 0, 33-64 at 0 or 64, <=32 at 0/32/64/96",
                    "start-partition",
                )
            dims = merged_dims(t.shape[1:], t._strides[1:])
            if len(dims) > MAX_FREE_DIMS:
                raise self.fail(
                    f"{arg} needs {len(dims)} free-dim access-pattern dims after merging (max {MAX_FREE_DIMS})",
                    "access-pattern",
                )
            for n, s in dims:
                if abs(s) > INT16_MAX or n > UINT16_MAX:
                    raise self.fail(
                        f"{arg} free-dim access pattern [stride {s}, count {n}] exceeds the ISA limits "
                        f"(stride int16, count uint16, in elements)",
                        "access-pattern",
                    )
        return g

    def _engine_view(self, t: NkiTensor, arg: str) -> NkiTensor:
        """Resolve the runtime ``scalar_offset`` of an engine operand (the checks then see the real access)."""
        ind = t._ind
        if ind.kind != "scalar":
            raise self.fail(f"{arg}: vector_offset indirection is only available to DMA instructions", "dynamic-offset")
        if ind.dim == 0:
            raise self.fail(
                f"{arg}: a runtime scalar_offset with indirect_dim=0 would move an engine operand across partitions; "
                f"engines take dynamic offsets within each partition (indirect_dim >= 1), use a DMA to move data "
                f"to a runtime partition",
                "dynamic-offset",
            )
        return resolve_engine_offset(self.ctx, t, self.name, self.ctx.where)

    def view(self, t: NkiTensor) -> NkiTensor:
        """The direct view this instruction accesses for ``t`` (``t`` itself unless it has a runtime offset)."""
        if t._ind is None:
            return t
        return cached_engine_view(self.ctx, t) or t

    def align(self, inputs: list[tuple[str, Geo]], output: tuple[str, Geo] | None) -> None:
        """Partition alignment of a Vector/Scalar/GpSimd instruction.

        The architecture guide ("Cross-Partition Connectivity", trainium_inferentia2_arch.rst) states the src -> dst
        movement only: cross-half for 32 < n <= 64, cross-quadrant for n <= 32.  It says nothing about two inputs;
        the rule follows the hardware-tested kernels: nki-library's qkv_tkg (test_qkv_tkg.py, B=8 S=5) adds PSUM
        rows [64, 104) to SBUF rows [0, 40), and at <=32 partitions PSUM rows [32f, 32f+T) to SBUF rows [0, T);
        its RoPE copies the upper half of an SBUF tile before ``tensor_tensor`` with another SBUF tile ("required
        for tensor_tensor base partition alignment"), so two >32-partition inputs in the same memory must align.
        """
        if inputs:
            a0, g0 = inputs[0]
            for i, (a, g) in enumerate(inputs[1:], 1):
                self._align_pair(inputs[:i], (a, g))
            if output is not None:
                a, g = output
                if g.start_partition != g0.start_partition and g.partitions > 64:
                    raise self.fail(
                        f"output {a} starts at partition {g.start_partition} but input {a0} at {g0.start_partition}; "
                        f"cross-partition movement is only possible for <=64 partitions",
                        "partition-alignment",
                    )

    def _align_pair(self, earlier: list[tuple[str, Geo]], item: tuple[str, Geo]) -> None:
        """Reject ``item`` when an earlier input in the same memory has >32 partitions and another start."""
        a, g = item
        for b, h in earlier:
            if g.start_partition == h.start_partition or max(g.partitions, h.partitions) <= 32:
                continue
            mem_a, mem_b = self.buffers.get(a), self.buffers.get(b)
            if mem_a is not None and mem_b is not None and mem_a != mem_b:
                continue  # SBUF + PSUM on different halves: nki-library qkv_tkg does this on hardware
            where = f" (both in {mem_a.name.upper()})" if mem_a is not None and mem_a == mem_b else ""
            raise self.fail(
                f"inputs {b} (start partition {h.start_partition}) and {a} (start partition "
                f"{g.start_partition}) must start on the same partition{where}: two inputs in one memory with "
                f"more than 32 partitions cannot sit on different halves",
                "partition-alignment",
            )

    def same_partitions(self, pairs: list[tuple[str, Geo]]) -> None:
        a0, g0 = pairs[0]
        for a, g in pairs[1:]:
            if g.partitions != g0.partitions:
                raise self.fail(
                    f"{a} has {g.partitions} partitions but {a0} has {g0.partitions}", "shape"
                )

    def same_free(self, pairs: list[tuple[str, Geo]]) -> None:
        a0, g0 = pairs[0]
        for a, g in pairs[1:]:
            if g.free_elems != g0.free_elems:
                raise self.fail(
                    f"{a} has {g.free_elems} elements per partition but {a0} has {g0.free_elems}", "shape"
                )

    def per_partition_vector(self, x: Any, arg: str, partitions: int) -> Geo:
        """A ``[P, 1]`` operand (scale/bias/operand0) in SBUF or PSUM."""
        g = self.onchip(x, arg)
        if g.partitions != partitions or g.free_elems != 1:
            raise self.fail(
                f"{arg} must have shape [{partitions}, 1] (one element per partition), got {x.shape}", "shape"
            )
        return g

    def record(self, opcode: str, engine: str, partitions: int, free: int, dtype: str, name: Any) -> None:
        self.ctx.rec.instr(self.ctx.site(), opcode, engine, partitions, free, dtype, name if isinstance(name, str) else None,
                           tuple(self.inputs.items()))
