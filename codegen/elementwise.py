"""The core's generic lowering: a piece of ATen ops (:mod:`.generic`) as one :class:`Elementwise` instruction, one NKI
instruction per op on the activations' own layout.

Two lowerings use it: the ``generic`` template (connected unmatched ops, ``fusegraph.generic`` matches) and
:func:`lower_body`, what a match whose template has no registered lowering becomes (a plugin pattern's traced
body: the tutorial's non-parametric LayerNorm runs in the megakernel without a line of NKI). :func:`body_refusal`
tells region formation beforehand whether a body can be lowered this way.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fusegraph.matching.activations import by_nki

from . import ir
from . import weights as W
from .emitters import Context, Emitted, inst_name, nbytes
from .errors import CodegenError
from .generic import (MATMULS, VIEWS, GOp, build_ops, elementwise_reason, matmul_operands, piece_of,
                      unsupported_reason, value_class, weight_of)
from .layout import Layout, PMAX
from .lowering import Lowerer, preserves_order
from .registry import register_body_lowering, register_lowering, service
from .render import nl_dtype
from .stream import Chunk, ChunkUse
from .tensor import TensorOp, lower_tensor_piece, tensor_piece_refusal

log = logging.getLogger(__name__)

_ALU = {"add": torch.add, "subtract": torch.sub, "multiply": torch.mul, "maximum": torch.maximum,
        "minimum": torch.minimum}


@dataclass
class Elementwise(ir.Instruction):
    """A generically lowered piece: ``ops`` (see :mod:`..generic`) over ``inputs``, producing ``outputs``.

    Local names in ``ops`` are program node ids; ``input_names``/``output_names`` tie them to kernel values.
    Input classes: ``full`` (activation), ``token`` (per-token scalar activation), ``feature`` (a weight vector).
    ``what``: what the kernel comment says it lowers (unmatched ops, or the pattern whose body it is).
    """

    opcode: ClassVar[str] = "generic"
    inputs: tuple[ir.Value, ...]
    input_names: tuple[str, ...]
    input_classes: tuple[str, ...]
    ops: tuple[Any, ...]
    outputs: tuple[ir.Value, ...]
    output_names: tuple[str, ...]
    what: str = "unmatched ops"
    output_fields: ClassVar[tuple[str, ...]] = ()

    def reads(self) -> list[ir.Value]:
        return list(self.inputs)

    def writes(self) -> list[ir.Value]:
        return list(self.outputs)

    def _full(self) -> list[ir.Value]:
        return [v for v, c in zip(self.inputs, self.input_classes) if c == "full"] + list(self.outputs)

    def constrain(self, c: ir.Constraints) -> None:
        c.same(*[v for v, cl in zip(self.inputs, self.input_classes) if cl == "full"], *self.outputs)

    def arg_specs(self, layouts: dict[str, Layout], add: ir.AddSpec) -> None:
        lay = layouts[self._full()[0].name]
        for v, c in zip(self.inputs, self.input_classes):
            if c == "feature":
                add(v, f"feature:{lay}", lambda t, lay=lay: W.per_feature(t.reshape(-1), lay))

    def constants(self, ctx: Context) -> dict[str, ir.Constant]:
        if any(o.op == "sum" for o in self.ops):
            return {"c_ones": ir.Constant(W.ones(PMAX), "ones")}
        return {}

    def emit(self, ctx: Context, i: int) -> Emitted:
        """One NKI instruction per op of the piece; full values are [P, FT, T] tiles, per-token scalars fp32 [P, T]
        tiles (identical on every partition, so they broadcast over features as per-partition operands)."""
        return _Emission(self, ctx, i).run()

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        T = self.outputs[0].shape[0]
        local: dict[str, torch.Tensor] = {}
        for v, name, cls in zip(self.inputs, self.input_names, self.input_classes):
            t = env[v.name]
            local[name] = t.reshape(T, -1) if cls == "full" else t.reshape(T, 1) if cls == "token" else t.reshape(-1)
        for op in self.ops:
            kind, _, fn = op.op.partition(":")
            src = [local[s] if isinstance(s, str) else s for s in op.srcs]
            if kind in ("copy", "cast"):
                out = src[0]
            elif kind == "act":
                out = by_nki(fn).fn(src[0].float())
            elif kind == "recip":
                out = torch.reciprocal(src[0].float())
            elif kind == "scalar":
                out = _ALU[fn](src[0].float(), torch.tensor(src[1]))
            elif kind == "sum":
                out = src[0].float().sum(-1, keepdim=True) * op.scale
            else:
                out = _ALU[fn](src[0].float(), src[1].float())
            local[op.dst] = out.to(op.dtype)
        for v, name in zip(self.outputs, self.output_names):
            env[v.name] = local[name].reshape(v.shape)


class _Emission:
    """The statements of one Elementwise instruction, rendered by ``generic.j2``."""

    def __init__(self, ins: Elementwise, ctx: Context, i: int) -> None:
        self.ins, self.ctx, self.i = ins, ctx, i
        full = ins._full()
        if not full:
            raise CodegenError("generic lowering needs at least one full activation")
        lay = ctx.layout(full[0])
        self.P, self.FT, self.T = lay.P, lay.FT, ctx.tokens
        self.base = ctx.var(ins.outputs[0]) if ins.outputs else f"g{i}"
        self.name = inst_name(ins)
        self.e = Emitted(psum_banks=1)
        self.steps: list[dict[str, Any]] = []
        self.counter = 0

    def step(self, kind: str, **kw: Any) -> None:
        self.steps.append(dict(kind=kind, **kw))

    def fresh(self, cls: str, dtype: torch.dtype) -> str:
        self.counter += 1
        var = f"{self.base}_t{self.counter}"
        shape = {"full": f"({self.P}, {self.FT}, {self.T})", "token": f"({self.P}, {self.T})",
                 "feature": f"({self.P}, {self.FT})"}[cls]
        self.step("alloc", var=var, shape=shape, dtype=nl_dtype(dtype), buffer="sbuf",
                  label=f"{self.name}.t{self.counter}")
        self.e.sbuf += {"full": self.FT * self.T, "token": self.T, "feature": self.FT}[cls] * nbytes(dtype)
        return var

    def run(self) -> Emitted:
        ins, ctx = self.ins, self.ctx
        tiles: dict[str, tuple[str, str]] = {}  # local name -> (expression, class)
        for v, name, cls in zip(ins.inputs, ins.input_names, ins.input_classes):
            if cls == "full":
                tiles[name] = (ctx.var(v), "full")
            elif cls == "feature":
                shape, dt = ctx.shape(v), ctx.kdtype(v)
                chunk = Chunk(shape=shape, dtype=nl_dtype(dt), src=ctx.var(v), name=f"{self.name}.{v.name}",
                              earliest=0, nbytes_per_partition=shape[-1] * nbytes(dt))
                self.e.pieces.append(ChunkUse(chunk, self.i))
                tiles[name] = (chunk.token, "feature")
            else:
                raise CodegenError(f"generic lowering: a per-{cls} input from outside the piece is not supported")
        n = 0
        for op in ins.ops:
            kind, _, fn = op.op.partition(":")
            if kind == "copy":
                tiles[op.dst] = tiles[op.srcs[0]]
                continue
            src = [tiles[s] if isinstance(s, str) else (repr(float(s)), "const") for s in op.srcs]
            out_dtype = torch.float32 if op.cls == "token" else op.dtype
            dst = self.fresh(op.cls, out_dtype)
            label = f"{self.name}.op{n}"
            n += 1
            self._op(kind, fn, op, dst, src, label)
            if op.cls == "token" and op.dtype != torch.float32:  # round like the eager op, keep fp32 for operands
                r = self.fresh("token", op.dtype)
                self.step("copy", dst=r, src=dst, label=label)
                self.step("copy", dst=dst, src=r, label=label)
            tiles[op.dst] = (dst, op.cls)
        for v, name in zip(ins.outputs, ins.output_names):
            expr_, cls = tiles[name]
            if cls != "full":
                raise CodegenError(f"generic lowering: output {name} is not a per-token, per-feature value")
            self.step("assign", var=ctx.var(v), expr=expr_)
        self.e.code("generic.j2", ops=", ".join(sorted({o.op for o in ins.ops})), module=ins.module, what=ins.what,
                    steps=self.steps)
        if any(o.op == "sum" for o in ins.ops) and "ones" not in ctx.consts:
            raise CodegenError("generic lowering: the ones constant is missing")
        return self.e

    def _op(self, kind: str, fn: str, op: GOp, dst: str, src: list[tuple[str, str]], label: str) -> None:
        if kind == "act":
            self.step("act", dst=dst, fn=fn, src=src[0][0], label=label)
        elif kind == "recip":
            self.step("recip", dst=dst, src=src[0][0], label=label)
        elif kind == "cast":
            self.step("copy", dst=dst, src=src[0][0], label=label)
        elif kind == "scalar":
            self.step("scalar", dst=dst, src=src[0][0], fn=fn, operand=src[1][0], label=label)
        elif kind == "sum":
            ps = f"{dst}_ps"
            self.step("alloc", var=ps, shape=f"({self.P}, {self.T})", dtype="nl.float32", buffer="psum",
                      label=f"{self.name}.ps")
            sq = self.fresh("full", torch.float32)  # matmul operands must pair fp32 with fp32
            self.step("copy", dst=sq, src=src[0][0], label=label)
            self.step("sum", dst=dst, ps=ps, src=sq, FT=self.FT, P=self.P, ones=self.ctx.consts["ones"],
                      scale=repr(float(op.scale)), label=label)
        elif kind == "alu":
            (a, ca), (b, cb) = src
            if ca == cb:
                self.step("alu", dst=dst, a=a, b=b, fn=fn, label=label)
            elif (ca, cb) in (("full", "token"), ("full", "feature"), ("feature", "token")):
                self.step(f"alu_{ca}_{cb}", dst=dst, a=a, b=b, fn=fn, T=self.T, label=label)
            else:
                raise CodegenError(f"generic lowering: {fn} of a {ca} and a {cb} value")
        else:
            raise CodegenError(f"generic lowering: unknown op {op.op}")


# ---- lowerings ----------------------------------------------------------------------------------------------
def _piece_plan(L: Lowerer, piece: Any) -> tuple[list[str], list[str], list[GOp]]:
    """The piece on the elementwise path, without touching the kernel: its inputs' classes and its op list;
    raises :class:`CodegenError` when a value is neither per token nor per feature."""
    # the piece's per-token feature count: from its first full-size value
    F = None
    for n in piece.outputs + piece.nodes:
        shape = L.node(n)["shape"]
        if shape and not isinstance(shape[0], tuple) and int(shape[0]) == L.T:
            f = L.features(n)
            F = f if F is None else max(F, f)
    if not F:
        raise CodegenError("generic lowering: no per-token value in the piece")
    names, classes = [], []
    for nid in piece.inputs:
        d = L.node(nid)
        cls = value_class(d["shape"], L.T, F)
        if not (cls == "full" or (cls == "feature" and d["kind"] == "input")):
            raise CodegenError(f"generic lowering: input {nid} of shape {d['shape']} is not an activation or weight vector")
        names.append(nid)
        classes.append(cls)
    ops = build_ops(L.G, piece, L.T, F, dict(zip(names, classes)))
    return names, classes, ops


def _lower_piece(L: Lowerer, m: Any, piece: Any, what: str,
                 planned: tuple[list[str], list[str], list[GOp]] | None = None) -> None:
    names, classes, ops = planned or _piece_plan(L, piece)
    inputs = [L.act(nid) if cls == "full" else L.hbm(nid) for nid, cls in zip(names, classes)]
    outs = [L.new_act(n, f"g_{L.node(n).get('name') or n}") for n in piece.outputs]
    L.emit(Elementwise(inputs=tuple(inputs), input_names=tuple(names), input_classes=tuple(classes), ops=tuple(ops),
                       outputs=tuple(outs), output_names=tuple(piece.outputs), what=what), m)


def _piece_check(m: Any, graph: Any, tokens: int | None) -> str | None:
    """Why neither generic path can lower the piece: the SBUF elementwise path when its ops and, with the step's
    token count known, its inputs and outputs fit it, else the tensor path (any shape, op by op)."""
    piece = m.params.get("piece")
    if piece is None or elementwise_refusal(graph, piece, tokens) is None:
        return None
    return tensor_piece_refusal(graph, piece)


def elementwise_refusal(graph: Any, piece: Any, tokens: int | None) -> str | None:
    """Why the SBUF elementwise path cannot take ``piece`` (its ops; with ``tokens`` known, its inputs and
    outputs: per-token activations and weight vectors only)."""
    for n in piece.nodes:
        why = elementwise_reason(graph, n)
        if why is not None:
            return why
    if tokens is None:
        return None
    why = _inputs_refusal(graph, piece, tokens)
    if why is not None:
        return why
    F = max((_per_token(graph.nodes[n].get("shape"), tokens) or 0 for n in piece.outputs + piece.nodes), default=0)
    for n in piece.outputs:
        if value_class(graph.nodes[n].get("shape"), tokens, F) != "full":
            return f"output {n} of shape {graph.nodes[n].get('shape')} is not a per-token activation"
    return None


def _per_token(shape: Any, tokens: int) -> int | None:
    if not (isinstance(shape, tuple) and shape and not isinstance(shape[0], tuple) and int(shape[0]) == tokens):
        return None
    n = 1
    for s in shape:
        n *= int(s)
    return n // tokens if n % tokens == 0 else None


def _inputs_refusal(graph: Any, piece: Any, tokens: int) -> str | None:
    F = None
    for n in piece.outputs + piece.nodes:
        shape = graph.nodes[n].get("shape")
        if isinstance(shape, tuple) and shape and not isinstance(shape[0], tuple) and int(shape[0]) == tokens:
            n_el = 1
            for s in shape:
                n_el *= int(s)
            if n_el % tokens == 0:
                F = max(F or 0, n_el // tokens)
    if not F:
        return "no per-token value in the piece"
    for nid in piece.inputs:
        d = graph.nodes[nid]
        cls = value_class(d.get("shape"), tokens, F)
        if not (cls == "full" or (cls == "feature" and d.get("kind") == "input")):
            return f"input {nid} of shape {d.get('shape')} is not an activation or weight vector"
    return None


@register_lowering("generic", check=_piece_check, instructions=[Elementwise, TensorOp])
def lower_generic(L: Lowerer, m: Any) -> None:
    """A ``fusegraph.generic`` match: connected unmatched ops (the piece travels in ``params["piece"]``), on the
    SBUF elementwise path where it fits, else on the tensor path."""
    piece = m.params["piece"]
    planned = None
    if elementwise_refusal(L.G, piece, L.T) is None:
        try:
            planned = _piece_plan(L, piece)
        except CodegenError as e:
            if tensor_piece_refusal(L.G, piece) is not None:
                raise
            log.debug("piece %s: not on the elementwise path (%s); the tensor path takes it", piece.nodes[0], e)
    if planned is not None:
        _lower_piece(L, m, piece, "unmatched ops", planned)
    else:
        lower_tensor_piece(L, m, piece)


@register_lowering("generic_host", host_side=True)
def lower_generic_host(L: Lowerer, m: Any) -> None:
    """A piece of step metadata (positions, masks; ``GenericPiece.host``): on the host before the kernel, like the
    host-side rotary-table and mask patterns; its results reach the kernel as per-step inputs."""
    L.host(m)


def body_nodes(m: Any, graph: Any) -> list[str]:
    """The ATen ops of a match's body (its nodes that are ops), in program order."""
    return sorted((n for n in m.nodes if graph.nodes[n].get("kind") == "op"), key=lambda n: graph.nodes[n]["order"])


