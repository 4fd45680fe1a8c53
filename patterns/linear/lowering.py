"""Linear (+ bias): weights stationary (128x128 blocks), tokens moving, PSUM accumulation over K chunks.

A fused projection whose output is only read through feature ranges (Phi-3's ``qkv[..., :q_size]``, ``gate_up``
chunks, GPT-NeoX's per-head QKV) becomes one projection per piece over those weight rows (``ArgSource.rows``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from fusegraph.codegen.api import (aten, ChunkUse, CodegenError, Context, Emitted, expr, inst_name, ir, Layout,
                                    linear_chunks, linear_pieces, Lowerer, nbytes, nl_dtype, preserves_order,
                                    provide, register_lowering, sb2sb_dma_engine, weight_for_use, weights as W,
                                    x_tokens)
from fusegraph.patterns.collectives.lowering import stored_gather_of, tail_key

from .pattern import linear


@dataclass
class Linear(ir.Instruction):
    """out = x @ W.T (+ b), W in HBM already laid out for the kernel (see :mod:`..weights`)."""

    opcode: ClassVar[str] = "linear"
    x: ir.Value
    weight: ir.Value
    out: ir.Value
    bias: ir.Value | None = None

    def arg_specs(self, layouts: dict[str, Layout], add: ir.AddSpec) -> None:
        li, lo = layouts[self.x.name], layouts[self.out.name]
        add(self.weight, f"linear:{li}:{lo}", lambda t, li=li, lo=lo: W.linear(t, li, lo))
        add(self.bias, f"bias:{lo}", lambda t, lo=lo: W.per_feature(t, lo), torch.float32)

    def emit(self, ctx: Context, i: int) -> Emitted:
        li, lo = ctx.layout(self.x), ctx.layout(self.out)
        T = ctx.tokens
        N, K = self.out.features, self.x.features
        dst = self._streamed_store(ctx, lo)
        if dst is not None:
            return self._emit_streamed(ctx, i, dst)
        e = Emitted()  # the output tile is an activation: the budget counts it while it is live, not as scratch
        name = inst_name(self)
        out = ctx.var(self.out)
        half = ctx.split(lo.FT)
        nt_here = half or lo.FT
        base = expr("exprs.j2", "core_base", half=half)
        e.code("linear_open.j2", module=self.module or "", aten=aten(self), N=N, K=K, out=out, Pn=lo.P, NT=lo.FT, T=T,
               dtype=nl_dtype(self.out.dtype), name=name,
               nchunks=len(linear_chunks(nt_here, li.FT * lo.P * nbytes(self.weight.dtype), ctx.chunk_bytes))
               * (2 if half else 1))
        w = ctx.var(self.weight)
        bias = None
        if self.bias is not None:
            # not a ring chunk: every weight chunk of this linear reads it, while the ring moves on
            shape, dt = ctx.shape(self.bias), ctx.kdtype(self.bias)
            bias = f"{out}_bias"
            e.code("dma_chunk.j2", var=bias, shape=shape, dtype=nl_dtype(dt), src=ctx.var(self.bias), name=f"{name}.b")
            e.sbuf += shape[-1] * nbytes(dt)

        def src(n0: int, n1: int) -> str:
            return expr("exprs.j2", "weight_chunks", w=w, n0=n0, n1=n1, base=base, half=half)

        linear_pieces(e, name=name, x=ctx.var(self.x), tok=":", out=out, w_hbm=w, w_src=src, Pk=li.P, KT=li.FT,
                      Pn=lo.P, NT=nt_here, T=T, wdtype=self.weight.dtype, chunk_bytes=ctx.chunk_bytes, earliest=0,
                      index=i, bias=bias, base=base)
        if half and self.out.name not in ctx.store_only:
            e.code("lnc_exchange.j2", what=f"{self.module or 'linear'} output chunks", x=out, half=half, name=name,
                   engine=sb2sb_dma_engine(lo.P, half * T, nbytes(self.out.dtype)))
        return e

    def _streamed_store(self, ctx: Context, lo: Layout) -> ir.Value | None:
        """The HBM output this projection stores chunk by chunk, or None to build its whole output in SBUF.

        A kernel output only stored (the logits) need not lie whole in SBUF: at a batch of 64 Llama-3-8B's
        logits are 125 KiB per partition, Qwen3's 148 KiB, more than the rest of the kernel. When the output
        tile exceeds one weight chunk's bytes, each weight chunk's output is evicted and stored at once.
        Only for a partition-major output (what a store prefers), without a bias (its columns are indexed by
        global chunk), not head-split, and not an LNC=2 output that core 0 stores whole."""
        dst = ctx.stores.get(self.out.name)
        if dst is None or self.bias is not None or lo.split != 1 or not lo.pmajor:
            return None
        if lo.FT * ctx.tokens * nbytes(self.out.dtype) <= ctx.chunk_bytes:
            return None
        if ctx.lnc == 2 and not ctx.split(lo.FT):
            return None
        return dst

    def _emit_streamed(self, ctx: Context, i: int, dst: ir.Value) -> Emitted:
        """Weight chunk by weight chunk: matmuls into PSUM, eviction into a tile of that chunk's outputs, store."""
        li, lo = ctx.layout(self.x), ctx.layout(self.out)
        T = ctx.tokens
        N, K = self.out.features, self.x.features
        name = inst_name(self)
        out = ctx.var(self.out)
        half = ctx.split(lo.FT)
        base = expr("exprs.j2", "core_base", half=half)
        chunks = linear_chunks(half or lo.FT, li.FT * lo.P * nbytes(self.weight.dtype), ctx.chunk_bytes)
        db = nbytes(self.out.dtype)
        # two chunk tiles: the next chunk evicts while the previous one's store is still in flight
        e = Emitted(sbuf=2 * max(c1 - c0 for c0, c1 in chunks) * T * db)
        what = f"{dst.name} [{T}, {N}]"
        e.code("linear_stream_open.j2", module=self.module or "", aten=aten(self), N=N, K=K, T=T, what=what,
               nchunks=len(chunks) * (2 if half else 1))
        w = ctx.var(self.weight)
        for c0, c1 in chunks:
            n = c1 - c0
            e.code("linear_stream_tile.j2", out=out, Pn=lo.P, n=n, T=T, dtype=nl_dtype(self.out.dtype), name=name,
                   c=c0)

            def src(a: int, b: int, c0: int = c0) -> str:
                return expr("exprs.j2", "weight_chunks", w=w, n0=a + c0, n1=b + c0, base=base, half=half)

            sub = Emitted()
            linear_pieces(sub, name=name, x=ctx.var(self.x), tok=":", out=out, w_hbm=w, w_src=src, Pk=li.P,
                          KT=li.FT, Pn=lo.P, NT=n, T=T, wdtype=self.weight.dtype, chunk_bytes=n * li.FT * lo.P
                          * nbytes(self.weight.dtype), earliest=0, index=i)
            for p in sub.pieces:
                if isinstance(p, ChunkUse):
                    p.chunk.name = f"{name}.w{c0}"
            e.pieces += sub.pieces
            e.psum_banks = max(e.psum_banks, sub.psum_banks)
            g = f"{base}{c0}"
            # partition-major output, f = p * FT + ft: n contiguous features per partition from chunk g
            pattern, offset = [[lo.FT, lo.P], [1, n], [N, T]], g
            e.code("linear_store_chunk.j2", module=self.module or "linear", what=what, n0=g, n=n, dst=ctx.var(dst),
                   pattern=pattern, offset=offset, x=out, name=f"{name}.c{c0}")
        ctx.stored.add(self.out.name)
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        bias = env[self.bias.name] if self.bias is not None else None
        env[self.out.name] = F.linear(env[self.x.name], env[self.weight.name], bias).reshape(self.out.shape)


