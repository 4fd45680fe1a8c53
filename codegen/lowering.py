"""Lower a fused region (pattern matches over the program) to a :class:`~.ir.KernelProgram`.

Each match's template name selects a lowering from the registry (:mod:`.registry`); a template nobody lowers
is lowered generically from the match's own ATen ops. A lowering turns the match's bindings (program nodes)
into kernel values and instructions through the :class:`Lowerer` API. Values are created on first use: a
program input becomes a kernel argument (weight, state, per-step input), a value computed by an earlier match of
the region is the activation it left in SBUF, and anything else computed outside the kernel (by the eager
fallback: rotary cos/sin, the attention mask, cache positions) becomes a per-step input. Some lowerings are
*host-side* on purpose: computing the rotary tables or the mask on chip would cost range-reduced ``sin``/``cos``
or iota chains for tensors of a few hundred bytes, so they stay on the fallback path and feed the kernel as
inputs.

The result also says which program nodes the kernel implements (so the executor skips them) and how to fetch
every kernel argument from the step's values. A :class:`CodegenError` raised while lowering a match names it
(``error.match``), so the caller can retry without it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from fusegraph.warnings import one_line as _one_line

from . import ir
from .errors import CodegenError
from .io import Guard, Load, LoadRouting, Store
from .registry import body_lowering, lowering_for, service
from .schedule import kv_first

V = ir.ValueKind


@dataclass
class ArgSource:
    """Where a kernel argument comes from at run time: a program node's value, reshaped/cast for the kernel."""

    node: str
    shape: tuple[int, ...]  # kernel shape
    dtype: torch.dtype
    kind: str
    #: the op's host-side conversion of the node's value before it is shaped for the kernel (a module-level
    #: function or a ``functools.partial`` of one, so a plan pickles): a boolean mask to an additive one, a scale
    #: rounded to a table's dtype, a mask to each row's extent; ``None`` = the value as it is
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None
    #: row ranges of the node's tensor, concatenated (one part of a fused QKV weight; several ranges when the
    #: fused output is split per head, GPT-NeoX style)
    rows: tuple[tuple[int, int], ...] | None = None
    pad: tuple[int, float] | None = None  # (size, value): pad the last dim to ``size`` (partial-rotary cos/sin)

    def value(self, t: Any) -> Any:
        """The argument's logical value, given the program node's value."""
        if self.rows is None:
            return t
        if len(self.rows) == 1:
            return t[self.rows[0][0]:self.rows[0][1]]
        return torch.cat([t[a:b] for a, b in self.rows])


@dataclass
class Lowered:
    program: ir.KernelProgram
    kernel_nodes: frozenset[str]  # program nodes the kernel computes (skipped by the eager path)
    host_nodes: frozenset[str]  # region nodes left to the eager path (host-side patterns)
    args: dict[str, ArgSource]  # kernel argument name -> where its value comes from
    outputs: dict[str, str]  # kernel output value name -> program node it provides
    state: dict[str, str]  # state value name -> program input node (written in place)
    #: guard output value name -> why a set flag sends the step to the eager path (see :class:`~.ir.Guard`)
    guards: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _dtype(name: str | None) -> torch.dtype:
    if not isinstance(name, str):
        raise CodegenError(f"value without a tensor dtype ({name!r})")
    return getattr(torch, name)


def _ident(text: str) -> str:
    s = re.sub(r"[^0-9A-Za-z_]", "_", text)
    return s if s[:1].isalpha() else f"v_{s}"


_VIEW_OPS = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.transpose.int",
             "aten.permute.default", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.default",
             "aten.alias.default", "aten.clone.default", "aten.expand.default", "aten.t.default",
             "aten.contiguous.default", "aten._to_copy.default"}