def _units(graph: Any, nodes: list[str]) -> list[tuple[str, Any]]:
    """A body split into what it lowers to, in dependency order: ``("linear", mm node)`` for each matmul by a
    weight, ``("piece", GenericPiece)`` for each connected group of the other ops, ``("views", nodes)`` for groups
    of layout ops only (nothing to compute: the layouts implement them). Raises when the groups cannot be ordered
    (an elementwise group both feeds and reads one matmul)."""
    import networkx as nx

    mms = [n for n in nodes if graph.nodes[n]["op"] in MATMULS]
    transposes = {matmul_operands(graph, n)[1].node for n in mms}
    rest = [n for n in nodes if n not in set(mms) and n not in transposes]
    unit_of: dict[str, int] = {}
    units: list[tuple[str, Any]] = []
    for n in mms:
        unit_of[n] = len(units)
        units.append(("linear", n))
    for comp in sorted(nx.weakly_connected_components(graph.subgraph(rest)),
                       key=lambda c: min(graph.nodes[n]["order"] for n in c)):
        views_only = all(graph.nodes[n]["op"] in VIEWS for n in comp)
        for n in comp:
            unit_of[n] = len(units)
        units.append(("views", sorted(comp)) if views_only else ("piece", piece_of(graph, comp)))
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(units)))
    dag.add_edges_from((unit_of[u], unit_of[v]) for u in unit_of for v in graph.successors(u)
                       if v in unit_of and unit_of[u] != unit_of[v])
    try:
        order = list(nx.lexicographical_topological_sort(dag))
    except nx.NetworkXUnfeasible:
        raise CodegenError("the body's elementwise ops and matmuls cannot be ordered (a group both feeds and "
                           "reads one matmul)") from None
    return [units[i] for i in order]


