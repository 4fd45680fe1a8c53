"""StableHLO module -> functional ATen FX graph, with the same op forms and metadata the torch path's
``capture/lower.py`` produces, ready for :func:`fusegraph.program.build.add_graph`.

The function's arguments are the graph's inputs, in order, followed by one input per non-splat constant
(``buffer`` inputs: read-only tensors such as rotary frequencies). A donated argument whose buffer a result
reuses (``tf.aliasing_output``) is *state*: the graph writes the result back into it with a trailing ``copy_``,
exactly like functionalized PyTorch code that updates its KV cache in place, so the program turns the write
into an in-place ``index_copy_`` on the cache.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import torch.fx as fx

from ..capture.lower import to_aten
from .emit import Emitter, HANDLERS
from .ir import Function, Module, Op, UnsupportedOp, Value
from .parse import parse_module
from .values import Transposed, torch_dtype

log = logging.getLogger(__name__)


@dataclass
class ImportedInput:
    """One input of the imported graph. ``arg`` is the function argument it stands for (``None`` for a
    constant); ``transpose`` means the graph receives that argument transposed (``W.T``: see
    :class:`~.values.Transposed`); ``value`` holds a constant's data."""

    name: str
    kind: str  # "weight" | "state" | "step" | "buffer"
    shape: tuple[int, ...]
    dtype: torch.dtype
    arg: int | None = None
    transpose: bool = False
    value: torch.Tensor | None = None
    contract: int = 0  # with ``transpose``: the argument's leading dims that form K
    arg_shape: tuple[int, ...] = ()


@dataclass
class ImportedOutput:
    """One result of the function: its StableHLO element type (``i32`` results are computed as int64) and the
    argument it is written back to when it is state."""

    dtype: str
    shape: tuple[int, ...]
    state_of: int | None = None


@dataclass
class ImportedGraph:
    gm: fx.GraphModule
    inputs: list[ImportedInput]
    outputs: list[ImportedOutput]
    module: Module
    stablehlo_ops: int
    op_counts: dict[str, int] = field(default_factory=dict)


def unsupported_ops(module: Module) -> list[str]:
    """Op names in ``module`` the importer has no handler for (checked before tracing, so the fallback warning
    can name every one of them)."""
    known = set(HANDLERS) | {"func.call", "stablehlo.composite"}
    seen: list[str] = []
    for f in module.functions.values():
        for op in f.body.ops:
            if op.name not in known and op.name not in seen:
                seen.append(op.name)
    return seen


def _constants(module: Module) -> list[Op]:
    out: list[Op] = []

    def walk(fn: Function) -> None:
        for op in fn.body.ops:
            if op.name == "stablehlo.constant":
                flat = op.attrs["value"].reshape(-1)
                if flat.size and not np.all(flat == flat[0]):
                    out.append(op)

    for f in module.functions.values():
        walk(f)
    return out


def linear_contraction(v: Value) -> int | None:
    """How many leading dims of this value are contracted when it is the right operand of ``x @ W`` (einsum
    ``...k,k...->...``: x's last dims with W's first, no batch dims), if every such use agrees; else ``None``."""
    found: set[int] = set()
    for user in v.users:
        if user.name != "stablehlo.dot_general" or user.operands[1] is not v or user.operands[0] is v:
            continue
        dn = user.attrs["dot_dimension_numbers"]
        lrank = len(user.operands[0].type.shape)
        c = len(dn["rhs_contract"])
        if not dn["lhs_batch"] and dn["rhs_contract"] == tuple(range(c)) and \
                dn["lhs_contract"] == tuple(range(lrank - c, lrank)) and c < len(v.type.shape):
            found.add(c)
    return found.pop() if len(found) == 1 else None


def _tensor_of(arr: np.ndarray, dtype: str) -> torch.Tensor:
    if dtype == "bf16":
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(arr).copy()).to(torch_dtype(dtype))