def preserves_order(G: Any, node: str, src: str) -> bool:
    """Does ``node`` (a view op of ``src``) keep every element at the same row-major position? Checked by
    running the op on an index tensor: exact for any shape, and cheap for activation-sized tensors."""
    d, s = G.nodes[node], G.nodes[src]
    if d.get("shape") is None or s.get("shape") is None or d.get("dtype") != s.get("dtype"):
        return False
    n = 1
    for x in s["shape"]:
        n *= int(x)
    if n > 1 << 22:
        return False
    idx = torch.arange(n, dtype=torch.float32).reshape(s["shape"])

    def sub(a: Any) -> Any:
        if hasattr(a, "node"):
            return idx
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a)
        return a

    try:
        kwargs = {k: v for k, v in d["kwargs"].items() if k not in ("dtype", "device", "layout")}
        out = d["target"](*sub(tuple(d["args"])), **sub(kwargs))
    except Exception:
        return False
    return out.numel() == n and torch.equal(out.reshape(-1), idx.reshape(-1))


class Lowerer:
    """What a lowering function ``lower(L, match)`` works with: the region being lowered, its kernel values and
    instructions so far. Create values with :meth:`act` (an activation the match reads), :meth:`hbm` (a weight or
    state tensor), :meth:`step_input` (a small per-step tensor computed outside the kernel) and :meth:`new_act`
    (the match's result), then :meth:`emit` the instruction."""

    def __init__(self, program: Any, region: Any, tokens: int, name: str) -> None:
        self.prog = program
        self.G = program.graph
        self.region = region
        self.T = tokens
        self.name = name
        self.values: dict[str, ir.Value] = {}  # program node -> kernel value
        self.args: dict[str, ArgSource] = {}
        self.order: list[ir.Value] = []  # kernel arguments in signature order
        self.instructions: list[ir.Instruction] = []
        self.kernel_nodes: set[str] = set()
        self.host_nodes: set[str] = set()
        self.state: dict[str, str] = {}
        self.aliases: dict[str, str] = {}  # program node -> node whose kernel value it is (in-place writes)
        self.guards: list[tuple[ir.Value, str]] = []  # (flag, reason): stored as guard outputs at the end
        self.shared: dict[str, Any] = {}  # per-kernel state ops share (the routers' tie flag)
        #: region outputs a lowering stored itself (program node -> the kernel output value written)
        self.stored_outputs: dict[str, ir.Value] = {}
        self._on_chip: dict[str, ir.Value] = {}  # tensor-path buffer name -> its activation, loaded once
        self._matched_nodes: set[str] | None = None
        self._names: set[str] = set()

    # ---- reading a match ---------------------------------------------------------------------------------
    @staticmethod
    def input(m: Any, name: str) -> str:
        """The program node bound to the match's input ``name``."""
        try:
            return m.inputs[name]
        except KeyError:
            raise CodegenError(f"match of {m.pattern.name} has no input {name!r} (has {sorted(m.inputs)})") from None

    @staticmethod
    def views(m: Any, name: str) -> tuple[str, ...]:
        """No-op views canonicalization folded between input ``name``'s provider and the match."""
        return tuple(getattr(m, "input_views", {}).get(name, ()))

    @staticmethod
    def output(m: Any, name: str = "out") -> str:
        """The program node of the match's output ``name`` (or its only output)."""
        if name in m.outputs:
            return m.outputs[name]
        if len(m.outputs) == 1:
            return next(iter(m.outputs.values()))
        raise CodegenError(f"match of {m.pattern.name} has no output {name!r} (has {sorted(m.outputs)})")

    @staticmethod
    def label(m: Any, suffix: str = "") -> str:
        """A value-name stem for the match: its module path, shortened."""
        mod = (m.module or m.pattern.template).replace("model.layers.", "l").replace("model.", "")
        return mod + (f"_{suffix}" if suffix else "")

    @property
    def matched_nodes(self) -> set[str]:
        """Every program node some match of the region covers."""
        if self._matched_nodes is None:
            self._matched_nodes = set().union(*(m.nodes for m in self.region.matches))
        return self._matched_nodes

    # ---- values ------------------------------------------------------------------------------------------
    def unique(self, base: str) -> str:
        base = _ident(base)[:60]
        name, i = base, 1
        while name in self._names:
            i += 1
            name = f"{base}_{i}"
        self._names.add(name)
        return name

    _unique = unique

    def node(self, nid: str) -> dict:
        return self.G.nodes[nid]

    def features(self, nid: str) -> int:
        shape = self.node(nid)["shape"]
        n = 1
        for s in shape:
            n *= int(s)
        if n % self.T:
            raise CodegenError(f"value {nid} of shape {shape} is not per-token for {self.T} tokens")
        return n // self.T

    def _arg(self, nid: str, kind: str, shape: tuple[int, ...], dtype: torch.dtype, label: str) -> ir.Value:
        v = ir.Value(self.unique(label), kind, shape, dtype, node=nid)
        self.values[nid] = v
        self.order.append(v)
        self.args[v.name] = ArgSource(self._in_own_graph(nid), shape, dtype, kind)
        return v

    def _in_own_graph(self, nid: str) -> str:
        """Where the kernel's graph receives ``nid``: the node itself, or, for a value an earlier graph of the step
        produced (a region cut at a graph break, :func:`fusegraph.matching.carve.in_graph`), the input of this
        graph that the break's link feeds from it (matches see through links; the running graph has only its
        own inputs)."""
        graphs = getattr(self.region, "graphs", None) or []
        if len(graphs) != 1 or self.G.nodes[nid].get("graph", graphs[0]) == graphs[0]:
            return nid
        for s in self.G.successors(nid):
            d = self.G.nodes[s]
            if d.get("graph") == graphs[0] and d.get("kind") == "input":
                return s
        return nid

    def hbm(self, nid: str) -> ir.Value:
        """A graph input used as a kernel argument in its model shape (weights, state)."""
        nid = self.aliases.get(nid, nid)
        if nid in self.values:
            return self.values[nid]
        d = self.node(nid)
        if d["kind"] != "input":
            raise CodegenError(f"{nid} ({d.get('op')}) must be a model parameter or state tensor")
        kind = {"weight": V.WEIGHT, "buffer": V.WEIGHT, "state": V.STATE}.get(str(getattr(d["input_kind"], "value", d["input_kind"])))
        if kind is None:
            raise CodegenError(f"{nid} is a {d['input_kind']} input where a weight or state tensor is expected")
        label = (d.get("module") or d.get("source") or nid).replace("model.layers.", "l").replace("model.", "")
        return self._arg(nid, kind, tuple(int(s) for s in d["shape"]), _dtype(d["dtype"]), label)

    def hbm_rows(self, nid: str, rows: tuple[tuple[int, int], ...]) -> ir.Value:
        """Row ranges of a weight (or bias), concatenated, as their own kernel argument: the part of a fused QKV
        or gate_up projection that one consumer reads."""
        key = f"{nid}{list(rows)}"
        if key in self.values:
            return self.values[key]
        full = self.hbm(nid)
        if full.kind != V.WEIGHT:
            raise CodegenError(f"{nid} is not a weight; cannot take rows of it")
        n = sum(b - a for a, b in rows)
        v = ir.Value(self.unique(f"{full.name}_r{rows[0][0]}"), V.WEIGHT, (n, *full.shape[1:]), full.dtype, node=nid)
        self.values[key] = v
        self.order.append(v)
        self.args[v.name] = ArgSource(nid, v.shape, v.dtype, V.WEIGHT, rows=tuple(rows))
        return v

    def act(self, nid: str, views: tuple[str, ...] = ()) -> ir.Value:
        """The activation a match reads: produced in the kernel, or loaded from a value computed outside."""
        for cand in (nid, *reversed(views), *self._view_chain(nid)):
            cand = self.aliases.get(cand, cand)
            if cand in self.values:
                v = self.values[cand]
                return self._activation_of(cand, v) if v.kind in (V.TENSOR, V.STATE) else v
        view = service("tensor view")(self, nid)  # region glue over a kernel value (a fused QKV's select)
        if view is not None:
            self.values[nid] = view
            return self._activation_of(nid, view)
        d = self.node(nid)
        if d["kind"] == "input" and str(getattr(d.get("input_kind"), "value", d.get("input_kind"))) == "state":
            # state read as an activation (xLSTM's running max): loaded from the state argument itself, so an
            # in-place write of it later in the step writes the argument, not a copy of the loaded value
            return self._activation_of(nid, self.hbm(nid))
        F = self.features(nid)
        src = self._arg(nid, V.INPUT, (self.T, F), _dtype(d["dtype"]), f"in_{d.get('name') or nid}")
        out = ir.Value(self.unique(f"a_{d.get('name') or nid}"), V.ACT, (self.T, F), src.dtype, node=nid)
        self.instructions.append(Load(src=src, out=out))
        self.values[nid] = out
        return out

    def _activation_of(self, nid: str, v: ir.Value) -> ir.Value:
        """The SBUF activation of a tensor-path buffer (a whole ``[T, F]`` row-major value in the kernel's HBM
        scratch, :mod:`fusegraph.codegen.tensor`), loaded once for every pattern that reads it."""
        if v.name in self._on_chip:
            return self._on_chip[v.name]
        n = 1
        for s in v.shape:
            n *= int(s)
        if n % self.T:
            raise CodegenError(f"value {nid} of shape {tuple(v.shape)} is not per-token for {self.T} tokens")
        out = ir.Value(self.unique(f"a_{v.name}"), V.ACT, (self.T, n // self.T), v.dtype, node=nid)
        self.instructions.append(Load(src=v, out=out))
        self._on_chip[v.name] = out
        return out

    def routing(self, nid: str, views: tuple[str, ...] = (), dtype: torch.dtype | None = None) -> ir.Value:
        """A token-major ``[T, K]`` value (routing weights, expert ids) as a ROUTING tile: a router's own, or any
        value the kernel computed on the tensor path or received from outside, loaded once (MoE experts take
        their choices from whatever computes them)."""
        for cand in (nid, *reversed(views), *self._view_chain(nid)):
            v = self.values.get(self.aliases.get(cand, cand))
            if v is not None and v.kind == V.ROUTING:
                return v
        key = f"routing:{nid}"
        if key in self.values:
            return self.values[key]
        d = self.node(nid)
        n = 1
        for s in d["shape"]:
            n *= int(s)
        if n % self.T:
            raise CodegenError(f"routing value {nid} of shape {d['shape']} is not per-token for {self.T} tokens")
        src = self.values.get(self.aliases.get(nid, nid))
        if src is None or src.kind != V.TENSOR:
            src = self.step_input(nid, tuple(int(x) for x in d["shape"]))
        kdt = dtype or (torch.int32 if d["dtype"] in ("int64", "int32") else _dtype(d["dtype"]))
        out = ir.Value(self.unique(f"r_{d.get('name') or nid}"), V.ROUTING, (self.T, n // self.T), kdt, node=nid)
        self.instructions.append(LoadRouting(src=src, out=out))
        self.values[key] = out
        return out

    def store_output(self, nid: str, value: ir.Value) -> None:
        """Record that a lowering wrote region output ``nid`` to the kernel output ``value`` itself."""
        self.stored_outputs[nid] = value

    def _view_chain(self, nid: str) -> list[str]:
        """Producers reached back through layout-preserving view ops (transpose of a size-1 dim, reshape...)."""
        chain = []
        cur = nid
        while True:
            d = self.node(cur)
            if d.get("kind") != "op" or d.get("op") not in _VIEW_OPS:
                return chain
            refs = [a for a in d["args"] if hasattr(a, "node")]
            if len(refs) != 1 or not preserves_order(self.G, cur, refs[0].node):
                return chain
            cur = refs[0].node
            chain.append(cur)

    def step_input(self, nid: str, shape: tuple[int, ...], dtype: torch.dtype | None = None, label: str = "") -> ir.Value:
        """A small per-step tensor computed outside the kernel (cos/sin, mask, positions, token ids)."""
        if nid in self.values:
            return self.values[nid]
        d = self.node(nid)
        return self._arg(nid, V.INPUT, shape, dtype or _dtype(d["dtype"]), label or f"in_{d.get('name') or nid}")

    def new_act(self, nid: str, label: str, dtype: torch.dtype | None = None, kind: str = V.ACT,
                shape: tuple[int, ...] | None = None) -> ir.Value:
        """The kernel value of program node ``nid`` (a match's result), ``[T, F]`` unless ``shape`` says."""
        d = self.node(nid)
        v = ir.Value(self.unique(label), kind, shape or (self.T, self.features(nid)), dtype or _dtype(d["dtype"]),
                     node=nid)
        self.values[nid] = v
        return v

    def arg_source(self, v: ir.Value) -> ArgSource:
        """How kernel argument ``v`` is fetched at run time (set ``convert``/``pad`` on it)."""
        return self.args[v.name]

    # ---- results -----------------------------------------------------------------------------------------
    def emit(self, ins: ir.Instruction, m: Any) -> None:
        """Append ``ins`` as (part of) match ``m``'s lowering: the kernel computes the match's nodes."""
        ins.layer = m.layer
        ins.module = m.module
        ins.pattern = m.pattern.name
        ins.nodes = tuple(sorted(m.nodes))
        self.instructions.append(ins)
        self.kernel_nodes |= set(m.nodes)

    def host(self, m: Any) -> None:
        """Leave match ``m`` on the eager path: its results reach the kernel as per-step inputs."""
        self.host_nodes |= set(m.nodes)

    def guard(self, flag: ir.Value, reason: str) -> None:
        """Store ``flag`` ([T, 1] fp32, ROUTING) as a guard output: a set flag has the executor recompute the
        step eagerly (see :class:`~.io.Guard`)."""
        self.guards.append((flag, reason))

    def alias(self, node: str, to: str) -> None:
        """Program node ``node`` *is* ``to``'s kernel value (an in-place write returns the tensor it updated)."""
        self.aliases[node] = to


# ---- entry point -------------------------------------------------------------------------------------------
def lower_region(program: Any, region: Any, tokens: int, name: str = "fusegraph_step") -> Lowered:
    """Lower ``region`` (a matching Region) of ``program``; raise :class:`CodegenError` when it cannot be (with
    ``error.match`` set when one match is the cause)."""
    L = Lowerer(program, region, tokens, name)
    G = program.graph
    ordered = dependency_order(region.matches, G)
    for m in ordered:
        low = lowering_for(m.pattern.template)
        try:
            (low if low is not None else body_lowering()).lower(L, m)
        except CodegenError as e:
            if e.match is None:
                e.match = m
            raise
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - a lowering's bug (a plugin's SystemExit too) costs its match only
            err = CodegenError(f"the lowering of {m.pattern.template!r} raised {_one_line(e)}")
            err.match = m
            raise err from e
    if not L.instructions:
        raise CodegenError("region has nothing to run on chip")
    # glue (views, no-op casts) between kernel matches is implemented by the layouts
    glue = set(getattr(region, "glue_nodes", ())) - L.host_nodes
    L.kernel_nodes |= {g for g in glue if _only_feeds(L, g, L.kernel_nodes | glue)}
    # values the kernel reads from outside are computed on the eager path, even views inside the region
    L.kernel_nodes -= {src.node for src in L.args.values()}
    # ...and so is the glue those values are computed from (e.g. GLM's repeat_interleave of cos/sin)
    host_glue = {g for g in glue & L.kernel_nodes if not _only_feeds(L, g, L.kernel_nodes)}
    while host_glue:
        L.kernel_nodes -= host_glue
        host_glue = {g for g in glue & L.kernel_nodes if not _only_feeds(L, g, L.kernel_nodes)}
    outputs: dict[str, str] = {}
    out_values: list[ir.Value] = []
    for b in region.outputs:
        nid = b.node
        if nid in L.host_nodes or L.node(nid).get("kind") == "input":
            continue
        if nid in L.stored_outputs:  # written by its lowering (a tensor-path value of any shape)
            outputs[L.stored_outputs[nid].name] = nid
            out_values.append(L.stored_outputs[nid])
            continue
        v = L.values.get(L.aliases.get(nid, nid))
        if v is None:
            # a glue view of a kernel value is read outside: store what it views
            v = next((L.values[p] for p in L.G.predecessors(nid) if p in L.values), None)
        if v is None or v.kind == V.STATE:
            continue
        if v.kind == V.TENSOR:  # a tensor-path value (or a glue view of one) of any shape: its own copy out
            dst = service("tensor output")(L, nid)
            outputs[dst.name] = nid
            out_values.append(dst)
            continue
        if v.kind != V.ACT:
            raise CodegenError(f"region output {nid} ({v.kind}) cannot leave the kernel")
        dst = ir.Value(L.unique(f"out_{v.name}"), V.OUTPUT, (L.T, v.features), v.dtype, node=nid)
        L.instructions.append(Store(x=v, dst=dst))
        outputs[dst.name] = nid
        out_values.append(dst)
    if not outputs:
        raise CodegenError("region produces no value used after it")
    guards: dict[str, str] = {}
    for flag, reason in L.guards:
        dst = ir.Value(L.unique(f"out_{flag.name}"), V.OUTPUT, (L.T, 1), torch.float32)
        L.instructions.append(Guard(x=flag, dst=dst, reason=reason))
        guards[dst.name] = reason
        out_values.append(dst)
    state_values = [L.values[n] for n in L.state.values()]
    ir.assign_names(L.instructions)
    prog = ir.KernelProgram(name=name, tokens=tokens, instructions=kv_first(L.instructions), inputs=L.order,
                            outputs=out_values + state_values, meta={"region": getattr(region, "id", None)})
    return Lowered(program=prog, kernel_nodes=frozenset(L.kernel_nodes), host_nodes=frozenset(L.host_nodes),
                   args=dict(L.args), outputs=outputs, state=dict(L.state), guards=guards)


def dependency_order(matches: list[Any], G: Any) -> list[Any]:
    """Matches in an order where every match comes after each match it reads a value of; among those that are
    ready, the one whose last output comes first (program order). Why not that key alone: a match with an early
    and a late output (a projection feeding both a norm and, later, an attention variant's ops) would come after a
    match that reads its early output."""
    import networkx as nx

    def key(m: Any) -> int:
        return max((G.nodes[n]["order"] for n in m.outputs.values()), default=0)

    owner = {n: i for i, m in enumerate(matches) for n in m.nodes}
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(matches)))
    for i, m in enumerate(matches):
        # a match reads another's value directly or through unmatched ops between them (layout glue: the
        # transpose after an attention, the views of a fused QKV projection's split)
        seen: set[str] = set()
        todo = [p for n in m.nodes for p in G.predecessors(n) if p not in m.nodes]
        while todo:
            p = todo.pop()
            if p in seen:
                continue
            seen.add(p)
            j = owner.get(p)
            if j is None:
                if G.nodes[p].get("kind") == "op":
                    todo.extend(G.predecessors(p))
            elif j != i:
                dag.add_edge(j, i)
    try:
        order = list(nx.lexicographical_topological_sort(dag, key=lambda i: (key(matches[i]), i)))
    except nx.NetworkXUnfeasible:  # matches that read each other: the program-order key, as before
        return sorted(matches, key=key)
    return [matches[i] for i in order]


def _only_feeds(L: Lowerer, node: str, inside: set[str]) -> bool:
    d = L.node(node)
    if d.get("writes_state"):
        return False
    return all(s in inside for s in L.G.successors(node))