def body_refusal(m: Any, graph: Any, tokens: int | None) -> str | None:
    """Why the match's body cannot be lowered generically (None: it can, as far as its ops and, when the step's
    tokens are known, its inputs tell)."""
    nodes = body_nodes(m, graph)
    if not nodes:
        return "the match has no ops"
    for n in nodes:
        why = unsupported_reason(graph, n, body=True)
        if why is not None:
            return why
    try:
        units = _units(graph, nodes)
    except CodegenError as e:
        return str(e)
    if tokens is None:
        return None
    for kind, unit in units:
        if kind == "piece":
            why = _inputs_refusal(graph, unit, tokens)
            if why is not None:
                return why
    return None


def body_tokens(m: Any, graph: Any) -> int | None:
    """How a match lowered from its body sizes the decode step: from its first activation input (not a weight,
    buffer or state), ``[B, 1, F]`` or ``[T, F]``; raises for a prefill step."""
    for node in m.inputs.values():
        d = graph.nodes[node]
        kind = str(getattr(d.get("input_kind"), "value", d.get("input_kind")))
        if d.get("kind") == "input" and kind in ("weight", "buffer", "state"):
            continue
        shape = d.get("shape")
        if not isinstance(shape, tuple) or len(shape) not in (2, 3) or isinstance(shape[0], tuple):
            continue
        if len(shape) == 3 and shape[1] != 1:
            raise CodegenError(f"a step over {shape[1]} positions is not a decode step (prefill runs eagerly)")
        return int(shape[0])
    return None