def _direct_state_writes(gm: fx.GraphModule) -> None:
    """``copy_(arg, copy(arg, v))`` -> ``copy_(arg, v)``: writing the result back into the state argument is
    traced as a functional ``copy`` first; with equal shape and dtype it is ``v`` itself, and the direct form is
    what functionalized PyTorch code that updates its cache in place looks like (what ``program/state.py``
    turns into an in-place write)."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.copy_.default:
            continue
        dst, src = node.args[0], node.args[1]
        if not (isinstance(src, fx.Node) and src.target is torch.ops.aten.copy.default and src.args[0] is dst):
            continue
        value = src.args[1]
        a, b = dst.meta.get("val"), value.meta.get("val") if isinstance(value, fx.Node) else None
        if b is None or tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            continue
        node.replace_input_with(src, value)
        if not src.users:
            gm.graph.erase_node(src)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def import_stablehlo(source: Any, *, arg_kinds: Sequence[str] | None = None,
                     arg_names: Sequence[str] | None = None, transpose_weights: bool = True) -> ImportedGraph:
    """Translate a StableHLO module (text, bytecode, an MLIR module or a parsed :class:`~.ir.Module`) into an
    ATen graph. ``arg_kinds`` classifies the function's arguments (``weight``/``state``/``step``; default: state
    for arguments with an aliased result, else step), ``arg_names`` names them for reports.

    Raises :class:`~.ir.UnsupportedOp` naming the first op (or op form) it cannot translate.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    module = source if isinstance(source, Module) else parse_module(source)
    missing = unsupported_ops(module)
    if missing:
        raise UnsupportedOp(missing[0], "no translation" + (f" (also: {', '.join(missing[1:])})" if missing[1:] else ""))
    fn = module.entry
    n = len(fn.body.args)
    aliases = {i: a["tf.aliasing_output"] for i, a in enumerate(fn.arg_attrs) if "tf.aliasing_output" in a}
    kinds = list(arg_kinds) if arg_kinds is not None else ["step"] * n
    if len(kinds) != n:
        raise ValueError(f"{len(kinds)} argument kinds for {n} arguments")
    names = list(arg_names) if arg_names is not None else [f"arg{i}" for i in range(n)]
    inputs: list[ImportedInput] = []
    for i, v in enumerate(fn.body.args):
        kind = "state" if i in aliases and kinds[i] != "weight" else kinds[i]
        if kind == "state" and i not in aliases:
            kind = "step"  # nothing is written back into it: an ordinary input
        c = linear_contraction(v) if transpose_weights and kind == "weight" else None
        shape = v.type.shape
        if c is not None:  # presented as one [N, K] matrix
            shape = (math.prod(v.type.shape[c:]), math.prod(v.type.shape[:c]))
        inputs.append(ImportedInput(name=names[i], kind=kind, shape=shape, dtype=torch_dtype(v.type, "argument"),
                                    arg=i, transpose=c is not None, contract=c or 0, arg_shape=v.type.shape))
    consts = _constants(module)
    for k, c in enumerate(consts):
        t = c.result.type
        inputs.append(ImportedInput(name=f"constant{k}", kind="buffer", shape=t.shape, dtype=torch_dtype(t, c.name),
                                    value=_tensor_of(c.attrs["value"], t.dtype)))
    outputs = [ImportedOutput(dtype=v.type.dtype, shape=v.type.shape) for v in fn.body.returns]
    for arg, out in aliases.items():
        if inputs[arg].kind == "state" and out < len(outputs):
            outputs[out].state_of = arg

    def step(*tensors: torch.Tensor) -> tuple:
        args = [Transposed(t, spec.arg_shape) if spec.transpose else t for t, spec in zip(tensors[:n], inputs[:n])]
        buffers = {id(c): t for c, t in zip(consts, tensors[n:])}
        em = Emitter(module, buffers)
        from .values import materialize

        results = [materialize(r) for r in em.run(fn, args)]
        for k, out in enumerate(outputs):
            if out.state_of is not None and results[k] is not tensors[out.state_of]:
                tensors[out.state_of].copy_(results[k])
        return tuple(results)

    mode = FakeTensorMode()
    with mode:
        fake = [torch.empty(spec.shape, dtype=spec.dtype) for spec in inputs]
    gm = to_aten(step, fake, fake_mode=mode)
    _direct_state_writes(gm)
    counts: dict[str, int] = {}
    for name in module.op_names():
        counts[name] = counts.get(name, 0) + 1
    log.debug("imported StableHLO: %d ops -> %d ATen ops", sum(counts.values()),
              sum(1 for nd in gm.graph.nodes if nd.op == "call_function"))
    return ImportedGraph(gm=gm, inputs=inputs, outputs=outputs, module=module, stablehlo_ops=sum(counts.values()),
                         op_counts=counts)
