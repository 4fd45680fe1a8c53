"""Lower a fused region (pattern matches over the program) to a :class:`~.ir.KernelProgram`.

Each match's template name selects a lowering rule that turns the match's bindings (program nodes) into kernel
values and one instruction. Values are created on first use: a program input becomes a kernel argument
(weight, state, per-step input), a value computed by an earlier match of the region is the activation it left
in SBUF, and anything else computed outside the kernel (by the eager fallback: rotary cos/sin, the attention
mask, cache positions) becomes a per-step input. Some patterns are *host-side* on purpose: computing the rotary
tables or the mask on chip would cost range-reduced ``sin``/``cos`` or iota chains for tensors of a few hundred
bytes, so they stay on the fallback path and feed the kernel as inputs.

The result also says which program nodes the kernel implements (so the executor skips them) and how to fetch
every kernel argument from the step's values.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import ir
from .errors import CodegenError

V = ir.ValueKind

#: templates whose matches stay on the eager path and feed the kernel as per-step inputs
HOST_SIDE = {"rope_tables", "causal_mask", "cache_position"}


@dataclass
class ArgSource:
    """Where a kernel argument comes from at run time: a program node's value, reshaped/cast for the kernel."""

    node: str
    shape: tuple[int, ...]  # kernel shape
    dtype: torch.dtype
    kind: str
    convert: str = ""  # "bool_mask": True = attend -> additive 0 / most-negative (SDPA's boolean masks)
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


_RULES: dict[str, Callable[["_Lowerer", Any], None]] = {}


def rule(*templates: str) -> Callable:
    def deco(fn: Callable) -> Callable:
        for t in templates:
            _RULES[t] = fn
        return fn

    return deco


def supported_templates() -> set[str]:
    return set(_RULES) | HOST_SIDE


def _dtype(name: str | None) -> torch.dtype:
    if not isinstance(name, str):
        raise CodegenError(f"value without a tensor dtype ({name!r})")
    return getattr(torch, name)


def _ident(text: str) -> str:
    s = re.sub(r"[^0-9A-Za-z_]", "_", text)
    return s if s[:1].isalpha() else f"v_{s}"


class _Lowerer:
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
        self.matched_nodes: set[str] | None = None  # every node some match of the region covers (lazily)
        self.router_tie: ir.Value | None = None  # the routers' shared tie flag (see ir.Router.tie)
        self._names: set[str] = set()

    # ---- values ------------------------------------------------------------------------------------------
    def _unique(self, base: str) -> str:
        base = _ident(base)[:60]
        name, i = base, 1
        while name in self._names:
            i += 1
            name = f"{base}_{i}"
        self._names.add(name)
        return name

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
        v = ir.Value(self._unique(label), kind, shape, dtype, node=nid)
        self.values[nid] = v
        self.order.append(v)
        self.args[v.name] = ArgSource(nid, shape, dtype, kind)
        return v

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
        v = ir.Value(self._unique(f"{full.name}_r{rows[0][0]}"), V.WEIGHT, (n, *full.shape[1:]), full.dtype, node=nid)
        self.values[key] = v
        self.order.append(v)
        self.args[v.name] = ArgSource(nid, v.shape, v.dtype, V.WEIGHT, rows=tuple(rows))
        return v

    def act(self, nid: str, views: tuple[str, ...] = ()) -> ir.Value:
        """The activation a match reads: produced in the kernel, or loaded from a value computed outside."""
        for cand in (nid, *reversed(views), *self._view_chain(nid)):
            cand = self.aliases.get(cand, cand)
            if cand in self.values:
                return self.values[cand]
        d = self.node(nid)
        F = self.features(nid)
        src = self._arg(nid, V.INPUT, (self.T, F), _dtype(d["dtype"]), f"in_{d.get('name') or nid}")
        out = ir.Value(self._unique(f"a_{d.get('name') or nid}"), V.ACT, (self.T, F), src.dtype, node=nid)
        self.instructions.append(ir.Load(src=src, out=out))
        self.values[nid] = out
        return out

    def _view_chain(self, nid: str) -> list[str]:
        """Producers reached back through layout-preserving view ops (transpose of a size-1 dim, reshape...)."""
        chain = []
        cur = nid
        while True:
            d = self.node(cur)
            if d.get("kind") != "op" or d.get("op") not in _VIEW_OPS:
                return chain
            refs = [a for a in d["args"] if hasattr(a, "node")]
            if len(refs) != 1 or not _preserves_order(self.G, cur, refs[0].node):
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
        d = self.node(nid)
        v = ir.Value(self._unique(label), kind, shape or (self.T, self.features(nid)), dtype or _dtype(d["dtype"]),
                     node=nid)
        self.values[nid] = v
        return v

    def emit(self, ins: ir.Instruction, m: Any) -> None:
        ins.layer = m.layer
        ins.module = m.module
        ins.pattern = m.pattern.name
        ins.nodes = tuple(sorted(m.nodes))
        self.instructions.append(ins)
        self.kernel_nodes |= set(m.nodes)


