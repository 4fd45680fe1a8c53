"""Lower a generic piece on the tensor path: each ATen op of the piece, in program order, as a
:class:`~.instruction.TensorOp` over strided views (views themselves cost nothing).

Where values come from: a value another match of the region left in SBUF is spilled to scratch once
(:class:`~fusegraph.codegen.io.Spill`); a model weight is read as it is (its own kernel argument, never a layout
another op re-laid out); a state tensor is read and written in place; a value computed outside the kernel is a
per-step input; a value known when the kernel is built (``arange``, ``full``...) is a constant argument. Where
values go: every value the piece hands to the rest of the region is a whole buffer (materialized if it was a
strided view), which a pattern reads through :meth:`~fusegraph.codegen.lowering.Lowerer.act`, and a region
output is copied into its kernel output.
"""
from __future__ import annotations

from typing import Any

import torch

from fusegraph.matching.tensor_ops import CATEGORY, tensor_reason

from .. import ir
from ..bind import weight_for_use
from ..errors import CodegenError
from ..io import Spill
from ..lowering import Lowerer
from .instruction import EMITTERS, GUARDS, TensorOp, kernel_dtype
from .view import TRef, contiguous_strides, view_of, whole

V = ir.ValueKind
#: ops that are views on the tensor path although matching files them elsewhere (no data moves in a functional
#: graph: a clone nobody mutates is its source)
_AS_VIEW = {"aten.clone.default", "aten.contiguous.default"}
_SHARED = "tensor path"


def tensor_piece_refusal(graph: Any, piece: Any) -> str | None:
    """Why the tensor path cannot lower ``piece`` (None: it can, as far as its ops tell)."""
    for n in piece.nodes:
        why = tensor_reason(graph, n)
        if why is not None:
            return why
        op = graph.nodes[n]["op"]
        if CATEGORY.get(op) not in ("view", "const") and op not in EMITTERS and op not in _AS_VIEW:
            return f"{op} has no emitter on the tensor path"
    return None


#: view ops with several outputs (read through ``getitem``)
_MULTI_VIEWS = frozenset({"aten.split.Tensor", "aten.split_with_sizes.default", "aten.unbind.int"})


