"""Complex values as real pairs: every complex tensor of the program becomes a real tensor with a trailing dim of 2.

Trainium has no complex type, and neither has fusegraph's codegen. HF families that apply rotary embeddings with
complex numbers (``deepseek_v2``, ``llama4``: ``torch.polar`` of the positions' angles, ``view_as_complex`` of q
and k, a complex multiply, ``view_as_real``) used to be refused whole. This pass (:func:`rewrite_complex_pairs`, run
by :func:`~.build.add_graph` on each graph once its nodes are in the program and before its state writes become
in-place ops, the way :mod:`.state` rewrites those), gives every
complex value of shape ``S`` the real layout ``S + (2,)`` (real, imaginary last: exactly ``torch.view_as_real``'s),
and every op on complex values real ATen ops with the same result:

* ``view_as_complex`` / ``view_as_real``, ``resolve_conj`` / ``resolve_neg``: no op at all (the pair *is* the
  real view); the node disappears and its readers read the pair;
* views and data movement (``view``, ``unsqueeze``, ``transpose``, ``permute``, ``slice``, ``select``,
  ``expand``, ``split``, ``cat``, ``stack``, ``clone``, ``copy_``, ...): the same op on the pairs, its dims
  mapped to ``S``'s (negative dims made positive, so they never name the pair dim) and its sizes extended by the
  pair dim;
* complex ``mul``: ``(ac - bd, ad - b(-c))``, four real products rounded one by one, then two subtractions: the
  sequence of PyTorch's vectorized CPU complex multiply, so bit-for-bit its result. Its scalar loop (the elements
  past the last full group of 8 of an inner loop, on AVX2) contracts into fused multiply-adds, so there the last
  bit may differ; a rotary table's inner dim (half the rotary head dim) is a multiple of 8 in every model;
* ``mul`` / ``add`` / ``sub`` with a real tensor or number: the real factor scales both parts, the real term
  adds to the real part (PyTorch promotes the real operand to ``r + 0i``; for finite values the results are the
  same, up to the sign of a zero);
* ``polar(abs, angle)``: ``(abs * cos(angle), abs * sin(angle))``. ``aten.cos``/``aten.sin`` are not the
  functions ``torch.polar`` calls on CPU: they differ from it by at most one ulp (``tests/test_complex_pairs.py``
  measures it). In a decode step, polar makes the rotary table from the positions: the host computes it before
  the kernel (pattern ``fusegraph.rope_tables_pairs``; NKI's sin/cos activations are not valid for arbitrary
  angles), as it computes the other families' ``rope_tables``;
* ``_conj`` / ``conj_physical``: the imaginary part negated; ``abs``: ``hypot(re, im)`` (bit-for-bit PyTorch's
  complex abs); ``real`` / ``imag``: a ``select`` of the pair dim; ``neg``: the pairs negated; ``_to_copy``:
  to complex64 (the pairs copied), to a real dtype (the real part, as PyTorch does), from a real tensor (the imaginary
  part zero);
* ``_neg_view`` of pairs (how ``.imag`` of a conjugate reads): ``neg``.

Graph inputs and outputs that are complex keep their calling convention: the caller passes and gets complex
tensors. The program's input description says so (:attr:`ProgramInput.pairs_of`, :attr:`CapturedGraph.output_pairs`)
and :func:`pair_boundary` wraps a graph's runner once (whatever its executor) to pass ``torch.view_as_real`` of
each such input and return ``torch.view_as_complex`` of each such output; both are views, so an in-place write of
a complex state input lands in the caller's tensor.

An op on complex values this module has no pair form for (complex ``div``, ``sum``, ...) is named by
:func:`complex_refusal`, which the capture checks turn into a refusal (the graph runs eagerly, one warning), before
anything is added to the program.
"""
from __future__ import annotations

import functools
import itertools
import logging
import numbers
import operator
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .ir import CapturedGraph, InputKind, Program, ProgramInput, Ref

log = logging.getLogger(__name__)

#: the complex dtypes computed as pairs, and the dtype of their parts (complex128 would be fp64 pairs, which the
#: engines do not have; complex32 has almost no CPU kernels, so eager could not run such a step either)
PAIR_DTYPE: dict[str, str] = {"complex64": "float32"}

aten = torch.ops.aten

# ---- what each argument is -------------------------------------------------------------------------------------
#: argument kinds: a complex tensor, a real tensor, a real number, a complex number, a non-tensor node (a symbolic
#: int), any other constant
C, R, NUM, CNUM, SYM, CONST = "complex", "real", "number", "complex number", "symbolic", "constant"