_VIEW_OPS = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.transpose.int",
             "aten.permute.default", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.default",
             "aten.alias.default", "aten.clone.default", "aten.expand.default", "aten.t.default",
             "aten.contiguous.default", "aten._to_copy.default"}


def _preserves_order(G: Any, node: str, src: str) -> bool:
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


def _in(m: Any, name: str) -> str:
    try:
        return m.inputs[name]
    except KeyError:
        raise CodegenError(f"match of {m.pattern.name} has no input {name!r} (has {sorted(m.inputs)})") from None


def _views(m: Any, name: str) -> tuple[str, ...]:
    return tuple(getattr(m, "input_views", {}).get(name, ()))


def _out(m: Any, name: str = "out") -> str:
    if name in m.outputs:
        return m.outputs[name]
    if len(m.outputs) == 1:
        return next(iter(m.outputs.values()))
    raise CodegenError(f"match of {m.pattern.name} has no output {name!r} (has {sorted(m.outputs)})")


def _label(m: Any, suffix: str = "") -> str:
    mod = (m.module or m.pattern.template).replace("model.layers.", "l").replace("model.", "")
    return mod + (f"_{suffix}" if suffix else "")


# ---- rules -------------------------------------------------------------------------------------------------
@rule("embedding")
def _embedding(L: _Lowerer, m: Any) -> None:
    ids = _in(m, "indices")
    table = L.hbm(_in(m, "weight"))
    idv = L.step_input(ids, (L.T,), torch.int32, "token_ids")
    scale = None
    if m.inputs.get("scale"):  # rounded to the table's dtype, as the model does, then read as fp32
        scale = L.step_input(m.inputs["scale"], (1,), torch.float32, "embed_scale")
        L.args[scale.name].convert = f"round_to:{table.dtype}".replace("torch.", "")
    out = L.new_act(_out(m), _label(m))
    L.emit(ir.Embed(ids=idv, table=table, out=out, scale=scale), m)


@rule("rmsnorm", "rmsnorm_offset")
def _rmsnorm(L: _Lowerer, m: Any) -> None:
    """Plain RMSNorm and the ``(offset + weight)`` form (Gemma); q/k-norms normalize each head (last dim)."""
    x_node = _in(m, "x")
    x = L.act(x_node, _views(m, "x"))
    w = L.hbm(_in(m, "weight")) if "weight" in m.inputs else None
    default_offset = 1.0 if m.pattern.template == "rmsnorm_offset" else 0.0
    out = L.new_act(_out(m), _label(m))
    L.emit(ir.RMSNorm(x=x, weight=w, out=out, eps=float(m.params.get("eps", 1e-6)),
                      group=int(L.node(x_node)["shape"][-1]),
                      weight_offset=float(m.params.get("offset", default_offset) or 0.0)), m)


@rule("layernorm")
def _layernorm(L: _Lowerer, m: Any) -> None:
    """LayerNorm over the hidden state (nn.LayerNorm with or without bias, Cohere's fp32 form)."""
    x_node = _in(m, "x")
    x = L.act(x_node, _views(m, "x"))
    group = int(L.node(x_node)["shape"][-1])
    if group != x.features:
        raise CodegenError(f"LayerNorm over {group} of {x.features} features (per-head LayerNorm) has no template")
    w = L.hbm(_in(m, "weight"))
    b = L.hbm(m.inputs["bias"]) if m.inputs.get("bias") else None
    out = L.new_act(_out(m), _label(m))
    L.emit(ir.RMSNorm(x=x, weight=w, out=out, eps=float(m.params.get("eps", 1e-5)), group=group, center=True,
                      bias=b), m)