@register_lowering(linear, tokens=x_tokens, instructions=[Linear])
def lower_linear(L: Lowerer, m: Any) -> None:
    x = L.act(L.input(m, "x"), L.views(m, "x"))
    pieces = _feature_pieces(L, L.output(m))
    if pieces:  # fused QKV / gate_up read only through feature slices: one projection per slice
        w_node, b_node = L.input(m, "weight"), m.inputs.get("bias")
        for node, rows in pieces:
            w = L.hbm_rows(w_node, rows)
            b = L.hbm_rows(b_node, rows) if b_node else None
            out = L.new_act(node, L.label(m, f"f{rows[0][0]}"))
            L.emit(Linear(x=x, weight=w, out=out, bias=b), m)
        return
    if _split_for_stored_gather(L, m, x):
        return
    # a tied lm head reads the embedding table: its own argument, re-laid out for the matmul (bind.weight_for_use)
    w = weight_for_use(L, L.input(m, "weight"), "linear", f"{L.label(m)}_weight")
    b = L.hbm(m.inputs["bias"]) if m.inputs.get("bias") else None
    out = L.new_act(L.output(m), L.label(m))
    if w.shape != (out.features, x.features):
        raise CodegenError(f"linear weight {w.shape} does not map {x.features} -> {out.features} features")
    L.emit(Linear(x=x, weight=w, out=out, bias=b), m)


