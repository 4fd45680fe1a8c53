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
from torch._subclasses.fake_tensor import FakeTensorMode

from ..capture.lower import to_aten
from . import layout_idioms, stacked
from .idioms import is_splat
from .emit import Emitter, HANDLERS, sorted_contraction
from .ir import Function, Module, Op, UnsupportedOp, Value
from .parse import parse_module
from .values import ExpertWeight, Stacked, Transposed, materialize, stacked_tensor, torch_dtype

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
    #: a part of a split (stacked) state argument: its key over ``stack_dims``, stored as the logical part
    #: permuted back from ``perm`` (see :mod:`.stacked`)
    part: tuple[int, ...] | None = None
    stack_dims: tuple[int, ...] = ()
    perm: tuple[int, ...] = ()
    #: keras-hub's expert weights in HF's layout: ``("gate_up", up argument)`` (``[E, 2I, H]`` from gate and up
    #: ``[E, H, I]``) or ``("down",)`` (``[E, H, I]`` from ``[E, I, H]``); see :func:`experts_weight`
    experts: tuple = ()

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """This input's tensor from its whole argument ``t`` (a contiguous copy of the part when split)."""
        if self.part is None:
            return t
        # always a copy: ``t`` may share memory with an immutable JAX array, and the program writes parts in place
        return stacked.take_part(t, self.part, self.stack_dims, self.perm).clone(memory_format=torch.contiguous_format)


@dataclass
class ImportedOutput:
    """One result of the function: its StableHLO element type (``i32`` results are computed as int64) and the
    argument it is written back to when it is state."""

    dtype: str
    shape: tuple[int, ...]
    state_of: int | None = None
    #: written back into a split state argument: the graph returns its parts (stack dims, perm) instead
    split: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    @property
    def count(self) -> int:
        """How many graph outputs carry this result."""
        return 1 if self.split is None else len(stacked.part_keys(self.shape, self.split[0]))


@dataclass
class ImportedGraph:
    gm: fx.GraphModule
    inputs: list[ImportedInput]
    outputs: list[ImportedOutput]
    module: Module
    stablehlo_ops: int
    op_counts: dict[str, int] = field(default_factory=dict)

    def results(self, outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The function's results from the graph's outputs (a split state result reassembled from its parts)."""
        out, pos = [], 0
        for o in self.outputs:
            if o.split is None:
                out.append(outs[pos])
            else:
                sd, perm = o.split
                keys = stacked.part_keys(o.shape, sd)
                with torch.no_grad():
                    out.append(stacked_tensor(Stacked(dict(zip(keys, outs[pos:pos + len(keys)])), o.shape, sd, perm)))
            pos += o.count
        return out


def experts_weight(spec: ImportedInput, first: torch.Tensor, second: torch.Tensor | None = None) -> torch.Tensor:
    """The program's tensor for an expert-weights input from its argument(s) (a new contiguous tensor)."""
    if spec.experts[0] == "down":
        return first.transpose(1, 2).contiguous().to(spec.dtype)
    return torch.cat((first.transpose(1, 2), second.transpose(1, 2)), dim=1).contiguous().to(spec.dtype)


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
                if flat.size and not is_splat(flat):
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
        lc, rc = sorted_contraction(dn["lhs_contract"], dn["rhs_contract"])
        if not dn["lhs_batch"] and rc == tuple(range(c)) and lc == tuple(range(lrank - c, lrank)) and \
                c < len(v.type.shape):
            found.add(c)
    return found.pop() if len(found) == 1 else None


def _tensor_of(arr: np.ndarray, dtype: str) -> torch.Tensor:
    if dtype == "bf16":
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(arr).copy()).to(torch_dtype(dtype))


def _fold(module: Module, cone: list[Op], value: Value) -> torch.Tensor:
    """Evaluate a constant-only value now, with the same PyTorch calls the traced graph would make on CPU (so
    the folded tensor is exactly what the unfolded graph computes)."""
    buffers = {}
    for op in cone:
        if op.name == "stablehlo.constant":
            flat = op.attrs["value"].reshape(-1)
            if flat.size and not is_splat(flat):
                buffers[id(op)] = _tensor_of(op.attrs["value"], op.result.type.dtype)
    em = Emitter(module, buffers)
    env: dict[int, Any] = {}
    em._values = env
    with torch.no_grad():
        for op in cone:
            em.step(op, env)
        return materialize(env[id(value)]).clone()