@rule("sigmoid_gate")
def _sigmoid_gate(L: _Lowerer, m: Any) -> None:
    gate = L.act(_in(m, "gate"), _views(m, "gate"))
    x = L.act(_in(m, "x"), _views(m, "x"))
    if gate.features != 1:
        raise CodegenError(f"sigmoid gate with {gate.features} logits per token")
    out = L.new_act(_out(m), _label(m, "gate"))
    L.emit(ir.ScalarGate(gate=gate, x=x, out=out), m)


@rule("linear")
def _linear(L: _Lowerer, m: Any) -> None:
    x = L.act(_in(m, "x"), _views(m, "x"))
    pieces = _feature_pieces(L, _out(m))
    if pieces:  # fused QKV / gate_up read only through feature slices: one projection per slice
        w_node, b_node = _in(m, "weight"), m.inputs.get("bias")
        for node, rows in pieces:
            w = L.hbm_rows(w_node, rows)
            b = L.hbm_rows(b_node, rows) if b_node else None
            out = L.new_act(node, _label(m, f"f{rows[0][0]}"))
            L.emit(ir.Linear(x=x, weight=w, out=out, bias=b), m)
        return
    w = L.hbm(_in(m, "weight"))
    b = L.hbm(m.inputs["bias"]) if m.inputs.get("bias") else None
    out = L.new_act(_out(m), _label(m))
    if w.shape != (out.features, x.features):
        raise CodegenError(f"linear weight {w.shape} does not map {x.features} -> {out.features} features")
    L.emit(ir.Linear(x=x, weight=w, out=out, bias=b), m)


def _feature_pieces(L: _Lowerer, out: str) -> list[tuple[str, tuple[tuple[int, int], ...]]] | None:
    """``[(node, row ranges)]`` when every reader of a projection's output takes some of its features (HF fused
    projections: Phi-3's ``qkv[..., :q_size]``, ``gate_up.chunk(2, dim=-1)``, GPT-NeoX's per-head
    ``qkv.view(..., heads, 3 * head_dim).transpose(1, 2).chunk(3, dim=-1)``); else None.

    Each piece then becomes its own projection over those weight rows: the same bytes are read once, and no
    on-chip value has to be cut at a feature offset that is not a multiple of the partition count.
    """
    d = L.node(out)
    shape = d.get("shape")
    if not isinstance(shape, tuple) or len(shape) < 2:
        return None
    F = L.features(out)
    if shape[-1] != F:  # the match's output is already viewed per head ([..., heads, E]; views fold together)
        return _unmatched_pieces(L, _grouped_pieces(L, out, shape)) if shape[-2] * shape[-1] == F else None
    pieces: list[tuple[str, tuple[tuple[int, int], ...]]] = []
    for s in _data_succ(L, out):
        c = L.node(s)
        cshape = c.get("shape")
        if (c.get("op") in _RESHAPES and isinstance(cshape, tuple) and len(cshape) == len(shape) + 1
                and tuple(cshape[:len(shape) - 1]) == tuple(shape[:-1]) and cshape[-2] * cshape[-1] == F):
            grouped = _grouped_pieces(L, s, cshape)
            if grouped is None:
                return None
            pieces += grouped
            continue
        ranges = _last_dim_ranges(L, out, shape, only=s)
        if ranges is None:
            return None
        pieces += [(n, ((a, b),)) for n, (a, b) in ranges]
    return _unmatched_pieces(L, pieces)


def _unmatched_pieces(L: _Lowerer, pieces: list | None) -> list | None:
    """Pieces only when the slicing is layout glue: a slice some pattern matched (partial rotary's
    ``x[..., :R]``) needs the whole projection output as its input."""
    if not pieces or any(b <= a for _, rows in pieces for a, b in rows):
        return None
    if L.matched_nodes is None:
        L.matched_nodes = set().union(*(m.nodes for m in L.region.matches))
    return None if any(n in L.matched_nodes for n, _ in pieces) else pieces