def _split_for_stored_gather(L: Lowerer, m: Any, x: ir.Value) -> bool:
    """A vocabulary-parallel ``lm_head`` whose logits are only all-gathered and stored, with a local vocabulary
    that is no multiple of 128 (Qwen3's 151936 / 4 = 37984 = 32 x 1187): as one value it gets 32 partitions, so
    every matmul's stationary weight block has 32 columns and the projection issues 4x the matmuls (the Tensor
    engine's cost is per matmul: 18992 for one rank of Qwen3-30B at TP=4), and its odd chunk count cannot split
    between the LNC=2 cores. The stored gather (``ops/collective.py``) takes any partition-major pieces, so the
    projection becomes two over weight rows: the first ``F - F mod 128`` features on 128 partitions (split
    between the cores when the chunk count is even), and the last ``F mod 128`` as the gather's ``tail``.
    Each output element is the same fp32 PSUM sum over K rounded once, as in the unsplit projection.
    Returns whether it lowered ``m`` this way."""
    from fusegraph.codegen.api import PMAX, largest_divisor
    node = L.output(m)
    F_ = L.features(node)
    if F_ <= PMAX or largest_divisor(F_) == PMAX:
        return False
    g = stored_gather_of(L, node)
    if g is None or not _only_read_by(L, node, set(g.nodes)):  # the gather must be its only reader
        return False
    w_node, b_node = L.input(m, "weight"), m.inputs.get("bias")
    if tuple(L.node(w_node).get("shape") or ()) != (F_, x.features):
        return False
    bulk = F_ - F_ % PMAX
    dtype = _dtype_of(L, node)
    for rows, key, label in (((0, bulk),), node, L.label(m)), (((bulk, F_),), tail_key(node), L.label(m, "tail")):
        w = L.hbm_rows(w_node, rows)
        b = L.hbm_rows(b_node, rows) if b_node else None
        n = rows[0][1] - rows[0][0]
        # a part of the node's value: no eager tensor of the node to bisect it against (node=None)
        out = ir.Value(L.unique(label), ir.ValueKind.ACT, (L.T, n), dtype, node=None)
        L.values[key] = out
        L.emit(Linear(x=x, weight=w, out=out, bias=b), m)
    return True


def _only_read_by(L: Lowerer, node: str, nodes: set[str]) -> bool:
    """Whether every reader of ``node``, through the region's glue views, is one of ``nodes``."""
    glue = set(getattr(L.region, "glue_nodes", ()))
    todo, seen = [node], set()
    while todo:
        for s in _data_succ(L, todo.pop()):
            if s in nodes or s in seen:
                continue
            if s not in glue:
                return False
            seen.add(s)
            todo.append(s)
    return True


def _dtype_of(L: Lowerer, node: str) -> torch.dtype:
    dt = L.node(node).get("dtype")
    if isinstance(dt, torch.dtype):
        return dt
    return getattr(torch, str(dt).replace("torch.", ""))