def _rope_tables(module: Module) -> tuple[dict, list[torch.Tensor]]:
    """keras-hub's rotary tables (:func:`~.layout_idioms.rope_table_of`): their ``inv_freq`` folded into buffer
    inputs (one per distinct value), and a key per table op ``(buffer index, start value id, tokens)``: tables
    with the same key are the same values, computed once (Keras recomputes them for q and k in every layer)."""
    found: dict = {}
    folded: list[torch.Tensor] = []
    for t in layout_idioms.rope_tables(module):
        cone = layout_idioms.inv_freq_cone(module, t)
        try:
            value = _fold(module, cone, t.inv_freq) if cone is not None else None
        except (UnsupportedOp, RuntimeError, TypeError, KeyError):
            value = None
        if value is None or value.dtype != torch.float32:
            continue
        index = next((i for i, f in enumerate(folded) if f.shape == value.shape and torch.equal(f, value)), None)
        if index is None:
            folded.append(value)
            index = len(folded) - 1
        found[t] = (index, id(t.start), t.tokens)
    return found, folded


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
    expert_args = _expert_arguments(module, fn, kinds)
    inputs, splits = _argument_inputs(fn, kinds, names, aliases, expert_args, transpose_weights)
    consts = _constants(module)
    inputs += _constant_inputs(consts)
    tables, folded = _rope_tables(module)
    inputs += [ImportedInput(name=f"inv_freq{k}", kind="buffer", shape=tuple(value.shape), dtype=value.dtype,
                             value=value) for k, value in enumerate(folded)]
    outputs = _imported_outputs(fn, inputs, aliases, splits)
    step = _Step(module, fn, inputs, outputs, splits, expert_args, consts, tables)
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


def _expert_arguments(module: Module, fn: Function, kinds: list[str]) -> dict[int, tuple]:
    """keras-hub's dense MoE expert weights, when all three are weights: argument -> ``("gate_up", up arg)`` |
    ``("up", gate arg)`` | ``("down",)``. The graph receives them in HF's layout (gate and up fused), so the
    torch path's expert patterns match them."""
    expert_args: dict[int, tuple] = {}
    index_of = {id(v): i for i, v in enumerate(fn.body.args)}
    for e in layout_idioms.dense_experts(module):
        g, u, d = index_of[id(e.gate)], index_of[id(e.up)], index_of[id(e.down)]
        if all(kinds[a] == "weight" for a in (g, u, d)):
            expert_args.update({g: ("gate_up", u), u: ("up", g), d: ("down",)})
    return expert_args


def _argument_inputs(fn: Function, kinds: list[str], names: list[str], aliases: dict[int, int],
                     expert_args: dict[int, tuple], transpose_weights: bool
                     ) -> tuple[list[ImportedInput], dict[int, tuple[tuple[int, ...], tuple[int, ...]]]]:
    """The graph inputs of the function's arguments, in argument order: expert weights in HF's layout (the up
    weight inside the gate's), a stacked state argument as one input per part (returned in ``splits``: argument
    -> (stack dims, perm)), a weight a linear contracts presented transposed as one [N, K] matrix."""
    inputs: list[ImportedInput] = []
    splits: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for i, v in enumerate(fn.body.args):
        if i in expert_args:
            if expert_args[i][0] != "up":  # the up weight is part of the gate's fused input
                inputs.append(_expert_input(i, v, names, expert_args[i]))
            continue
        kind = "state" if i in aliases and kinds[i] != "weight" else kinds[i]
        if kind == "state" and i not in aliases:
            kind = "step"  # nothing is written back into it: an ordinary input
        layout = _stacked_layout(fn, i, v, aliases) if kind == "state" else None
        if layout is not None:  # a stacked KV cache: one state input per part
            splits[i] = layout
            sd, perm = layout
            pshape = stacked.part_shape(v.type.shape, sd, perm)
            for key in stacked.part_keys(v.type.shape, sd):
                inputs.append(ImportedInput(name=names[i] + "".join(f"[{k}]" for k in key), kind=kind,
                                            shape=pshape, dtype=torch_dtype(v.type, "argument"), arg=i,
                                            arg_shape=v.type.shape, part=key, stack_dims=sd, perm=perm))
            continue
        c = linear_contraction(v) if transpose_weights and kind == "weight" else None
        shape = v.type.shape
        if c is not None:  # presented as one [N, K] matrix
            shape = (math.prod(v.type.shape[c:]), math.prod(v.type.shape[:c]))
        inputs.append(ImportedInput(name=names[i], kind=kind, shape=shape, dtype=torch_dtype(v.type, "argument"),
                                    arg=i, transpose=c is not None, contract=c or 0, arg_shape=v.type.shape))
    return inputs, splits


def _expert_input(i: int, v: Value, names: list[str], how: tuple) -> ImportedInput:
    """The input of expert weight argument ``i``: ``[E, 2I, H]`` gate+up from gate and up ``[E, H, I]``, or
    ``[E, H, I]`` down from ``[E, I, H]`` (see :func:`experts_weight`)."""
    e_, h_, i_ = v.type.shape if how[0] == "gate_up" else (v.type.shape[0], v.type.shape[2], v.type.shape[1])
    shape = (e_, 2 * i_, h_) if how[0] == "gate_up" else (e_, h_, i_)
    return ImportedInput(name=names[i] if how[0] == "down" else f"{names[i]}+{names[how[1]]}",
                         kind="weight", shape=shape, dtype=torch_dtype(v.type, "argument"), arg=i,
                         arg_shape=v.type.shape, experts=how)


