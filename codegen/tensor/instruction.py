"""The tensor path's instruction: one ATen op over strided views of HBM buffers.

One class holds the op's whole behaviour (Megakernels style): what it reads and writes, its NKI code (the emitter
registered for its ATen op, :func:`register_emitter`) and its reference (the ATen op itself, on the logical
tensors the reference VM holds). Emitters live in one module per kind of op (pointwise, reduce, matmul, move,
const) beside this one; :data:`EMITTERS` is their table, which ``tests/codegen/test_tensor_path.py`` checks
against matching's :data:`fusegraph.matching.tensor_ops.CATEGORY`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from .. import ir
from ..emitters import Context, Emitted, inst_name, nbytes
from ..errors import CodegenError
from ..registry import register_instruction
from ..render import nl_dtype
from .tiles import Code
from .view import TRef

#: ATen op -> emitter(ins, ctx, code) -> SBUF scratch bytes per partition it allocates at once
Emitter = Callable[["TensorOp", Context, Code], int]
EMITTERS: dict[str, Emitter] = {}
#: the reference side of a guard: ``check(args, kwargs) -> bool`` on the logical tensors (True: the kernel raises
#: the flag for this step, so the step is recomputed eagerly)
GuardCheck = Callable[[tuple, dict], bool]


@dataclass(frozen=True)
class GuardRule:
    """An op whose emitter raises a guard flag when its inputs are ones the kernel cannot compute like eager (an
    index out of range, where eager raises; tied values, where eager's order is its own): ``reason`` is what the
    executor's warning says, ``check`` the same condition on the reference VM."""

    reason: str
    check: GuardCheck


#: ATen op -> its guard rule (see :func:`register_guard`)
GUARDS: dict[str, GuardRule] = {}
#: ATen op -> the reference VM's computation of it where the ATen op itself cannot run on CPU tensors (see
#: :func:`register_reference`)
REFERENCES: dict[str, Callable[..., Any]] = {}


def register_emitter(*ops: str) -> Callable[[Emitter], Emitter]:
    """Decorator: ``fn`` emits the NKI code of these ATen ops on the tensor path."""
    def deco(fn: Emitter) -> Emitter:
        for op in ops:
            EMITTERS[op] = fn
        return fn
    return deco


def register_guard(*ops: str, reason: str) -> Callable[[GuardCheck], GuardCheck]:
    """Decorator: these ops' emitters raise ``TensorOp.flag`` (a guard, see :class:`~..io.Guard`) where
    ``check`` holds; the lowering gives such an op the kernel's flag of ``reason``."""
    def deco(fn: GuardCheck) -> GuardCheck:
        for op in ops:
            GUARDS[op] = GuardRule(reason, fn)
        return fn
    return deco


def register_reference(*ops: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: the reference VM computes these ops with ``fn`` (same arguments as the ATen op) instead of the
    op itself, for an op PyTorch computes on accelerators only (an integer ``histc``)."""
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            REFERENCES[op] = fn
        return fn
    return deco


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The element type a value has in the kernel: NKI has no 64-bit integers or float64 (index values are int32,
    converted at the kernel's boundary like every integer argument)."""
    return {torch.int64: torch.int32, torch.float64: torch.float32, torch.bool: torch.uint8}.get(dtype, dtype)


def kdt(dtype: torch.dtype) -> str:
    """``nl.<dtype>`` of a value's kernel element type."""
    return nl_dtype(kernel_dtype(dtype))


def literal(x: Any, dtype: torch.dtype = torch.float32) -> str:
    """A compile-time constant as kernel source: ``float("-inf")`` for infinities (``repr`` would write a bare
    ``-inf``, a NameError in the kernel), integers for integer types."""
    if not kernel_dtype(dtype).is_floating_point:
        return str(int(x))
    v = float(x)
    if math.isinf(v) or math.isnan(v):
        return f'float("{v}")'
    return repr(v)


def flat_refs(x: Any) -> list[TRef]:
    if isinstance(x, TRef):
        return [x]
    if isinstance(x, (list, tuple)):
        return [r for e in x for r in flat_refs(e)]
    if isinstance(x, dict):
        return [r for e in x.values() for r in flat_refs(e)]
    return []


@register_instruction
@dataclass
class TensorOp(ir.Instruction):
    """``outs = op(*args, **kwargs)``: ``args`` hold :class:`TRef` operands and constants as the ATen call has them;
    ``outs`` are views of the buffers it writes (fresh scratch buffers, or a state tensor for a state write)."""

    opcode: ClassVar[str] = "tensor"
    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outs: tuple[TRef, ...]
    target: Any = None  # the ATen callable (the reference)
    fresh: tuple[bool, ...] = ()  # per out: a buffer this op allocates (False: it writes an existing one)
    const: torch.Tensor | None = None  # a value known when the kernel is built: an HBM constant argument
    flag: ir.Value | None = None  # a guard flag ([T, 1] fp32, SBUF [1, T]) the op raises (see GUARDS)
    flag_first: bool = False  # this op allocates and clears the flag (the first op of the kernel that raises it)
    output_fields: ClassVar[tuple[str, ...]] = ()
    scratch: int = field(default=0, init=False)

    def reads(self) -> list[ir.Value]:
        seen: dict[str, ir.Value] = {}
        for r in flat_refs((self.args, self.kwargs)):
            seen.setdefault(r.value.name, r.value)
        if self.flag is not None and not self.flag_first:  # raising the flag reads what earlier ops left in it
            seen.setdefault(self.flag.name, self.flag)
        return list(seen.values())

    def writes(self) -> list[ir.Value]:
        return [o.value for o in self.outs] + ([self.flag] if self.flag is not None else [])

    def constants(self, ctx: Context) -> dict[str, ir.Constant]:
        if self.const is None:
            return {}
        return {self.outs[0].value.name: ir.Constant(self.const, role=f"tensor:{self.outs[0].value.name}",
                                                      on_chip=False)}

    def emit(self, ctx: Context, i: int) -> Emitted:
        if self.const is not None:  # an argument, nothing to compute
            return Emitted(pieces=[f"    # {self.op} {tuple(self.const.shape)}: a constant argument\n"])
        fn = EMITTERS.get(self.op)
        if fn is None:
            raise CodegenError(f"the tensor path has no emitter for {self.op}")
        name = inst_name(self)
        code = Code(re.sub(r"[^0-9A-Za-z_]", "_", f"t{i}"))
        code(f"# {self.op} ({name}) on the tensor path: " + ", ".join(
            f"{tuple(o.shape)} {nl_dtype(kernel_dtype(o.dtype))}" for o in self.outs))
        for o, new in zip(self.outs, self.fresh or (True,) * len(self.outs)):
            if new:
                code(f"{ctx.var(o.value)} = nl.ndarray(shape={tuple(o.value.shape) or (1,)}, dtype={kdt(o.dtype)}, "
                     f"buffer=nl.hbm, name=\"{name}.out\")")
        if self.flag is not None and self.flag_first:  # one partition, a column per token: the Guard stores it
            code(f"{ctx.var(self.flag)} = nl.ndarray(shape=(1, {ctx.tokens}), dtype=nl.float32, buffer=nl.sbuf, "
                 f"name=\"{self.flag.name}\")")
            code(f"nisa.memset(dst={ctx.var(self.flag)}, value=0.0, name=\"{name}.flag\")")
        self.scratch = fn(self, ctx, code)
        e = Emitted(sbuf=self.scratch, psum_banks=2 if self.op in _MATMULS else 0)
        e.pieces.append(_indent(code.text()))
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        if self.const is not None:
            env[self.outs[0].value.name] = self.const.clone()
            return
        args = _materialize(self.args, env)
        kwargs = _materialize(self.kwargs, env)
        if self.op == "aten.copy_.default":  # a state write: into the state tensor's view
            dst = _view(self.outs[0], env)
            dst.copy_(args[1])
            return
        if self.flag is not None:
            raised = bool(GUARDS[self.op].check(args, kwargs))
            prev = env[self.flag.name] if not self.flag_first else torch.zeros(self.flag.shape)
            env[self.flag.name] = torch.maximum(prev, torch.full(self.flag.shape, float(raised)))
            if raised:  # eager recomputes this step (or raises, as for an index out of range): no result here
                for o in self.outs:
                    if o.value.name not in env:
                        env[o.value.name] = torch.zeros(o.value.shape, dtype=o.value.dtype)
                return
        result = REFERENCES.get(self.op, self.target)(*args, **kwargs)
        results = result if isinstance(result, (tuple, list)) else (result,)
        for o, r in zip(self.outs, results):
            env[o.value.name] = r.detach().reshape(o.value.shape).clone()

    def name_stem(self) -> str:
        return inst_name(self)


_MATMULS = {"aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.baddbmm.default"}


def _view(ref: TRef, env: dict[str, torch.Tensor]) -> torch.Tensor:
    base = env[ref.value.name]
    if not base.is_contiguous():
        base = base.contiguous()
        env[ref.value.name] = base
    return base.reshape(-1).as_strided(ref.shape, ref.strides, ref.offset)


def _materialize(x: Any, env: dict[str, torch.Tensor]) -> Any:
    if isinstance(x, TRef):
        return _view(x, env)
    if isinstance(x, list):
        return [_materialize(e, env) for e in x]
    if isinstance(x, tuple):
        return tuple(_materialize(e, env) for e in x)
    if isinstance(x, dict):
        return {k: _materialize(v, env) for k, v in x.items()}
    return x


def _indent(text: str) -> str:
    return "".join("    " + line + "\n" if line else "\n" for line in text.splitlines())


def tile_alloc(code: Code, shape: tuple[int, ...], dtype: torch.dtype, label: str, what: str,
               buffer: str = "sbuf") -> str:
    """Allocate an SBUF (or PSUM) tile; returns its variable."""
    var = code.fresh(what)
    code(f"{var} = nl.ndarray(shape={shape}, dtype={kdt(dtype)}, buffer=nl.{buffer}, name=\"{label}.{what}\")")
    return var


def tile_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes per partition of an SBUF tile of ``shape``."""
    return math.prod(shape[1:]) * nbytes(kernel_dtype(dtype))


__all__ = ["EMITTERS", "GUARDS", "GuardRule", "REFERENCES", "TensorOp", "flat_refs", "kdt", "kernel_dtype",
           "register_emitter", "register_guard", "register_reference", "tile_alloc", "tile_bytes"]