def _feature_pieces(L: Lowerer, out: str) -> list[tuple[str, tuple[tuple[int, int], ...]]] | None:
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
    F_ = L.features(out)
    if shape[-1] != F_:  # the match's output is already viewed per head ([..., heads, E]; views fold together)
        return _unmatched_pieces(L, _grouped_pieces(L, out, shape)) if shape[-2] * shape[-1] == F_ else None
    pieces: list[tuple[str, tuple[tuple[int, int], ...]]] = []
    for s in _data_succ(L, out):
        c = L.node(s)
        cshape = c.get("shape")
        if (c.get("op") in _RESHAPES and isinstance(cshape, tuple) and len(cshape) == len(shape) + 1
                and tuple(cshape[:len(shape) - 1]) == tuple(shape[:-1]) and cshape[-2] * cshape[-1] == F_):
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


def _unmatched_pieces(L: Lowerer, pieces: list | None) -> list | None:
    """Pieces only when the slicing is layout glue: a slice some pattern matched (partial rotary's
    ``x[..., :R]``) needs the whole projection output as its input."""
    if not pieces or any(b <= a for _, rows in pieces for a, b in rows):
        return None
    return None if any(n in L.matched_nodes for n, _ in pieces) else pieces


def _grouped_pieces(L: Lowerer, node: str, shape: tuple) -> list[tuple[str, tuple[tuple[int, int], ...]]] | None:
    """Pieces of a projection output viewed as ``[..., groups, E]`` and split along E: each piece's rows repeat
    per group (GPT-NeoX's per-head fused QKV)."""
    groups, E = shape[-2], shape[-1]
    src, sshape = node, shape
    while True:  # through transposes that keep the element order (decode: the sequence dim is 1)
        nxt = _data_succ(L, src)
        t = L.node(nxt[0]) if len(nxt) == 1 else {}
        if (t.get("op") not in ("aten.transpose.int", "aten.permute.default")
                or not isinstance(t.get("shape"), tuple) or t["shape"][-1] != E
                or not preserves_order(L.G, nxt[0], src)):
            break
        src, sshape = nxt[0], t["shape"]
    inner = _last_dim_ranges(L, src, sshape)
    if not inner:
        return None
    return [(n, tuple((g * E + a, g * E + b) for g in range(groups))) for n, (a, b) in inner]


_RESHAPES = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"}


def _data_succ(L: Lowerer, n: str) -> list[str]:
    return [s for s in L.G.successors(n) if not L.G.edges[n, s].get("hazard")]


def _last_dim_ranges(L: Lowerer, src: str, shape: tuple,
                     only: str | None = None) -> list[tuple[str, tuple[int, int]]] | None:
    """The last-dim ranges the readers of ``src`` take (slices, split/chunk + getitem); None if a reader does
    anything else."""
    F_, last = shape[-1], len(shape) - 1
    found: list[tuple[str, tuple[int, int]]] = []
    for s in ([only] if only else _data_succ(L, src)):
        c = L.node(s)
        op, args = c.get("op"), c.get("args", ())
        if op == "aten.slice.Tensor":
            dim = args[1] if len(args) > 1 else 0
            start = args[2] if len(args) > 2 and args[2] is not None else 0
            stop = args[3] if len(args) > 3 and args[3] is not None else F_
            step = args[4] if len(args) > 4 else 1
            if dim % len(shape) != last or step != 1 or not isinstance(start, int) or not isinstance(stop, int):
                return None
            found.append((s, (max(0, start), min(stop, F_))))
        elif op in ("aten.split.Tensor", "aten.split_with_sizes.default"):
            dim = args[2] if len(args) > 2 else 0
            if dim % len(shape) != last:
                return None
            sizes = list(args[1]) if op.endswith("sizes.default") else [args[1]] * -(-F_ // args[1])
            bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
            for g in _data_succ(L, s):
                gd = L.node(g)
                if gd.get("op") != "getitem":
                    return None
                i = gd["args"][1]
                found.append((g, (bounds[i], min(bounds[i + 1], F_))))
        else:
            return None
    return found


def _project(L: Lowerer, m: Any, *, x: Any, weight: Any, out: Any, bias: Any = None) -> None:
    """The ``projection`` service: a matmul of an activation by a weight inside a match's traced body (what the
    core's generic lowering asks for without naming this op)."""
    L.emit(Linear(x=x, weight=weight, out=out, bias=bias), m)


provide("projection", _project)
