"""Trace a pattern function into a small networkx pattern graph, through the backend's own capture path.

The function runs under ``aot_autograd`` (functionalization, ``keep_inference_input_mutations=True``) exactly like
a captured step, and the ATen graph is added to a throw-away :class:`~fusegraph.program.Program` by the same
``add_graph`` (so ``cache.index_copy_`` becomes the same in-place state write), then canonicalized by the same
:func:`~.canonicalize.canonicalize`. Nothing here runs dynamo, so tracing also works while dynamo is compiling a
user's frame (the backend may analyze from inside its compile callback).

Constants in a traced graph are classified by tracing twice, A and B, with different example dim sizes, param
values and slot options:

* equal in A and B: a literal the program must have too (``pow(x, 2)``);
* equal to a param's value in both traces: that param (captured from the match, like Inductor's ``KeywordArg``);
* an integer that scales with the dims (``view(x, [T, 2*I])``): a shape expression, checked against the dims the
  match binds from its inputs' shapes (so ``slice(x, -1, 0, D/2)`` only matches a half split);
* a node whose op changed with the slot option: the slot.
"""
from __future__ import annotations

import itertools
import logging
import re
import threading
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Collection, Mapping

import networkx as nx
import torch

from ..capture.lower import to_aten
from ..program import Program
from ..program.build import DynamoInput, add_graph, node_id
from ..warnings import one_line
from .canonicalize import HAZARD, CanonicalView, canonicalize
from .pattern import Implementation, Input, Pattern, keyword_names

log = logging.getLogger(__name__)

_DEFAULT_DIMS = [6, 10, 14, 22, 26, 34, 38, 46]
_lock = threading.RLock()


class PatternTraceError(Exception):
    """A pattern function could not be traced into a usable pattern graph (the message says why)."""


@dataclass
class PatternNode:
    """Matching data of one traced pattern op."""

    name: str
    op: str | None  # None for a slot node
    positions: tuple[str, ...]
    dtype: Any
    lits: tuple[tuple[str, Any], ...]
    cpaths: frozenset[str]
    params: tuple[tuple[str, str], ...] = ()
    exprs: tuple[tuple[str, Fraction, tuple[str, ...]], ...] = ()
    slot: str | None = None
    shape: Any = None
    orig_op: str | None = None

    def describe(self) -> str:
        return f"{self.name} ({self.op or 'slot ' + str(self.slot)})"


@dataclass
class CompiledVariant:
    """One traced form of a pattern (implementation x case x dtype), ready for matching."""

    pattern: Pattern
    name: str
    dtype: str
    static: dict[str, Any]
    fixed_dims: dict[str, int]
    graph: nx.DiGraph  # op nodes only; node attr "p" = PatternNode, edge attr "pos"
    inputs: dict[str, list[tuple[str, frozenset]]]  # input name -> [(consumer pattern node, positions)]
    input_specs: dict[str, Input]
    input_dtypes: dict[str, Any]
    outputs: dict[str, str]  # output name -> pattern node
    slot_signatures: dict[str, dict[tuple, str]] = field(default_factory=dict)  # slot -> {(op, consts): option}
    takes_dtype: bool = False  # the implementation reads ``dtype`` (its output dtype); matches record it as a param
    ops: dict[tuple[str, Any], int] = field(default_factory=dict)  # (op, dtype) -> count, slots excluded
    connected: bool = True

    @property
    def size(self) -> int:
        return self.graph.number_of_nodes()

    def node(self, n: str) -> PatternNode:
        return self.graph.nodes[n]["p"]