def _stacked_layout(fn: Function, i: int, v: Value,
                    aliases: dict[int, int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """How state argument ``i`` splits into per-layer parts (see :mod:`.stacked`), or None to keep it whole: not
    stacked, or its aliased result is not the same stacked cache."""
    layout = stacked.split_layout(v)
    if layout is not None and fn.body.returns[aliases[i]].type.shape != v.type.shape:
        return None
    return layout


def _constant_inputs(consts: list[Op]) -> list[ImportedInput]:
    """One buffer input per non-splat constant (``constant<k>``), holding its data."""
    inputs = []
    for k, c in enumerate(consts):
        t = c.result.type
        inputs.append(ImportedInput(name=f"constant{k}", kind="buffer", shape=t.shape, dtype=torch_dtype(t, c.name),
                                    value=_tensor_of(c.attrs["value"], t.dtype)))
    return inputs


def _imported_outputs(fn: Function, inputs: list[ImportedInput], aliases: dict[int, int],
                      splits: dict[int, tuple[tuple[int, ...], tuple[int, ...]]]) -> list[ImportedOutput]:
    """The function's results; one aliased to a state argument is written back into it (as its parts when that
    argument is split and the result has its whole shape)."""
    outputs = [ImportedOutput(dtype=v.type.dtype, shape=v.type.shape) for v in fn.body.returns]
    arg_kind = {spec.arg: spec.kind for spec in inputs if spec.arg is not None}
    for arg, out in aliases.items():
        if arg_kind.get(arg) == "state" and out < len(outputs):
            outputs[out].state_of = arg
            if arg in splits and outputs[out].shape == fn.body.args[arg].type.shape:
                outputs[out].split = splits[arg]
    return outputs


class _Step:
    """The function :func:`import_stablehlo` traces: graph inputs in, the StableHLO function run by the
    :class:`~.emit.Emitter` on them (argument values rebuilt from the inputs), results out, state results
    written back into their inputs with ``copy_`` (what functionalized in-place cache updates look like)."""

    def __init__(self, module: Module, fn: Function, inputs: list[ImportedInput], outputs: list[ImportedOutput],
                 splits: dict[int, tuple[tuple[int, ...], tuple[int, ...]]], expert_args: dict[int, tuple],
                 consts: list[Op], tables: dict) -> None:
        self.module = module
        self.fn = fn
        self.inputs = inputs
        self.outputs = outputs
        self.splits = splits
        self.expert_args = expert_args
        self.consts = consts
        self.n_in = sum(1 for spec in inputs if spec.arg is not None)
        self.tables_of = {id(t.op): t for t in tables}
        self.table_keys = {id(t.op): key for t, key in tables.items()}

    def __call__(self, *tensors: torch.Tensor) -> tuple:
        """The graph's outputs for its inputs ``tensors`` (argument inputs, then constants, then rotary tables)."""
        n_in = self.n_in
        positions: dict[int, list[int]] = {}
        for pos, (t, spec) in enumerate(zip(tensors[:n_in], self.inputs[:n_in])):
            positions.setdefault(spec.arg, []).append(pos)
        args = self.arguments(tensors, positions)
        buffers = {id(c): t for c, t in zip(self.consts, tensors[n_in:])}
        em = Emitter(self.module, buffers)
        em.tables = {op_id: (key, self.tables_of[op_id], tensors[n_in + len(self.consts) + key[0]]) for op_id, key in
                     self.table_keys.items()}
        return self.results(em.run(self.fn, args), tensors, positions)

    def arguments(self, tensors: Sequence[torch.Tensor], positions: dict[int, list[int]]) -> list:
        """The function's argument values from the graph inputs (``positions``: argument -> its inputs): expert
        weights, stacked caches and transposed weights as the value types the emitter reads them through."""
        args: list = []
        for i in range(len(self.fn.body.args)):
            if i in self.expert_args:
                how = self.expert_args[i]
                source = i if how[0] != "up" else how[1]
                kind = {"gate_up": "gate", "up": "up", "down": "down"}[how[0]]
                args.append(ExpertWeight(tensors[positions[source][0]], kind))
                continue
            spec = self.inputs[positions[i][0]]
            if i in self.splits:
                sd, perm = self.splits[i]
                args.append(Stacked({self.inputs[p].part: tensors[p] for p in positions[i]}, spec.arg_shape, sd, perm))
            else:
                t = tensors[positions[i][0]]
                args.append(Transposed(t, spec.arg_shape) if spec.transpose else t)
        return args

    def results(self, values: Sequence[Any], tensors: Sequence[torch.Tensor],
                positions: dict[int, list[int]]) -> tuple:
        """The graph outputs from the function's results: a split state result as its parts, each state result
        copied into its input(s) unless it already is that tensor."""
        results: list[torch.Tensor] = []
        for r, out in zip(values, self.outputs):
            if out.split is not None:
                sd, perm = out.split
                for p, part in zip(positions[out.state_of], stacked.split_value(r, out.shape, sd, perm)):
                    if part is not tensors[p]:
                        tensors[p].copy_(part)
                    results.append(part)
                continue
            t = materialize(r)
            if out.state_of is not None and t is not tensors[positions[out.state_of][0]]:
                tensors[positions[out.state_of][0]].copy_(t)
            results.append(t)
        return tuple(results)