def _grouped_pieces(L: _Lowerer, node: str, shape: tuple) -> list[tuple[str, tuple[tuple[int, int], ...]]] | None:
    """Pieces of a projection output viewed as ``[..., groups, E]`` and split along E: each piece's rows repeat
    per group (GPT-NeoX's per-head fused QKV)."""
    groups, E = shape[-2], shape[-1]
    src, sshape = node, shape
    while True:  # through transposes that keep the element order (decode: the sequence dim is 1)
        nxt = _data_succ(L, src)
        t = L.node(nxt[0]) if len(nxt) == 1 else {}
        if (t.get("op") not in ("aten.transpose.int", "aten.permute.default")
                or not isinstance(t.get("shape"), tuple) or t["shape"][-1] != E
                or not _preserves_order(L.G, nxt[0], src)):
            break
        src, sshape = nxt[0], t["shape"]
    inner = _last_dim_ranges(L, src, sshape)
    if not inner:
        return None
    return [(n, tuple((g * E + a, g * E + b) for g in range(groups))) for n, (a, b) in inner]


_RESHAPES = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"}


def _data_succ(L: _Lowerer, n: str) -> list[str]:
    return [s for s in L.G.successors(n) if not L.G.edges[n, s].get("hazard")]


def _last_dim_ranges(L: _Lowerer, src: str, shape: tuple,
                     only: str | None = None) -> list[tuple[str, tuple[int, int]]] | None:
    """The last-dim ranges the readers of ``src`` take (slices, split/chunk + getitem); None if a reader does
    anything else."""
    F, last = shape[-1], len(shape) - 1
    found: list[tuple[str, tuple[int, int]]] = []
    for s in ([only] if only else _data_succ(L, src)):
        c = L.node(s)
        op, args = c.get("op"), c.get("args", ())
        if op == "aten.slice.Tensor":
            dim = args[1] if len(args) > 1 else 0
            start = args[2] if len(args) > 2 and args[2] is not None else 0
            stop = args[3] if len(args) > 3 and args[3] is not None else F
            step = args[4] if len(args) > 4 else 1
            if dim % len(shape) != last or step != 1 or not isinstance(start, int) or not isinstance(stop, int):
                return None
            found.append((s, (max(0, start), min(stop, F))))
        elif op in ("aten.split.Tensor", "aten.split_with_sizes.default"):
            dim = args[2] if len(args) > 2 else 0
            if dim % len(shape) != last:
                return None
            sizes = list(args[1]) if op.endswith("sizes.default") else [args[1]] * -(-F // args[1])
            bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
            for g in _data_succ(L, s):
                gd = L.node(g)
                if gd.get("op") != "getitem":
                    return None
                i = gd["args"][1]
                found.append((g, (bounds[i], min(bounds[i + 1], F))))
        else:
            return None
    return found


@rule("rope", "rope_interleaved")
def _rope(L: _Lowerer, m: Any) -> None:
    x_node = _in(m, "x")
    x = L.act(x_node, _views(m, "x"))
    D = int(L.node(x_node)["shape"][-1])
    R = int(L.node(_in(m, "cos"))["shape"][-1])
    if R > D or R % 2:
        raise CodegenError(f"rotary dim {R} does not fit the head size {D}")
    # partial rotary: the kernel rotates whole heads with cos padded by 1 and sin by 0 past R (exact: x*1 + 0)
    cos = L.step_input(_in(m, "cos"), (L.T, D), label="rope_cos")
    sin = L.step_input(_in(m, "sin"), (L.T, D), label="rope_sin")
    if R < D:
        L.args[cos.name].pad = (D, 1.0)
        L.args[sin.name].pad = (D, 0.0)
    out = L.new_act(_out(m), _label(m, "rope"))
    L.emit(ir.Rope(x=x, cos=cos, sin=sin, out=out, head_dim=D, rotary_dim=R if R < D else 0,
                   interleaved=m.pattern.template == "rope_interleaved"), m)


@rule("kv_cache_update")
def _kv_update(L: _Lowerer, m: Any) -> None:
    cache_node = _in(m, "cache")
    cache = L.hbm(cache_node)
    value = L.act(_in(m, "value"), _views(m, "value"))
    idx_node = _in(m, "index")
    index = L.step_input(idx_node, (L.T,), torch.int32, "kv_position")
    L.emit(ir.KVWrite(cache=cache, value=value, index=index), m)
    L.state[cache.name] = cache_node
    for o in m.outputs.values():  # the updated cache *is* the state tensor
        L.aliases[o] = cache_node


@rule("decode_attention")
def _attention(L: _Lowerer, m: Any) -> None:
    q_node = _in(m, "q")
    q = L.act(q_node, _views(m, "q"))
    k = L.hbm(_in(m, "k"))
    v = L.hbm(_in(m, "v"))
    if k.kind != V.STATE:
        raise CodegenError("attention keys must be the KV cache updated by this step")
    B, Hkv, Lc, D = k.shape
    mask_node = m.inputs.get("mask")
    if not mask_node:
        raise CodegenError("decode attention without a mask input is not supported (the static cache needs one)")
    bool_mask = L.node(mask_node).get("dtype") == "bool"
    mask = L.step_input(mask_node, (L.T, Lc), torch.float32 if bool_mask else None, label="attn_mask")
    if bool_mask:
        L.args[mask.name].convert = "bool_mask"
    groups = int(m.params.get("num_key_value_groups") or m.params.get("groups") or (q.features // D) // Hkv)
    scale = float(m.params.get("scale", D ** -0.5))
    out = L.new_act(_out(m), _label(m, "attn"))
    rounding = "fused" if str(getattr(m, "variant", "")).startswith("sdpa") else "eager"
    L.emit(ir.Attention(q=q, k_cache=k, v_cache=v, mask=mask, out=out, scale=scale, groups=groups, rounding=rounding,
                        softcap=float(m.params.get("softcap") or 0.0)), m)


@rule("residual_add", "add")
def _add(L: _Lowerer, m: Any) -> None:
    a = L.act(_in(m, "a"), _views(m, "a"))
    b = L.act(_in(m, "b"), _views(m, "b"))
    out = L.new_act(_out(m), _label(m, "add"))
    L.emit(ir.Add(a=a, b=b, out=out), m)


@rule("swiglu", "gated_act", "gated_activation")
def _gated(L: _Lowerer, m: Any) -> None:
    gate = L.act(_in(m, "gate"), _views(m, "gate"))
    up = L.act(_in(m, "up"), _views(m, "up"))
    out = L.new_act(_out(m), _label(m, "act"))
    L.emit(ir.GatedAct(gate=gate, up=up, out=out, act=str(m.params.get("act", "silu"))), m)


@rule("moe_router")
def _router(L: _Lowerer, m: Any) -> None:
    x = L.act(_in(m, "x"), _views(m, "x"))
    w = L.hbm(_in(m, "weight"))
    top_k = int(m.params["top_k"])
    w_node = m.outputs.get("weights")
    i_node = m.outputs.get("indices")
    if not (w_node and i_node):
        raise CodegenError(f"router match must export weights and indices (has {sorted(m.outputs)})")
    wv = L.new_act(w_node, _label(m, "w"), kind=V.ROUTING, shape=(L.T, top_k))
    iv = L.new_act(i_node, _label(m, "idx"), dtype=torch.int32, kind=V.ROUTING, shape=(L.T, top_k))
    first = L.router_tie is None
    tie = None
    if w.shape[0] > top_k:  # with every expert chosen there is no boundary to tie at
        if first:
            L.router_tie = ir.Value(L._unique("router_tie"), V.ROUTING, (L.T, 1), torch.float32)
        tie = L.router_tie
    L.emit(ir.Router(x=x, weight=w, weights=wv, indices=iv, top_k=top_k, normalize=bool(m.params.get("normalize")),
                     tie=tie, tie_first=first and tie is not None), m)


@rule("moe_experts")
def _experts(L: _Lowerer, m: Any) -> None:
    x = L.act(_in(m, "x"), _views(m, "x"))
    wv = L.values.get(_in(m, "weights"))
    iv = L.values.get(_in(m, "indices"))
    for view in _views(m, "weights"):
        wv = wv or L.values.get(view)
    for view in _views(m, "indices"):
        iv = iv or L.values.get(view)
    if wv is None or iv is None:
        raise CodegenError("experts must consume the routing computed by a router in the same kernel")
    gu = L.hbm(_in(m, "gate_up_proj"))
    dn = L.hbm(_in(m, "down_proj"))
    out = L.new_act(_out(m), _label(m))
    L.emit(ir.Experts(x=x, weights=wv, indices=iv, gate_up=gu, down=dn, out=out, intermediate=gu.shape[1] // 2,
                      act=str(m.params.get("act", "silu"))), m)


@rule("generic")
def _generic(L: _Lowerer, m: Any) -> None:
    from .generic import build_ops, value_class

    piece = m.params["piece"]
    # the piece's per-token feature count: from its first full-size value
    F = None
    for n in piece.outputs + piece.nodes:
        shape = L.node(n)["shape"]
        if shape and int(shape[0]) == L.T:
            f = L.features(n)
            F = f if F is None else max(F, f)
    if not F:
        raise CodegenError("generic lowering: no per-token value in the piece")
    inputs, names, classes = [], [], []
    for nid in piece.inputs:
        d = L.node(nid)
        cls = value_class(d["shape"], L.T, F)
        if cls == "full":
            inputs.append(L.act(nid))
        elif cls == "feature" and d["kind"] == "input":
            inputs.append(L.hbm(nid))
        else:
            raise CodegenError(f"generic lowering: input {nid} of shape {d['shape']} is not an activation or weight vector")
        names.append(nid)
        classes.append(cls)
    ops = build_ops(L.G, piece, L.T, F, dict(zip(names, classes)))
    outs = [L.new_act(n, f"g_{L.node(n).get('name') or n}") for n in piece.outputs]
    L.emit(ir.Elementwise(inputs=tuple(inputs), input_names=tuple(names), input_classes=tuple(classes), ops=tuple(ops),
                          outputs=tuple(outs), output_names=tuple(piece.outputs)), m)


# ---- entry point -------------------------------------------------------------------------------------------
def lower_region(program: Any, region: Any, tokens: int, name: str = "fusegraph_step") -> Lowered:
    """Lower ``region`` (a matching Region) of ``program``; raise :class:`CodegenError` when it cannot be."""
    L = _Lowerer(program, region, tokens, name)
    G = program.graph
    # dependency order: a match's outputs come after the outputs of every match it reads from
    ordered = sorted(region.matches, key=lambda m: max((G.nodes[n]["order"] for n in m.outputs.values()), default=0))
    for m in ordered:
        if m.pattern.template in HOST_SIDE:
            L.host_nodes |= set(m.nodes)
            continue
        fn = _RULES.get(m.pattern.template)
        if fn is None:
            raise CodegenError(f"no NKI template for pattern {m.pattern.name} (template {m.pattern.template!r})")
        fn(L, m)
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
    for b in region.outputs:
        nid = b.node
        if nid in L.host_nodes or L.node(nid).get("kind") == "input":
            continue
        v = L.values.get(L.aliases.get(nid, nid))
        if v is None:
            # a glue view of a kernel value is read outside: store what it views
            v = next((L.values[p] for p in L.G.predecessors(nid) if p in L.values), None)
        if v is None or v.kind == V.STATE:
            continue
        if v.kind != V.ACT:
            raise CodegenError(f"region output {nid} ({v.kind}) cannot leave the kernel")
        dst = ir.Value(L._unique(f"out_{v.name}"), V.OUTPUT, (L.T, v.features), v.dtype, node=nid)
        L.instructions.append(ir.Store(x=v, dst=dst))
        outputs[dst.name] = nid
    if not outputs:
        raise CodegenError("region produces no value used after it")
    out_values = [next(i.dst for i in L.instructions if isinstance(i, ir.Store) and i.dst.name == n) for n in outputs]
    guards: dict[str, str] = {}
    if L.router_tie is not None:
        reason = ("MoE router: equal expert probabilities at the top-k boundary (torch.topk's choice between them "
                  "is implementation-defined)")
        dst = ir.Value(L._unique("out_router_tie"), V.OUTPUT, (L.T, 1), torch.float32)
        L.instructions.append(ir.Guard(x=L.router_tie, dst=dst, reason=reason))
        guards[dst.name] = reason
        out_values.append(dst)
    state_values = [L.values[n] for n in L.state.values()]
    prog = ir.KernelProgram(name=name, tokens=tokens, instructions=L.instructions, inputs=L.order,
                            outputs=out_values + state_values, meta={"region": getattr(region, "id", None)})
    return Lowered(program=prog, kernel_nodes=frozenset(L.kernel_nodes), host_nodes=frozenset(L.host_nodes),
                   args=dict(L.args), outputs=outputs, state=dict(L.state), guards=guards)


def _only_feeds(L: _Lowerer, node: str, inside: set[str]) -> bool:
    d = L.node(node)
    if d.get("writes_state"):
        return False
    return all(s in inside for s in L.G.successors(node))