def trace_program(fn: Callable[..., Any], args: list[torch.Tensor], names: list[str],
                  weights: frozenset[str] = frozenset()) -> tuple[Program, list[str]]:
    """Trace ``fn(*args)`` into a one-graph Program (as captured steps are traced); also return the output ids."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with torch._guards.tracing(None):  # patterns may be traced while dynamo compiles: not in its context
            gm = to_aten(fn, args, fake_mode=FakeTensorMode())
    except PatternTraceError:
        raise
    except Exception as e:
        raise PatternTraceError(f"tracing failed: {type(e).__name__}: {e}") from e
    prog = Program()
    inputs = [DynamoInput(source=n, is_tensor=True, is_parameter=n in weights) for n in names]
    captured = add_graph(prog, gm, 0, inputs)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs: list[str] = []
    flat = out_node.args[0] if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]
    for a in flat:
        if not isinstance(a, torch.fx.Node):
            raise PatternTraceError(f"pattern output {a!r} is not a tensor computed by the pattern")
        nid = node_id(0, a.name)
        if nid not in prog.graph and a.op == "call_function" and str(a.target) == "aten.copy_.default":
            dst = node_id(0, a.args[0].name)  # a state written in place: the value is the in-place writer's
            nid = captured.state_writes.get(dst, nid)
        outs.append(nid)
    return prog, outs


def _parse_dim(token: str, dims: Mapping[str, int]) -> int:
    if re.fullmatch(r"-?\d+", token):
        return int(token)
    value = 1
    for part in token.split("*"):
        part = part.strip()
        value *= int(part) if re.fullmatch(r"\d+", part) else dims[part]
    return value


def _symbols(inputs: tuple[Input, ...]) -> list[str]:
    out: list[str] = []
    for i in inputs:
        for tok in i.dims():
            for part in tok.split("*"):
                part = part.strip()
                if part and not re.fullmatch(r"-?\d+", part) and part not in out:
                    out.append(part)
    return out


def _example(inputs: tuple[Input, ...], dims: Mapping[str, int], dtype: str, device: str = "cpu") -> list[torch.Tensor]:
    out = []
    for i in inputs:
        shape = tuple(_parse_dim(t, dims) for t in i.dims())
        dt = getattr(torch, i.dtype or dtype)
        if dt.is_floating_point:
            out.append(torch.randn(shape, dtype=dt, device=device))
        elif dt == torch.bool:
            out.append(torch.ones(shape, dtype=dt, device=device))
        else:
            out.append(torch.zeros(shape, dtype=dt, device=device))
    return out


def _perturb(v: Any) -> Any:
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        return v + 1
    if isinstance(v, float):
        return v * 1.37 + 0.0123
    return v


_slot_cache: dict[tuple, tuple | None] = {}


def _slot_signature(option: Callable, dtype: str) -> tuple | None:
    """(op, consts) of a slot option traced alone; None if it is not exactly one op (cached per process)."""
    key = (option, dtype)
    if key not in _slot_cache:
        _slot_cache[key] = _trace_slot(option, dtype)
    return _slot_cache[key]


def _trace_slot(option: Callable, dtype: str) -> tuple | None:
    prog, _ = trace_program(lambda x: option(x), [torch.randn(4, dtype=getattr(torch, dtype))], ["x"])
    cv = canonicalize(prog)
    if len(cv.op_nodes) != 1:
        return None
    d = cv.data.nodes[cv.op_nodes[0]]
    return (d["op"], tuple(sorted(d["consts"].items())))


def _expr(va: int, vb: int, da: Mapping[str, int], db: Mapping[str, int]) -> tuple[Fraction, tuple[str, ...]] | None:
    """A (ratio, dims) such that ratio * prod(dims) gives va in trace A and vb in trace B."""
    syms = sorted(set(da) & set(db))
    found: list[tuple[Fraction, tuple[str, ...]]] = []
    for k in (1, 2):
        for combo in itertools.combinations_with_replacement(syms, k):
            pa = 1
            pb = 1
            for s in combo:
                pa *= da[s]
                pb *= db[s]
            if pa == pb or pa == 0 or pb == 0:
                continue
            ratio = Fraction(va, pa)
            if ratio != 0 and ratio.denominator <= 8 and ratio * pb == vb:
                found.append((ratio, combo))
        if found:
            break
    return found[0] if len(found) == 1 else None


def _compile_one(pattern: Pattern, impl: Implementation, case: Mapping[str, Any], dtype: str,
                 slot_sigs: dict[str, list[tuple | None]]) -> CompiledVariant:
    """One variant of ``pattern``: ``impl`` traced in ``dtype`` for ``case``, twice (A and B, see the module
    docstring), its constants classified by comparing the traces. ``slot_sigs`` holds each slot option's traced
    (op, consts). Raises :class:`PatternTraceError` when the two traces disagree in structure."""
    return _VariantTracer(pattern, impl, case, dtype, slot_sigs).compile()


class _VariantTracer:
    """The steps of :func:`_compile_one`: choose the two traces' example dims, params and slot options; trace both;
    pair their nodes; build the pattern graph (nodes, then edges) from trace A checked against trace B; name its
    outputs; package the :class:`CompiledVariant`."""

    def __init__(self, pattern: Pattern, impl: Implementation, case: Mapping[str, Any], dtype: str,
                 slot_sigs: dict[str, list[tuple | None]]) -> None:
        self.pattern = pattern
        self.impl = impl
        self.dtype = dtype
        self.slot_sigs = slot_sigs
        self.inputs = impl.inputs or pattern.inputs
        self.names = [i.name for i in self.inputs]
        self.accepted = keyword_names(impl.fn)
        self.device = str(case.get("_device", "cpu"))  # reserved case key: trace on another device (e.g. "meta")
        self.case = {k: v for k, v in case.items() if k != "_device"}
        self.dims_a, self.dims_b = self._example_dims(case)
        self.params_a, self.params_b, self.static = self._example_params()
        self.slots_a = {s: next(iter(slot.options.values())) for s, slot in pattern.slots.items()}
        self.slots_b = {s: list(slot.options.values())[1] for s, slot in pattern.slots.items()}

    def _example_dims(self, case: Mapping[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
        """Each symbolic dim's size in traces A and B: the pattern's ``dims`` spec (an int a gives a and 2a+2) or a
        default, distinct per dim so shape expressions can tell dims apart; a dim the case fixes is equal in both."""
        dims_a: dict[str, int] = {}
        dims_b: dict[str, int] = {}
        for k, s in enumerate(_symbols(self.inputs)):
            spec = self.pattern.dims.get(s, _DEFAULT_DIMS[k % len(_DEFAULT_DIMS)])
            a, b = (spec, 2 * spec + 2) if isinstance(spec, int) else spec
            if s in case:
                a = b = int(case[s])
            dims_a[s], dims_b[s] = a, b
        return dims_a, dims_b

    def _example_params(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """The params of traces A and B (B's perturbed, so a constant equal to a param is recognised as that param)
        and the static values: case keys that are not dims, fixed in both traces, and params the case sets."""
        pattern, case = self.pattern, self.case
        params_a = {k: v for k, v in pattern.params.items()}
        params_b = {k: _perturb(v) for k, v in pattern.params.items()}
        static: dict[str, Any] = {}
        for k, v in case.items():
            if k not in self.dims_a:
                params_a[k] = params_b[k] = v
                static[k] = v
        for k in pattern.params:
            if k in case:
                static[k] = case[k]
        return params_a, params_b, static

    def run(self, dims: dict[str, int], params: dict[str, Any],
            slots: dict[str, Callable]) -> tuple[CanonicalView, list[str]]:
        """Trace the implementation once on example inputs of ``dims``; its canonical view and output nodes."""
        kwargs = {**params, **slots, "dtype": getattr(torch, self.dtype)}
        if self.accepted is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self.accepted}
        args = _example(self.inputs, dims, self.dtype, self.device)
        weights = frozenset(i.name for i in self.inputs if i.kind == "weight")
        fn = self.impl.fn
        prog, outs = trace_program(lambda *a: fn(*a, **kwargs), args, self.names, weights)
        cv = canonicalize(prog)
        return cv, [cv.rep.get(o, o) for o in outs]

    def compile(self) -> CompiledVariant:
        """Trace A and B and build the variant from them, in the order the checks must run."""
        cv_a, outs_a = self.run(self.dims_a, self.params_a, self.slots_a)
        cv_b, outs_b = self.run(self.dims_b, self.params_b, self.slots_b)
        nodes_a, inputs_a, a2b = _pair_traces(cv_a, cv_b)
        P = nx.DiGraph()
        for na in nodes_a:
            pn = self.pattern_node(na, cv_a.data.nodes[na], cv_b.data.nodes[a2b[na]])
            P.add_node(pn.name, p=pn)
        pname = {n: n.split(".", 1)[1] for n in nodes_a}
        in_edges = self.add_edges(P, cv_a, cv_b, a2b, pname, dict(zip(inputs_a, self.names)))
        outputs = self.output_nodes(outs_a, pname)
        if P.number_of_nodes() == 0:
            raise PatternTraceError("the pattern traces to no ATen op")
        dtypes = {nm: cv_a.data.nodes[n]["dtype"] for nm, n in zip(self.names, inputs_a)}
        return self.variant(P, in_edges, outputs, dtypes)

    def slot_of(self, da: Mapping[str, Any], db: Mapping[str, Any]) -> str | None:
        """The slot a node fills: its op differs between the traces exactly as the slot's first two options do.
        None when the node is the same op in both; an op that changes otherwise is an error."""
        sig_a = (da["op"], tuple(sorted(da["consts"].items())))
        sig_b = (db["op"], tuple(sorted(db["consts"].items())))
        slot = None
        if sig_a != sig_b and da["op"] != db["op"]:
            for s in self.pattern.slots:
                sigs = self.slot_sigs[s]
                if len(sigs) > 1 and sig_a == sigs[0] and sig_b == sigs[1]:
                    slot = s
            if slot is None:
                raise PatternTraceError(f"op {da['orig_op']} becomes {db['orig_op']} with other example sizes/params")
        return slot

    def pattern_node(self, na: str, da: Mapping[str, Any], db: Mapping[str, Any]) -> PatternNode:
        """The pattern node of trace-A node ``na`` (data ``da``; ``db`` its trace-B twin): a slot node, or an op
        node with its constants split into literals, params and shape expressions."""
        if da["positions"] != db["positions"]:
            raise PatternTraceError(f"op {da['orig_op']} changes its tensor arguments with example sizes")
        slot = self.slot_of(da, db)
        name = na.split(".", 1)[1]
        if slot is not None:
            return PatternNode(name=name, op=None, positions=da["positions"], dtype=da["dtype"], lits=(),
                               cpaths=frozenset(), slot=slot, shape=da["shape"], orig_op=da["orig_op"])
        if set(da["consts"]) != set(db["consts"]):
            raise PatternTraceError(f"op {da['orig_op']} changes its constant arguments with example sizes")
        lits, params, exprs = [], [], []
        for path, va in sorted(da["consts"].items()):
            vb = db["consts"][path]
            kind = _classify(va, vb, self.params_a, self.params_b, self.dims_a, self.dims_b)
            if kind[0] == "lit":
                lits.append((path, va))
            elif kind[0] == "param":
                params.append((path, kind[1]))
            elif kind[0] == "expr":
                exprs.append((path, kind[1], kind[2]))
            else:
                log.debug("pattern %s: %s arg %s is shape-dependent (%r/%r); not checked", self.pattern.name,
                          da["orig_op"], path, va, vb)
        return PatternNode(name=name, op=da["op"], positions=da["positions"], dtype=da["dtype"], lits=tuple(lits),
                           cpaths=frozenset(da["consts"]), params=tuple(params), exprs=tuple(exprs),
                           shape=da["shape"], orig_op=da["orig_op"])

    def add_edges(self, P: nx.DiGraph, cv_a: CanonicalView, cv_b: CanonicalView, a2b: dict[str, str],
                  pname: dict[str, str], name_of: dict[str, str]) -> dict[str, list[tuple[str, frozenset]]]:
        """Add trace A's op-to-op edges to ``P``, each checked to be in trace B with the same positions. Edges from
        an input are not pattern edges: they are returned per input name (hazard edges dropped), what the matcher
        binds inputs by."""
        in_edges: dict[str, list[tuple[str, frozenset]]] = {nm: [] for nm in self.names}
        for u, v, e in cv_a.data.edges(data=True):
            ub, vb_ = a2b.get(u), a2b.get(v)
            du, dv = cv_a.data.nodes[u], cv_a.data.nodes[v]
            if dv["kind"] == "output":
                continue
            if (ub is None or vb_ is None or not cv_b.data.has_edge(ub, vb_)
                    or cv_b.data.edges[ub, vb_]["pos"] != e["pos"]):
                raise PatternTraceError("the traced graph's edges change with example sizes/params")
            if du["kind"] == "input":
                if e["pos"] != HAZARD:
                    in_edges[name_of[u]].append((pname[v], e["pos"]))
                continue
            P.add_edge(pname[u], pname[v], pos=e["pos"])
        return in_edges

    def output_nodes(self, outs_a: list[str], pname: dict[str, str]) -> dict[str, str]:
        """Output name -> the pattern node computing it; the function must return one computed tensor per
        declared output (an input passed through cannot be matched as an output)."""
        out_names = list(self.pattern.outputs)
        if len(outs_a) != len(out_names):
            raise PatternTraceError(f"the function returns {len(outs_a)} tensor(s) but outputs={out_names}")
        outputs: dict[str, str] = {}
        for oname, o in zip(out_names, outs_a):
            if o not in pname:
                raise PatternTraceError(f"output {oname!r} is not computed by the pattern (it is an input or a no-op "
                                        "of one)")
            outputs[oname] = pname[o]
        return outputs

    def variant(self, P: nx.DiGraph, in_edges: dict[str, list[tuple[str, frozenset]]], outputs: dict[str, str],
                dtypes: dict[str, Any]) -> CompiledVariant:
        """Package the variant: its name (implementation, case, dtype), the op census the matcher pre-filters
        programs with, and the slot signatures the matcher accepts slot ops by."""
        pattern, case = self.pattern, self.case
        ops: dict[tuple[str, Any], int] = {}
        for _, d in P.nodes(data=True):
            pn = d["p"]
            if pn.op is not None:
                ops[(pn.op, pn.dtype)] = ops.get((pn.op, pn.dtype), 0) + 1
        slot_sig_map = {s: {sig: opt for sig, opt in zip(self.slot_sigs[s], slot.options) if sig is not None}
                        for s, slot in pattern.slots.items()}
        cname = "".join(f",{k}={v}" for k, v in sorted(case.items()))
        vname = f"{self.impl.name}{'[' + cname[1:] + ']' if cname else ''}/{self.dtype}"
        return CompiledVariant(
            pattern=pattern, name=vname, dtype=self.dtype, static=self.static,
            fixed_dims={k: int(v) for k, v in case.items() if k in self.dims_a}, graph=P, inputs=in_edges,
            input_specs={i.name: i for i in self.inputs}, input_dtypes=dtypes, outputs=outputs,
            slot_signatures=slot_sig_map, ops=ops, connected=nx.is_weakly_connected(P),
            takes_dtype=self.accepted is None or "dtype" in self.accepted,
        )


def _pair_traces(cv_a: CanonicalView, cv_b: CanonicalView) -> tuple[list[str], list[str], dict[str, str]]:
    """Pair the nodes of traces A and B: op nodes in canonical order (the traces must have as many), inputs by
    position. Returns A's op nodes, A's inputs in position order and the A -> B map."""
    nodes_a, nodes_b = list(cv_a.op_nodes), list(cv_b.op_nodes)
    if len(nodes_a) != len(nodes_b):
        raise PatternTraceError(
            f"the traced graph changes with example sizes/params ({len(nodes_a)} vs {len(nodes_b)} ops); hold the "
            f"dims it depends on fixed with a case (cases=[{{'DIM': 1}}, ...])")
    a2b = dict(zip(nodes_a, nodes_b))
    inputs_a = sorted((n for n, d in cv_a.data.nodes(data=True) if d["kind"] == "input"),
                      key=lambda n: cv_a.program.graph.nodes[n]["position"])
    inputs_b = sorted((n for n, d in cv_b.data.nodes(data=True) if d["kind"] == "input"),
                      key=lambda n: cv_b.program.graph.nodes[n]["position"])
    a2b.update(zip(inputs_a, inputs_b))
    return nodes_a, inputs_a, a2b


def _classify(va: Any, vb: Any, pa: dict, pb: dict, da: dict, db: dict) -> tuple:
    if type(va) is type(vb) and va == vb:
        return ("lit",)
    for k in sorted(pa):
        if pa[k] != pb[k] and _same(pa[k], va) and _same(pb[k], vb):
            return ("param", k)
    if isinstance(va, int) and isinstance(vb, int) and not isinstance(va, bool):
        e = _expr(va, vb, da, db)
        if e is not None:
            return ("expr", e[0], e[1])
    return ("wild",)


def _same(p: Any, v: Any) -> bool:
    if isinstance(p, float) or isinstance(v, float):
        try:
            return abs(float(p) - float(v)) <= 1e-12 * max(1.0, abs(float(p)))
        except (TypeError, ValueError):
            return False
    return p == v


def compile_pattern(pattern: Pattern, cache_dir: str = "off",
                    dtypes: Collection[str] | None = None) -> list[CompiledVariant]:
    """Every variant of ``pattern``, or only those traced in ``dtypes`` (a program's float dtypes: an fp32 model
    never needs the bf16 and fp16 traces). Cached per dtype on the pattern, and on disk under ``cache_dir`` unless
    it is ``"off"`` (see :mod:`.pattern_cache`). Raises :class:`PatternTraceError` if it cannot be traced."""
    out: list[CompiledVariant] = []
    for dtype in pattern_dtypes(pattern):
        if dtypes is None or dtype in dtypes:
            out += _compile_dtype(pattern, cache_dir, dtype)
    return out


def pattern_dtypes(pattern: Pattern) -> list[str]:
    """The dtypes some implementation of ``pattern`` is traced in, in declaration order."""
    seen: list[str] = []
    for impl in pattern.implementations:
        for d in impl.dtypes or pattern.dtypes:
            if d not in seen:
                seen.append(d)
    return seen


def _compile_dtype(pattern: Pattern, cache_dir: str, dtype: str) -> list[CompiledVariant]:
    done = pattern._compiled or {}
    if dtype in done:
        return done[dtype]
    with _lock:
        done = pattern._compiled or {}
        if dtype in done:
            return done[dtype]
        from . import pattern_cache

        root = pattern_cache.cache_root(cache_dir)
        cache_key = pattern_cache.pattern_key(pattern) if root is not None else None
        if cache_key is not None:
            cache_key = f"{cache_key}-{dtype}"
            cached = pattern_cache.load(root, cache_key, pattern)
            if cached is not None:
                pattern._compiled = {**done, dtype: cached}
                return cached
        variants: list[CompiledVariant] = []
        seen: set = set()
        for s, slot in pattern.slots.items():
            if len(slot.options) < 2:
                raise PatternTraceError(f"slot {s!r} needs at least two options")
        for impl in pattern.implementations:
            if dtype not in (impl.dtypes or pattern.dtypes):
                continue
            slot_sigs = {s: [_slot_signature(o, dtype) for o in slot.options.values()]
                         for s, slot in pattern.slots.items()}
            for case in impl.cases or pattern.cases:
                try:
                    v = _compile_one(pattern, impl, case, dtype, slot_sigs)
                except PatternTraceError as e:
                    raise PatternTraceError(f"implementation {impl.name!r} ({dtype}, case {dict(case)}): {e}") from None
                except KeyboardInterrupt:
                    raise
                except BaseException as e:  # noqa: BLE001 - any tracing failure is a broken pattern
                    raise PatternTraceError(
                        f"implementation {impl.name!r} ({dtype}, case {dict(case)}) failed to trace: {one_line(e)}"
                    ) from e
                key = _structure_key(v)
                if key in seen:
                    continue
                seen.add(key)
                variants.append(v)
        pattern._compiled = {**done, dtype: variants}
        if root is not None and cache_key is not None:
            pattern_cache.store(root, cache_key, variants)
        return variants


def _structure_key(v: CompiledVariant) -> tuple:
    nodes = tuple(sorted((n, d["p"].op, d["p"].positions, str(d["p"].dtype), d["p"].lits, d["p"].params,
                          d["p"].slot) for n, d in v.graph.nodes(data=True)))
    edges = tuple(sorted((u, w, tuple(sorted(e["pos"]))) for u, w, e in v.graph.edges(data=True)))
    ins = tuple(sorted((k, tuple(sorted((c, tuple(sorted(p))) for c, p in es))) for k, es in v.inputs.items()))
    # input shapes too: one graph over differently shaped inputs (a mask shared by the batch) binds other dims
    shapes = tuple(sorted((k, i.shape) for k, i in v.input_specs.items()))
    return (nodes, edges, ins, tuple(sorted(v.static.items())), tuple(sorted(map(str, v.input_dtypes.values()))),
            shapes)