def _const_kind(a: Any) -> str:
    if isinstance(a, complex):
        return CNUM
    if isinstance(a, numbers.Number):  # bools and ints included
        return NUM
    return CONST


def is_complex_dtype(dtype: Any) -> bool:
    """Whether a dtype (``torch.complex64`` or its program name ``"complex64"``) is a complex one."""
    return dtype is not None and str(dtype).replace("torch.", "").startswith("complex")


def _has_complex(dtype: Any) -> bool:
    """A node's dtype (a tuple for a multi-output op) has a complex one."""
    return any(is_complex_dtype(d) for d in dtype) if isinstance(dtype, tuple) else is_complex_dtype(dtype)


def _op_name(target: Any) -> str:
    return "getitem" if target is operator.getitem else str(target)


# ---- the ops and their pair forms -------------------------------------------------------------------------------
#: op -> how its dims/sizes map onto the pair layout: (argument name, mapping). ``dim``: an existing dim of S;
#: ``newdim``: a dim of the result S' = S with one more dim (unsqueeze, stack); ``dims``: a list of existing dims;
#: ``perm``: a permutation (the pair dim stays last); ``size``: a size list (the pair dim appended);
#: ``repeats``: repeat counts (1 appended)
SAME_ON_PAIRS: dict[str, tuple[tuple[str, str], ...]] = {
    "aten.view.default": (("size", "size"),),
    "aten._unsafe_view.default": (("size", "size"),),
    "aten.reshape.default": (("shape", "size"),),
    "aten.expand.default": (("size", "size"),),
    "aten.unsqueeze.default": (("dim", "newdim"),),
    "aten.squeeze.dim": (("dim", "dim"),),
    "aten.squeeze.dims": (("dim", "dims"),),
    "aten.squeeze.default": (),
    "aten.transpose.int": (("dim0", "dim"), ("dim1", "dim")),
    "aten.permute.default": (("dims", "perm"),),
    "aten.slice.Tensor": (("dim", "dim"),),
    "aten.select.int": (("dim", "dim"),),
    "aten.narrow.default": (("dim", "dim"),),
    "aten.split.Tensor": (("dim", "dim"),),
    "aten.split_with_sizes.default": (("dim", "dim"),),
    "aten.unbind.int": (("dim", "dim"),),
    "aten.repeat.default": (("repeats", "repeats"),),
    "aten.flip.default": (("dims", "dims"),),
    "aten.roll.default": (("dims", "dims"),),
    "aten.index_select.default": (("dim", "dim"),),
    "aten.index.Tensor": (),
    "aten.alias.default": (),
    "aten.clone.default": (),
    "aten.detach.default": (),
    "aten.contiguous.default": (),
    "aten.lift_fresh_copy.default": (),
    "getitem": (),
    "aten.neg.default": (),
    # several complex operands
    "aten.cat.default": (("dim", "dim"),),
    "aten.stack.default": (("dim", "newdim"),),
    "aten.copy.default": (),
    "aten.copy_.default": (),
    "aten.index_copy.default": (("dim", "dim"),),
    "aten.select_scatter.default": (("dim", "dim"),),
    "aten.slice_scatter.default": (("dim", "dim"),),
}
#: which arguments of those ops must be complex (the rest are real: indices), by name
_COMPLEX_ARGS: dict[str, tuple[str, ...]] = {
    "aten.cat.default": ("tensors",), "aten.stack.default": ("tensors",), "aten.copy.default": ("self", "src"),
    "aten.copy_.default": ("self", "src"), "aten.index_copy.default": ("self", "source"),
    "aten.select_scatter.default": ("self", "src"),
    "aten.slice_scatter.default": ("self", "src"),
}
#: ops that are the pairs themselves
NO_OPS = {"aten.view_as_complex.default", "aten.view_as_real.default", "aten.resolve_conj.default",
          "aten.resolve_neg.default"}
ARITHMETIC = {"aten.mul.Tensor", "aten.mul.Scalar", "aten.add.Tensor", "aten.add.Scalar", "aten.sub.Tensor",
              "aten.sub.Scalar"}
OTHER = {"aten.polar.default", "aten._conj.default", "aten.conj_physical.default", "aten._conj_physical.default",
         "aten.abs.default", "aten.real.default", "aten.imag.default", "aten._to_copy.default", "get_attr"}
#: every op with a pair form
SUPPORTED = set(SAME_ON_PAIRS) | NO_OPS | ARITHMETIC | OTHER