class TensorLowering:
    """The tensor path's state in one kernel (shared by every piece of the region: a view or buffer one piece
    made is found by the next)."""

    def __init__(self, L: Lowerer) -> None:
        self.L = L
        self.refs: dict[tuple[str, int | None], TRef] = {}
        self.flags: dict[str, ir.Value] = {}  # guard reason -> the kernel's flag of it

    @classmethod
    def of(cls, L: Lowerer) -> "TensorLowering":
        tl = L.shared.get(_SHARED)
        if tl is None:
            tl = L.shared[_SHARED] = cls(L)
        return tl

    # ---- values in -----------------------------------------------------------------------------------------
    def ref(self, nid: str, index: int | None = None) -> TRef:
        """The tensor-path view of program value ``nid`` (output ``index`` of a multi-output op)."""
        key = (nid, index)
        if key in self.refs:
            return self.refs[key]
        if index is not None:
            raise CodegenError(f"output {index} of {nid} is not a value the tensor path has")
        L = self.L
        nid = L.aliases.get(nid, nid)
        d = L.node(nid)
        if d.get("shape") is None:  # a runtime Python number (a symbolic size): a one-element per-step input
            dt = torch.float32 if d.get("dtype") in ("float32", "float64") else torch.int64
            ref = TRef(L.step_input(nid, (1,), dtype=dt, label=f"in_{d.get('name') or nid}"), (), (), 0)
            self.refs[key] = ref
            return ref
        shape = tuple(int(s) for s in d["shape"])
        v = L.values.get(nid)
        if v is not None and v.kind == V.ACT:
            ref = self._spill(nid, v)
        elif v is not None and v.kind in (V.TENSOR, V.STATE, V.WEIGHT, V.INPUT):
            ref = whole(v)
        elif d["kind"] == "input":
            ref = whole(self._argument(nid, d))
        elif _same_value(L.G, d) is not None and self._in_kernel(_same_value(L.G, d)):
            ref = self.ref(_same_value(L.G, d))  # a copy that equals its source: the source
        elif self._glue_view(nid, d):  # layout glue of the region over a kernel value: the same view here
            ref = self._getitem_ref(nid, d) if d.get("op") == "getitem" else self._view_ref(nid, d)
        else:  # computed outside the kernel (eagerly, before it): a per-step input in its own shape
            ref = whole(L.step_input(nid, shape or (1,), label=f"in_{d.get('name') or nid}"))
        if ref.shape != shape:
            ref = TRef(ref.value, shape, contiguous_strides(shape), ref.offset)
        self.refs[key] = ref
        return ref

    def _glue_view(self, nid: str, d: dict) -> bool:
        """A layout op of the region over a value the kernel has (not over a per-step input: the host computes a
        view of its own values, or a host-side piece that reads the view would wait for the kernel). A ``getitem``
        of a split / unbind of such a value is one too (the rope's ``k_pass, k_rot = torch.split(k, ...)``)."""
        op = d.get("op")
        if op == "getitem" and d.get("kind") == "op" and nid in getattr(self.L.region, "nodes", ()):
            src = d["args"][0] if d.get("args") else None
            sd = self.L.node(src.node) if hasattr(src, "node") else {}
            return (sd.get("op") in _MULTI_VIEWS and src.node in self.L.region.nodes and bool(sd.get("args"))
                    and hasattr(sd["args"][0], "node") and self._in_kernel(sd["args"][0].node))
        if not (d["kind"] == "op" and (CATEGORY.get(op) == "view" or op in _AS_VIEW) and op != "getitem"
                and nid in getattr(self.L.region, "nodes", ()) and bool(d.get("args"))
                and hasattr(d["args"][0], "node")):
            return False
        return self._in_kernel(d["args"][0].node)

    def _in_kernel(self, nid: str) -> bool:
        L = self.L
        nid = L.aliases.get(nid, nid)
        ref = self.refs.get((nid, None))
        if ref is not None:
            return ref.value.kind != V.INPUT
        v = L.values.get(nid)
        if v is not None:
            return v.kind != V.INPUT
        d = L.node(nid)
        if d["kind"] == "input":
            return str(getattr(d.get("input_kind"), "value", d.get("input_kind"))) in ("weight", "buffer", "state")
        same = _same_value(L.G, d)
        if same is not None:
            return self._in_kernel(same)
        return self._glue_view(nid, d)

    def _view_ref(self, nid: str, d: dict) -> TRef:
        src = self.ref(d["args"][0].node, getattr(d["args"][0], "index", None))
        args = [src] + [self.arg(a) for a in d["args"][1:]]
        made = view_of(d["op"], args, d["shape"]) if d["op"] not in _AS_VIEW else src
        if made is None:  # PyTorch would copy too (a reshape of a transposed value): materialize, then view
            args[0] = self._materialize(_GLUE, nid, src)
            made = view_of(d["op"], args, d["shape"])
        if made is None or isinstance(made, tuple):
            raise CodegenError(f"{nid}: {d['op']} of {src.shape} is not a view the tensor path makes here")
        self.L.kernel_nodes.add(nid)
        return made

    def _getitem_ref(self, nid: str, d: dict) -> TRef:
        """Output ``i`` of a split / unbind glue over a kernel value: every output's view made once."""
        src, idx = d["args"][0].node, d["args"][1]
        if (src, idx) not in self.refs:
            sd = self.L.node(src)
            base = self.ref(sd["args"][0].node, getattr(sd["args"][0], "index", None))
            made = view_of(sd["op"], [base] + [self.arg(a) for a in sd["args"][1:]], sd["shape"])
            if not isinstance(made, tuple):
                raise CodegenError(f"{src}: {sd['op']} of {base.shape} is not a split the tensor path makes here")
            for i, r in enumerate(made):
                self.refs[(src, i)] = r
            self.L.kernel_nodes.add(src)
        self.L.kernel_nodes.add(nid)
        return self.refs[(src, idx)]

    def _argument(self, nid: str, d: dict) -> ir.Value:
        kind = str(getattr(d.get("input_kind"), "value", d.get("input_kind")))
        if kind in ("weight", "buffer"):
            label = (d.get("module") or d.get("source") or nid).replace("model.layers.", "l").replace("model.", "")
            return weight_for_use(self.L, nid, "as-is", f"{label}_t")
        if kind == "state":
            if not d["shape"]:  # a 0-d counter: read as a one-element per-step input (kernel arguments have a dim)
                return self.L.step_input(nid, (1,), label=f"in_{d.get('name') or nid}")
            return self.L.hbm(nid)
        shape = tuple(int(s) for s in d["shape"])
        return self.L.step_input(nid, shape or (1,), label=f"in_{d.get('name') or nid}")

    def _spill(self, nid: str, act: ir.Value) -> TRef:
        L = self.L
        buf = ir.Value(L.unique(f"t_{act.name}"), V.TENSOR, tuple(act.shape), act.dtype, node=nid)
        L.instructions.append(Spill(x=act, dst=buf))
        return whole(buf)

    def arg(self, a: Any) -> Any:
        """An ATen argument with program references replaced by views."""
        if hasattr(a, "node"):
            return self.ref(a.node, getattr(a, "index", None))
        if isinstance(a, list):
            return [self.arg(x) for x in a]
        if isinstance(a, tuple):
            return tuple(self.arg(x) for x in a)
        return a

    # ---- ops -----------------------------------------------------------------------------------------------
    def lower(self, m: Any, piece: Any) -> None:
        """Every op of ``piece`` (part of match ``m``), then its outputs made whole for their readers."""
        G = self.L.G
        for n in sorted(piece.nodes, key=lambda n: G.nodes[n]["order"]):
            self.node(m, n)
        for n in piece.outputs:
            self.hand_over(m, n)
        self.L.kernel_nodes |= set(piece.nodes)  # views too: they are strided reads of kernel buffers

    def node(self, m: Any, n: str) -> None:
        d = self.L.node(n)
        op = d["op"]
        cat = CATEGORY.get(op)
        if op == "getitem":
            src, idx = d["args"][0], d["args"][1]
            self.refs[(n, None)] = self.ref(src.node, idx)
            return
        if op == "aten._to_copy.default" and d["dtype"] == self.L.node(d["args"][0].node).get("dtype"):
            self.refs[(n, None)] = self.ref(d["args"][0].node)
            return
        if cat == "view" or op in _AS_VIEW:
            self._view(m, n, d)
        elif cat == "const":
            self._const(m, n, d)
        elif op == "aten.copy_.default":
            self._state_write(m, n, d)
        elif d.get("writes_state"):  # an in-place op into state (index_copy_ of rows at runtime positions)
            self._state_op(m, n, d)
        else:
            self._compute(m, n, d)

    def _view(self, m: Any, n: str, d: dict) -> None:
        args = self.arg(list(d["args"]))
        shape = d["shape"]
        made = view_of(d["op"], args, shape) if d["op"] not in _AS_VIEW else args[0]
        if made is None:  # PyTorch would copy too (a reshape of a transposed value): materialize, then view
            src = self._materialize(m, n, args[0])
            made = view_of(d["op"], [src] + args[1:], shape)
            if made is None:
                raise CodegenError(f"{d['op']} of {args[0].shape} to {shape} is not a view of a contiguous value")
        if isinstance(made, tuple):
            for i, r in enumerate(made):
                self.refs[(n, i)] = r
        else:
            self.refs[(n, None)] = made

    def _const(self, m: Any, n: str, d: dict) -> None:
        value = _evaluate(self.L.G, d)
        dtype = value.dtype  # the logical type (bool, int64); the argument holds the kernel's (uint8, int32)
        shape = tuple(value.shape)
        value = value.to(kernel_dtype(dtype)).reshape(shape or (1,)).contiguous()  # kernel arguments have a dim
        # "ct_": never a pattern constant's key (norms and gates load "c_ones" on chip)
        out = ir.Value(self.L.unique(f"ct_{d.get('name') or n}"), V.TENSOR, tuple(value.shape), dtype, node=n)
        ins = TensorOp(op=d["op"], args=(), kwargs={}, outs=(whole(out),), target=d["target"], fresh=(False,),
                       const=value)
        self.L.emit(ins, _only(m, n))
        self.refs[(n, None)] = TRef(out, shape, contiguous_strides(shape), 0)

    def _compute(self, m: Any, n: str, d: dict) -> None:
        L = self.L
        shapes = d["shape"] if _multi(d) else (d["shape"],)
        dtypes = d["dtype"] if _multi(d) else (d["dtype"],)
        outs = []
        for k, (shape, dt) in enumerate(zip(shapes, dtypes)):
            shape = tuple(int(s) for s in shape)
            v = ir.Value(L.unique(f"t_{d.get('name') or n}" + (f"_{k}" if k else "")), V.TENSOR, shape,
                         getattr(torch, dt), node=n)
            outs.append(whole(v))
        ins = TensorOp(op=d["op"], args=tuple(self.arg(list(d["args"]))), kwargs=self.arg(dict(d["kwargs"])),
                       outs=tuple(outs), target=d["target"], fresh=(True,) * len(outs))
        self._guarded(ins)
        L.emit(ins, _only(m, n))
        if _multi(d):
            for k, o in enumerate(outs):
                self.refs[(n, k)] = o
        else:
            self.refs[(n, None)] = outs[0]

    def _state_write(self, m: Any, n: str, d: dict) -> None:
        L = self.L
        state = d.get("writes_state")
        if not state:
            raise CodegenError(f"{n}: copy_ into something other than a state tensor")
        dst = self.ref(d["args"][0].node)
        src = self.arg(d["args"][1])
        ins = TensorOp(op=d["op"], args=(dst, src), kwargs={}, outs=(dst,), target=d["target"], fresh=(False,))
        L.emit(ins, _only(m, n))
        sv = L.values[state] if state in L.values else L.hbm(state)
        L.state[sv.name] = state
        L.alias(n, state)
        self.refs[(n, None)] = dst

    def _state_op(self, m: Any, n: str, d: dict) -> None:
        """An in-place op (``index_copy_``, ``index_put_``...) writing state: its emitter writes the state tensor
        itself (``outs[0]`` is its view, not fresh), as ``copy_`` does."""
        L = self.L
        state = d["writes_state"]
        dst = self.ref(d["args"][0].node)
        ins = TensorOp(op=d["op"], args=tuple(self.arg(list(d["args"]))), kwargs=self.arg(dict(d["kwargs"])),
                       outs=(dst,), target=d["target"], fresh=(False,))
        self._guarded(ins)
        L.emit(ins, _only(m, n))
        sv = L.values[state] if state in L.values else L.hbm(state)
        L.state[sv.name] = state
        L.alias(n, state)
        self.refs[(n, None)] = dst

    def _guarded(self, ins: TensorOp) -> None:
        """Give ``ins`` the kernel's guard flag of its op's reason (the first op of a reason allocates it and has
        the lowering store it as a guard output)."""
        rule = GUARDS.get(ins.op)
        if rule is None:
            return
        flag = self.flags.get(rule.reason)
        ins.flag_first = flag is None
        if flag is None:
            flag = self.flags[rule.reason] = ir.Value(self.L.unique("tensor_guard"), V.ROUTING, (self.L.T, 1),
                                                      torch.float32)
            self.L.guard(flag, rule.reason)
        ins.flag = flag

    def _materialize(self, m: Any, n: str, ref: TRef) -> TRef:
        """``ref`` copied into a fresh contiguous buffer (a copy of any strided view)."""
        L = self.L
        v = ir.Value(L.unique(f"t_{ref.value.name}_c"), V.TENSOR, tuple(ref.shape), ref.dtype, node=n)
        out = whole(v)
        L.emit(TensorOp(op="aten.copy.default", args=(out, ref), kwargs={}, outs=(out,),
                        target=torch.ops.aten.copy.default, fresh=(True,)), _only(m, n))
        return out

    # ---- values out ----------------------------------------------------------------------------------------
    def store_output(self, n: str) -> ir.Value:
        """Region output ``n`` (a tensor-path value or a glue view of one) copied into its own kernel output."""
        L = self.L
        ref = self.ref(n)
        d = L.node(n)
        shape = tuple(int(s) for s in d["shape"])
        dst = ir.Value(L.unique(f"out_{d.get('name') or n}"), V.OUTPUT, shape or (1,),  # outputs have a dim
                       kernel_dtype(getattr(torch, d["dtype"])), node=n)
        out = TRef(dst, shape, contiguous_strides(shape), 0)
        L.emit(TensorOp(op="aten.copy.default", args=(out, ref), kwargs={}, outs=(out,),
                        target=torch.ops.aten.copy.default, fresh=(False,)), _only(_GLUE, n))
        return dst

    def hand_over(self, m: Any, n: str) -> None:
        """Piece output ``n``: a whole buffer in ``L.values`` (patterns read it through ``L.act``), and, when it
        leaves the region, copied into its kernel output."""
        L = self.L
        ref = self.refs.get((n, None))
        if ref is None:
            return  # a multi-output op read only through getitem (its items are handed over)
        if ref.value.kind == V.TENSOR and not ref.whole():
            ref = self._materialize(m, n, ref)
            self.refs[(n, None)] = ref
        if ref.value.kind == V.TENSOR:
            L.values[n] = ref.value
        if n in {b.node for b in L.region.outputs} and n not in L.stored_outputs and ref.value.kind != V.STATE:
            L.store_output(n, self.store_output(n))