def lower_body(L: Lowerer, m: Any) -> None:
    """A match whose template has no lowering: its body's ATen ops as Elementwise instructions, and each matmul by
    a weight as a projection (the ``"projection"`` service an op provides: :func:`~.registry.provide`), in
    dependency order."""
    why = body_refusal(m, L.G, None)
    if why is not None:
        raise CodegenError(f"no lowering for template {m.pattern.template!r} of {m.pattern.name}, and its body "
                           f"cannot be lowered generically: {why}")
    for kind, unit in _units(L.G, body_nodes(m, L.G)):
        if kind == "piece":
            _lower_piece(L, m, unit, m.pattern.name)
        elif kind == "views":  # layout only: each view *is* the value it views (when it keeps the element order)
            for n in sorted(unit, key=lambda n: L.node(n)["order"]):
                refs = [a.node for a in L.node(n)["args"] if hasattr(a, "node")]
                if len(refs) == 1 and refs[0] in L.values and preserves_order(L.G, n, refs[0]):
                    L.values[n] = L.values[refs[0]]
        elif kind == "linear":
            x_ref, wt, bias = matmul_operands(L.G, unit)
            x = L.act(x_ref.node)
            w = L.hbm(weight_of(L.G, wt))
            b = L.hbm(bias.node) if bias is not None else None
            out = L.new_act(unit, L.label(m, unit.rsplit(".", 1)[-1]))
            if w.shape != (out.features, x.features):
                raise CodegenError(f"{unit}: weight {w.shape} does not map {x.features} -> {out.features} features")
            service("projection")(L, m, x=x, weight=w, out=out, bias=b)


register_body_lowering(lower_body, tokens=body_tokens, check=body_refusal)