def _schema_names(target: Any) -> list[str]:
    schema = getattr(target, "_schema", None)
    return [a.name for a in schema.arguments] if schema is not None else []


def _named(target: Any, args: Sequence[Any], kwargs: dict) -> dict[str, Any]:
    """The op's arguments by schema name (positional and keyword; defaults left out)."""
    named = dict(zip(_schema_names(target), args))
    named.update(kwargs)
    return named


def _flat(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        return [y for e in x for y in _flat(e)]
    if isinstance(x, dict):
        return [y for e in x.values() for y in _flat(e)]
    return [x]


def _check(op: str, target: Any, args: Sequence[Any], kwargs: dict, kind: Callable[[Any], str],
           out_complex: bool) -> str | None:
    """Why the op (whose arguments ``kind`` classifies) has no pair form here; None when it has one."""
    if op not in SUPPORTED:
        return f"complex {op} has no real-pair form"
    named = _named(target, args, kwargs) if op != "getitem" else {"self": args[0]}
    kinds = {k: kind(v) if not isinstance(v, (list, tuple)) else [kind(x) for x in v] for k, v in named.items()}
    if any(k == SYM for k in _flat(kinds)):
        return f"complex {op} with a symbolic argument"
    if op in SAME_ON_PAIRS:
        must = _COMPLEX_ARGS.get(op, ("self",))
        if any(k != C for name in must for k in _flat(kinds.get(name, C))):
            return f"{op} mixing complex and real tensors"
        if not out_complex and op != "getitem":
            return f"{op} of a complex value to a real one"
        if op == "aten.roll.default" and not named.get("dims"):
            return f"{op} over the flattened tensor"
        if op == "aten.index.Tensor" and any(k == C for k in _flat(kinds.get("indices", []))):
            return f"{op} with complex indices"
        fmt = named.get("memory_format")
        if fmt not in (None, torch.contiguous_format, torch.preserve_format):
            return f"{op} to {fmt}"
        return None
    if op in ARITHMETIC:
        a, b = kinds.get("self"), kinds.get("other")
        if "alpha" in named and kinds["alpha"] != NUM:
            return f"{op} with a complex or tensor alpha"
        if a == R and b == CNUM and not op.startswith("aten.mul"):
            return f"{op} of a real tensor and a complex number"
        if C not in (a, b) and not (a == R and b == CNUM):
            return f"{op} of {a} and {b}"
        return None
    if op == "aten.polar.default":
        return None if kinds.get("abs") == R and kinds.get("angle") == R else f"{op} of complex operands"
    if op == "aten.view_as_complex.default":
        return None if kinds.get("self") == R else f"{op} of a complex tensor"
    if op == "aten._to_copy.default":
        dtype = named.get("dtype")
        if dtype is not None and is_complex_dtype(dtype) and str(dtype).replace("torch.", "") not in PAIR_DTYPE:
            return f"{op} to {dtype}"
        return None
    if op == "get_attr":
        return None
    return None if kinds.get("self") == C else f"{op} of a real tensor"


def complex_refusal(gm: fx.GraphModule) -> tuple[fx.Node, str] | None:
    """The first node of ATen graph ``gm`` whose complex values have no pair form here, with the reason; None when
    every complex value can be rewritten (or there is none). Read-only: called before anything is added to the
    program, so a refused graph leaves no trace in it."""
    def kind(a: Any) -> str:
        if isinstance(a, fx.Node):
            val = a.meta.get("val")
            vals = list(val) if isinstance(val, (list, tuple)) else [val]
            if not vals or not all(isinstance(v, torch.Tensor) for v in vals):
                return SYM
            return C if any(v.is_complex() for v in vals) else R
        return _const_kind(a)

    for n in gm.graph.nodes:
        vals = n.meta.get("val")
        vals = list(vals) if isinstance(vals, (list, tuple)) else [vals]
        dtypes = [str(v.dtype).replace("torch.", "") for v in vals if isinstance(v, torch.Tensor)]
        out_complex = any(is_complex_dtype(d) for d in dtypes)
        for d in dtypes:
            if is_complex_dtype(d) and d not in PAIR_DTYPE:
                return n, f"{d} values (only {', '.join(PAIR_DTYPE)} is computed as real pairs)"
        if n.op == "get_attr" and out_complex:
            continue
        if n.op != "call_function":
            continue
        reads_complex = any(kind(a) == C for a in n.all_input_nodes)
        if not (out_complex or reads_complex):
            continue
        reason = _check(_op_name(n.target), n.target, n.args, dict(n.kwargs), kind, out_complex)
        if reason is not None:
            return n, reason
    return None


# ---- the rewrite ------------------------------------------------------------------------------------------------
@dataclass
class _Operand:
    """One operand of complex arithmetic, as its real and imaginary parts (a Ref or a number; ``im`` None: zero)."""

    re: Any
    im: Any = None


class _PairRewriter:
    """Rewrites the complex values of one graph of a program in place (see the module docstring).

    Nodes are visited in FX order (a topological order). Which argument of a node is complex is read from the
    dtypes *before* the rewrite (a node's dtype changes when it becomes pairs, and a removed no-op's readers are
    redirected to the node it stood for). ``redirect`` maps each removed no-op to the node holding its value."""

    def __init__(self, program: Program, captured: CapturedGraph) -> None:
        self.program, self.captured, self.G, self.gi = program, captured, program.graph, captured.index
        self.nodes = sorted((n for n, d in self.G.nodes(data=True) if d["graph"] == self.gi),
                            key=lambda n: self.G.nodes[n]["fx_pos"])
        self.dtype0 = {n: self.G.nodes[n].get("dtype") for n in self.nodes}
        self.shape0 = {n: self.G.nodes[n].get("shape") for n in self.nodes}
        self.redirect: dict[str, Ref] = {}
        self.removed: list[str] = []
        self._ids = itertools.count()

    # ---- queries --------------------------------------------------------------------------------------------
    def was_complex(self, node: str, index: int | None = None) -> bool:
        dt = self.dtype0.get(node, self.G.nodes[node].get("dtype"))
        if isinstance(dt, tuple) and index is not None:
            return is_complex_dtype(dt[index])
        return _has_complex(dt)

    def kind(self, a: Any) -> str:
        if isinstance(a, Ref):
            if self.was_complex(a.node, a.index):
                return C
            return R if self.G.nodes[a.node].get("shape") is not None else SYM
        return _const_kind(a)

    def involved(self, n: str) -> bool:
        d = self.G.nodes[n]
        if d["kind"] != "op":
            return False
        if self.was_complex(n):
            return True
        refs = [a for a in _flat((d.get("args", ()), d.get("kwargs", {}))) if isinstance(a, Ref)]
        if any(self.was_complex(r.node, r.index) for r in refs):
            return True
        # ``.imag`` of a conjugate: the lazy negation of a pair
        return d["op"] == "aten._neg_view.default" and bool(refs) and \
            self.G.nodes[refs[0].node].get("op") == "aten.view_as_real.default"

    def cur(self, a: Any) -> Any:
        """``a`` with every Ref to a removed no-op replaced by the node holding its value."""
        if isinstance(a, Ref):
            while a.node in self.redirect:
                to = self.redirect[a.node]
                a = Ref(to.node, a.index if to.index is None else to.index)
            return a
        if isinstance(a, (list, tuple)):
            return type(a)(self.cur(x) for x in a)
        if isinstance(a, dict):
            return {k: self.cur(v) for k, v in a.items()}
        return a

    # ---- building nodes -------------------------------------------------------------------------------------
    def _meta_value(self, a: Any) -> Any:
        if isinstance(a, Ref):
            d = self.G.nodes[a.node]
            shape, dtype = d.get("shape"), d.get("dtype")
            if a.index is not None:
                shape, dtype = shape[a.index], dtype[a.index]
            if shape is None:
                raise ValueError(f"complex pairs: {a.node} is not a tensor")
            if shape and isinstance(shape[0], tuple):
                return [torch.empty(s, dtype=getattr(torch, t), device="meta") for s, t in zip(shape, dtype)]
            return torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
        if isinstance(a, (list, tuple)):
            return type(a)(self._meta_value(x) for x in a)
        if isinstance(a, dict):
            return {k: self._meta_value(v) for k, v in a.items()}
        return a

    def _meta(self, target: Any, args: Sequence[Any], kwargs: dict) -> tuple[Any, Any]:
        """(shape, dtype) of ``target(*args, **kwargs)``, computed on meta tensors."""
        kw = self._meta_value(kwargs)
        if "device" in kw:
            kw["device"] = torch.device("meta")
        val = target(*self._meta_value(list(args)), **kw)
        return _value_meta(val)

    def _place(self, nid: str, target: Any, args: Sequence[Any], kwargs: dict) -> None:
        G = self.G
        shape, dtype = self._meta(target, args, kwargs)
        consts = tuple(a for a in _flat((tuple(args), kwargs)) if not isinstance(a, Ref))
        G.nodes[nid].update(op=_op_name(target), target=target, args=tuple(args), kwargs=dict(kwargs), consts=consts,
                            shape=shape, dtype=dtype)
        for a in _flat((tuple(args), kwargs)):
            if isinstance(a, Ref):
                G.add_edge(a.node, nid)

    def emit(self, like: str, target: Any, *args: Any, **kwargs: Any) -> Ref:
        """A new op node computing ``target(*args, **kwargs)``, placed where ``like`` is (its module, layer, source
        line: it is part of that op's computation)."""
        d0 = self.G.nodes[like]
        nid = f"{like}__pair{next(self._ids)}"
        self.G.add_node(nid, kind="op", graph=self.gi, fx_pos=d0["fx_pos"], module=d0.get("module"),
                        module_type=d0.get("module_type"), layer=d0.get("layer"), source_line=d0.get("source_line"),
                        name=nid.split(".", 1)[-1], frame_path=d0.get("frame_path"), complex_op=self._origin(like))
        self._place(nid, target, args, kwargs)
        return Ref(nid)

    def _origin(self, n: str) -> str:
        d = self.G.nodes[n]
        return d.get("complex_op") or d["op"]

    def replace(self, n: str, target: Any, *args: Any, **kwargs: Any) -> None:
        """Node ``n`` now computes ``target(*args, **kwargs)`` (its readers read the new value)."""
        G = self.G
        G.nodes[n]["complex_op"] = self._origin(n)
        for p in list(G.predecessors(n)):
            if not G.edges[p, n].get("hazard"):
                G.remove_edge(p, n)
        self._place(n, target, args, kwargs)

    def alias(self, n: str, value: Ref) -> None:
        """Node ``n`` is a no-op on pairs: it goes, its readers read ``value``."""
        self.redirect[n] = value
        self.removed.append(n)

    # ---- pieces of complex arithmetic -----------------------------------------------------------------------
    def part(self, n: str, pair: Ref, i: int) -> Ref:
        return self.emit(n, aten.select.int, pair, -1, i)

    def operand(self, n: str, a: Any) -> _Operand:
        k = self.kind(a)
        if k == C:
            p = self.cur(a)
            return _Operand(self.part(n, p, 0), self.part(n, p, 1))
        if k == CNUM:
            return _Operand(a.real, a.imag)
        return _Operand(self.cur(a))

    def stack(self, n: str, re: Ref, im: Ref) -> None:
        """Node ``n`` becomes the pair of ``re`` and ``im`` (each broadcast to ``n``'s shape first)."""
        shape = list(self.shape0[n])
        parts = []
        for p in (re, im):
            if list(self.G.nodes[p.node]["shape"]) != shape:
                p = self.emit(n, aten.expand.default, p, shape)
            parts.append(p)
        self.replace(n, aten.stack.default, parts, -1)

    # ---- per op ---------------------------------------------------------------------------------------------
    def rewrite(self, n: str) -> None:
        d = self.G.nodes[n]
        op = d["op"]
        if op in NO_OPS:
            self.alias(n, self.cur(d["args"][0]))
        elif op in SAME_ON_PAIRS:
            self.same_on_pairs(n, d)
        elif op in ARITHMETIC:
            (self.multiply if op.startswith("aten.mul") else self.add)(n, d)
        elif op == "aten._neg_view.default":
            self.replace(n, aten.neg.default, self.cur(d["args"][0]))
        elif op == "get_attr":
            value = d["target"]()
            pairs = torch.view_as_real(value.resolve_conj()) if value.is_complex() else value
            G = self.G
            G.nodes[n].update(target=functools.partial(_value, pairs), complex_op="get_attr")
            G.nodes[n]["shape"], G.nodes[n]["dtype"] = _value_meta(pairs)
        else:
            getattr(self, "op_" + op.split(".")[1].lstrip("_"))(n, d)

    def same_on_pairs(self, n: str, d: dict) -> None:
        target, args, kwargs = d["target"], list(self.cur(d["args"])), dict(self.cur(d["kwargs"]))
        first = d["args"][0][0] if isinstance(d["args"][0], (list, tuple)) else d["args"][0]
        shape = self.shape0[first.node]
        if first.index is not None:
            shape = shape[first.index]
        rank = len(shape)
        names = _schema_names(target)
        for name, how in SAME_ON_PAIRS[d["op"]]:
            pos = names.index(name)
            if pos < len(args):
                args[pos] = _on_pairs(args[pos], how, rank)
            elif name in kwargs:
                kwargs[name] = _on_pairs(kwargs[name], how, rank)
        self.replace(n, target, *args, **kwargs)

    def multiply(self, n: str, d: dict) -> None:
        a, b = d["args"][0], d["args"][1]
        ka, kb = self.kind(a), self.kind(b)
        if ka != C and kb == C:
            a, b, ka, kb = b, a, kb, ka
        if ka == C and kb == C:
            x, y = self.operand(n, a), self.operand(n, b)
            self.stack(n, *self.product(n, x, y.re, y.im))
        elif ka == C and kb == R:  # a real tensor scales both parts
            self.replace(n, aten.mul.Tensor, self.cur(a), self.emit(n, aten.unsqueeze.default, self.cur(b), -1))
        elif ka == C and kb == NUM:
            self.replace(n, aten.mul.Tensor, self.cur(a), b)
        elif ka == C and kb == CNUM:
            x = self.operand(n, a)
            self.stack(n, *self.product(n, x, b.real, b.imag))
        else:  # a real tensor times a complex number
            self.stack(n, self.emit(n, aten.mul.Tensor, self.cur(a), b.real),
                       self.emit(n, aten.mul.Tensor, self.cur(a), b.imag))

    def product(self, n: str, x: _Operand, c: Any, d: Any) -> tuple[Ref, Ref]:
        """The parts of ``x * (c + di)`` as PyTorch's vectorized CPU kernel computes them: the products ``a*c``,
        ``b*d``, ``a*d`` and ``b*(-c)``, each rounded, then ``(ac - bd, ad - (-bc))`` (a subtraction of the negated
        product is the addition ``ad + bc`` exactly; written as one, the imaginary part is not an ``add`` of two
        same-shaped values, which the residual-add pattern would take apart from the rest of the product)."""
        neg_c = -c if isinstance(c, numbers.Number) else self.emit(n, aten.neg.default, c)
        re = self.emit(n, aten.sub.Tensor, self.emit(n, aten.mul.Tensor, x.re, c), self.emit(n, aten.mul.Tensor, x.im, d))
        im = self.emit(n, aten.sub.Tensor, self.emit(n, aten.mul.Tensor, x.re, d),
                       self.emit(n, aten.mul.Tensor, x.im, neg_c))
        return re, im

    def add(self, n: str, d: dict) -> None:
        """``self + alpha * other`` (``-`` for sub), with a real alpha."""
        target, op = d["target"], d["op"]
        named = _named(target, d["args"], d["kwargs"])
        a, b = named["self"], named["other"]
        ka, kb = self.kind(a), self.kind(b)
        alpha = {"alpha": named["alpha"]} if "alpha" in named else {}
        real_op = aten.sub.Tensor if op.startswith("aten.sub") else aten.add.Tensor
        if ka == C and kb == C:
            self.replace(n, target, self.cur(a), self.cur(b), **alpha)
            return
        x, y = self.operand(n, a), self.operand(n, b)
        re = self.emit(n, real_op, x.re, y.re, **alpha)
        if y.im is None:
            im = x.im
        elif x.im is None:  # a real tensor plus (minus) a complex one: the imaginary part is +-alpha * b.im
            scale = named.get("alpha", 1) * (-1 if real_op is aten.sub.Tensor else 1)
            im = self.emit(n, aten.neg.default, y.im) if scale == -1 else \
                y.im if scale == 1 else self.emit(n, aten.mul.Tensor, y.im, scale)
        else:
            im = self.emit(n, real_op, x.im, y.im, **alpha)
        self.stack(n, re, im)

    def op_polar(self, n: str, d: dict) -> None:
        named = _named(d["target"], d["args"], d["kwargs"])
        mag, angle = self.cur(named["abs"]), self.cur(named["angle"])
        self.stack(n, self.emit(n, aten.mul.Tensor, mag, self.emit(n, aten.cos.default, angle)),
                   self.emit(n, aten.mul.Tensor, mag, self.emit(n, aten.sin.default, angle)))

    def op_conj(self, n: str, d: dict) -> None:
        x = self.operand(n, d["args"][0])
        self.stack(n, x.re, self.emit(n, aten.neg.default, x.im))

    op_conj_physical = op_conj

    def op_abs(self, n: str, d: dict) -> None:
        x = self.operand(n, d["args"][0])
        self.replace(n, aten.hypot.default, x.re, x.im)

    def op_real(self, n: str, d: dict) -> None:
        self.replace(n, aten.select.int, self.cur(d["args"][0]), -1, 0)

    def op_imag(self, n: str, d: dict) -> None:
        self.replace(n, aten.select.int, self.cur(d["args"][0]), -1, 1)

    def op_to_copy(self, n: str, d: dict) -> None:
        x, kwargs = d["args"][0], dict(d["kwargs"])
        to_complex = self.was_complex(n)
        if to_complex:
            kwargs["dtype"] = getattr(torch, PAIR_DTYPE[str(self.dtype0[n])])
        if self.kind(x) == C and to_complex:
            self.replace(n, aten._to_copy.default, self.cur(x), **kwargs)
        elif self.kind(x) == C:  # to a real dtype: the real part, as PyTorch does (it warns that imag is dropped)
            self.replace(n, aten._to_copy.default, self.part(n, self.cur(x), 0), **kwargs)
        else:  # a real tensor made complex: imaginary part zero
            re = self.emit(n, aten._to_copy.default, self.cur(x), **kwargs)
            self.stack(n, re, self.emit(n, aten.zeros_like.default, re))

    # ---- the pass -------------------------------------------------------------------------------------------
    def run(self) -> int:
        G, captured = self.G, self.captured
        captured.output_pairs = {j: str(self.dtype0[o.node]) for j, o in enumerate(captured.outputs)
                                 if isinstance(o, Ref) and o.node in self.dtype0 and self.was_complex(o.node, o.index)}
        involved = [n for n in self.nodes if self.involved(n)]
        for n in involved:  # before anything changes (the capture checks refused such graphs already)
            d = G.nodes[n]
            if d["op"] in ("aten._neg_view.default", "get_attr"):
                continue
            reason = _check(d["op"], d["target"], d["args"], d["kwargs"], self.kind, self.was_complex(n))
            if reason is not None:
                raise ValueError(f"{n}: {reason}")
        for pin in captured.inputs:
            if is_complex_dtype(pin.dtype):
                _as_pair_input(G, pin)
        for n in involved:
            self.rewrite(n)
        self.check(involved)
        self.unlink_removed()
        return len(involved)

    def unlink_removed(self) -> None:
        """Readers of removed no-ops read the nodes holding their values; the no-ops leave the graph."""
        G, gone = self.G, set(self.removed)
        swap = self.cur
        for r in self.removed:
            to = swap(Ref(r)).node
            for s in list(G.successors(r)):
                if s in gone:
                    continue
                G.add_edge(to, s, **{k: v for k, v in G.edges[r, s].items()})
                for key in ("args", "kwargs"):
                    if key in G.nodes[s]:
                        G.nodes[s][key] = swap(G.nodes[s][key])
        self.captured.outputs = [swap(o) for o in self.captured.outputs]
        G.remove_nodes_from(self.removed)

    def check(self, involved: Sequence[str]) -> None:
        """Every rewritten node holds what it should: pairs of its complex shape, or its real value unchanged."""
        for n in involved:
            if n in self.redirect:
                continue
            d = self.G.nodes[n]
            want_shape, want_dtype = _pair_meta(self.shape0[n], self.dtype0[n])
            if d["shape"] != want_shape or d["dtype"] != want_dtype:
                raise RuntimeError(f"complex pairs: {n} ({d.get('complex_op')}) computes {d['shape']} {d['dtype']}, "
                                   f"not {want_shape} {want_dtype}")


def _on_pairs(value: Any, how: str, rank: int) -> Any:
    """One dim/size argument mapped from a complex tensor of rank ``rank`` to its pairs (see SAME_ON_PAIRS)."""
    if how == "dim":
        return value % rank if rank else 0
    if how == "newdim":
        return value % (rank + 1)
    if how == "dims":
        return [d % rank if rank else 0 for d in value] if isinstance(value, (list, tuple)) else \
            (value % rank if rank else 0)
    if how == "perm":
        return [d % rank for d in value] + [rank]
    if how == "size":
        return list(value) + [2]
    if how == "repeats":
        return list(value) + [1]
    raise ValueError(how)


def _pair_meta(shape: Any, dtype: Any) -> tuple[Any, Any]:
    """The (shape, dtype) a value of (shape, dtype) has after the rewrite (tuples for multi-output ops)."""
    if isinstance(dtype, tuple):
        metas = [_pair_meta(s, t) for s, t in zip(shape, dtype)]
        return tuple(m[0] for m in metas), tuple(m[1] for m in metas)
    if is_complex_dtype(dtype):
        return tuple(shape) + (2,), PAIR_DTYPE[str(dtype)]
    return shape, dtype


def _value_meta(val: Any) -> tuple[Any, Any]:
    if isinstance(val, torch.Tensor):
        return tuple(int(s) for s in val.shape), str(val.dtype).replace("torch.", "")
    if isinstance(val, (list, tuple)):
        metas = [_value_meta(v) for v in val]
        return tuple(m[0] for m in metas), tuple(m[1] for m in metas)
    return None, None


def _value(v: Any) -> Any:
    return v


def _as_pair_input(G: Any, pin: ProgramInput) -> None:
    """A complex graph input: the program takes its real pairs (:func:`pair_boundary` converts the caller's
    tensor); its node and description say so."""
    pin.pairs_of = str(pin.dtype)
    pin.shape, pin.dtype = _pair_meta(pin.shape, pin.dtype)
    G.nodes[pin.node].update(shape=pin.shape, dtype=pin.dtype, pairs_of=pin.pairs_of)


def rewrite_complex_pairs(program: Program, captured: CapturedGraph) -> int:
    """Rewrite the complex values of graph ``captured`` (its nodes just added to ``program``, before its state writes
    are converted: :func:`~.build.add_graph` calls this) into real pairs; returns the number of ops rewritten (0:
    the graph has no complex value and is left as it is). An op without a pair form raises ``ValueError`` before
    anything changes; the capture checks refuse such a graph first (:func:`complex_refusal`)."""
    gi = captured.index
    if not any(_has_complex(d.get("dtype")) for _, d in program.graph.nodes(data=True) if d["graph"] == gi):
        return 0  # the common case: one pass over the graph's nodes, nothing built
    rw = _PairRewriter(program, captured)
    count = rw.run()
    log.debug("graph %d: %d complex ops rewritten into real pairs (%d no-ops removed)", captured.index, count,
              len(rw.removed))
    return count


# ---- the calling convention -------------------------------------------------------------------------------------
def as_pairs(t: Any) -> Any:
    """The real pairs of a complex tensor (a view: writes into it write the complex tensor); anything else as is."""
    if isinstance(t, torch.Tensor) and t.is_complex():
        return torch.view_as_real(t.resolve_conj() if t.is_conj() else t)
    return t


def as_complex(t: Any) -> Any:
    """The complex tensor whose real pairs ``t`` is (a view when ``t``'s strides allow one, else of a copy)."""
    if not isinstance(t, torch.Tensor):
        return t
    ok = t.dim() >= 1 and t.shape[-1] == 2 and t.stride(-1) == 1 and t.storage_offset() % 2 == 0 and \
        all(s % 2 == 0 for s in t.stride()[:-1])
    return torch.view_as_complex(t if ok else t.contiguous())


class _PairViews:
    """The pairs view of each weight or buffer input, made once: the executors key a weight they staged in the
    kernel's layout by the tensor's identity (``executors/weight_keys.py``), and a fresh view every call would be
    re-staged every call. A view is made again when its tensor is another object or has other storage
    (``p.data = t``); in-place updates reach the view, which shares the storage and the version counter."""

    def __init__(self) -> None:
        self._views: dict[int, tuple[weakref.ref, tuple, torch.Tensor]] = {}

    def __call__(self, position: int, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.is_complex():
            return as_pairs(t)
        where = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.is_conj())
        hit = self._views.get(position)
        if hit is not None and hit[0]() is t and hit[1] == where:
            return hit[2]
        view = as_pairs(t)
        self._views[position] = (weakref.ref(t), where, view)
        return view


def pair_boundary(captured: CapturedGraph, runner: Callable[[Sequence[Any]], list]) -> Callable[[Sequence[Any]], list]:
    """``runner`` (which runs the rewritten graph on real pairs) called the way dynamo calls the graph: complex
    inputs are passed as their real pairs, complex outputs returned as complex tensors. A graph without complex
    inputs or outputs: ``runner`` itself."""
    inputs = [p.position for p in captured.inputs if p.pairs_of is not None]
    constant = {p.position for p in captured.inputs
                if p.pairs_of is not None and p.kind in (InputKind.WEIGHT, InputKind.BUFFER)}
    outputs = sorted(captured.output_pairs)
    if not inputs and not outputs:
        return runner
    views = _PairViews()

    def run(args: Sequence[Any]) -> list:
        args = list(args)
        for i in inputs:
            args[i] = views(i, args[i]) if i in constant else as_pairs(args[i])
        outs = list(runner(args))
        for j in outputs:
            outs[j] = as_complex(outs[j])
        return outs

    return run


__all__ = ["PAIR_DTYPE", "SUPPORTED", "as_complex", "as_pairs", "complex_refusal", "is_complex_dtype",
           "pair_boundary", "rewrite_complex_pairs"]