class _One:
    """A match restricted to one of its nodes (each TensorOp implements one program node)."""

    def __init__(self, m: Any, n: str) -> None:
        self.layer, self.module, self.pattern, self.nodes = m.layer, m.module, m.pattern, frozenset({n})


class _Glue:
    """What a copy made for region glue (a view PyTorch would copy, a region output) is attributed to."""

    layer = None
    module = None
    pattern = type("GluePattern", (), {"name": "fusegraph.generic"})()


_GLUE = _Glue()


def _only(m: Any, n: str) -> Any:
    return _One(m, n)


def _same_value(G: Any, d: dict) -> str | None:
    """The node a functional ``copy(dst, src)`` equals (same shape and dtype: no broadcast, no cast), as
    canonicalization folds it (HF's tensor-parallel row linears all-reduce in place: ``copy(out, reduced)``); or
    the one non-empty operand of a ``cat`` (GPT-J's partial rotary concatenates the rotated part with an empty
    pass-through slice)."""
    if d.get("op") == "aten.cat.default" and d.get("args") and isinstance(d["args"][0], (list, tuple)):
        full = [a for a in d["args"][0] if hasattr(a, "node") and
                any(int(x) == 0 for x in (G.nodes[a.node].get("shape") or (1,))) is False]
        if len(full) == 1 and G.nodes[full[0].node].get("shape") == d.get("shape") \
                and G.nodes[full[0].node].get("dtype") == d.get("dtype"):
            return full[0].node
        return None
    if d.get("op") != "aten.copy.default" or d.get("writes_state") or len(d.get("args", ())) != 2:
        return None
    src = d["args"][1]
    if not hasattr(src, "node"):
        return None
    s = G.nodes[src.node]
    return src.node if s.get("shape") == d.get("shape") and s.get("dtype") == d.get("dtype") else None


def _multi(d: dict) -> bool:
    shape = d.get("shape")
    return isinstance(shape, tuple) and bool(shape) and isinstance(shape[0], (tuple, list))


def _evaluate(G: Any, d: dict) -> torch.Tensor:
    """A constant op's value (its tensor arguments, e.g. ``zeros_like``'s, only give a shape and dtype)."""
    def sub(a: Any) -> Any:
        if hasattr(a, "node"):
            s = G.nodes[a.node]
            return torch.zeros(tuple(int(x) for x in s["shape"]), dtype=getattr(torch, s["dtype"]))
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a)
        return a
    kwargs = {k: v for k, v in sub(dict(d["kwargs"])).items() if k not in ("device", "pin_memory", "layout")}
    out = d["target"](*sub(tuple(d["args"])), **kwargs)
    if not isinstance(out, torch.Tensor):
        out = torch.tensor(out)
    if out.numel() > (1 << 24):
        raise CodegenError(f"a constant of {out.numel()} elements")
    return out.detach().cpu()


def kernel_view(L: Lowerer, nid: str) -> ir.Value | None:
    """Region glue ``nid`` (a view, a select of a fused QKV projection's output, a transpose) over a value the
    kernel has, as a whole tensor-path buffer (copied when the view is strided), for a pattern that reads it (the
    "tensor view" service :meth:`~fusegraph.codegen.lowering.Lowerer.act` asks for before taking a value as
    computed outside the kernel); None when ``nid`` is not such glue."""
    tl = TensorLowering.of(L)
    d = L.node(nid)
    if d.get("kind") != "op" or not tl._glue_view(nid, d):
        return None
    ref = tl.ref(nid)
    if ref.value.kind != V.TENSOR or not ref.whole():
        ref = tl._materialize(_GLUE, nid, ref)
    L.kernel_nodes.add(nid)
    return ref.value


def lower_tensor_piece(L: Lowerer, m: Any, piece: Any) -> None:
    """The tensor-path lowering of ``piece`` (see the module docstring)."""
    TensorLowering.of(L).lower(m, piece)


def store_tensor_output(L: Lowerer, nid: str) -> ir.Value:
    """Region output ``nid`` that is a tensor-path value (the "tensor output" service the region lowering asks
    for: it never imports the tensor path)."""
    return TensorLowering.of(L).store_output(nid)


__all__ = ["TensorLowering", "kernel_view", "lower_tensor_piece", "tensor_piece_refusal"]
