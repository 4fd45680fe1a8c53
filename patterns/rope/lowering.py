"""RoPE on head-structured values: ``rotate_half`` (or the interleaved pair rotation) as a signed-permutation matmul,
cos/sin broadcast over heads and loaded once per step (the prologue), partial rotary by padding cos with 1 and
sin with 0. Heads split over partition tiles (head_dim > 128) rotate by a signed copy per tile or block matmuls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fusegraph.codegen.api import (aten, code, CodegenError, Context, Emitted, inst_name, ir, Layout, Lowerer,
                                    nbytes, nl_dtype, PSUM_FREE_FP32, register_lowering, rotate_half, weights as W)
from .rope import rope
from .rope_interleaved import rope_interleaved, rope_interleaved_partial
from .rope_partial import rope_partial


def rope_table_key(which: str, lay: Layout, table: str = "") -> str:
    """The per-step cos/sin table (``which``) a RoPE on values of layout ``lay`` reads: one per layout and source
    table, loaded once per step and shared by every layer that reads that table. Why the table: a model may have
    several (Gemma-3's sliding layers rotate with their own base frequency, its full layers with another); keyed
    by layout alone, every layer read the first table loaded."""
    base = f"{which}:{lay.FT}" if lay.split == 1 else f"{which}:{lay.heads}x{lay.split}:{lay.P}"
    return f"{base}@{table}" if table else base


@dataclass
class Rope(ir.Instruction):
    """HF rotate_half RoPE on head-structured x: out = x * cos + rotate_half(x) * sin (cos/sin per token)."""

    opcode: ClassVar[str] = "rope"
    x: ir.Value
    cos: ir.Value  # INPUT [T, D]
    sin: ir.Value  # INPUT [T, D]
    out: ir.Value
    head_dim: int
    rotary_dim: int = 0  # partial rotary: only features [0, rotary_dim) of each head rotate (0: all of them)
    interleaved: bool = False  # rotate pairs (x[2i], x[2i+1]) (GPT-J convention) instead of the two halves
    table: str = ""  # which cos table ("t0", "t1": its ordinal in the kernel): layers reading one table share its load

    @property
    def rotary_key(self) -> str:
        """Which rotation matrix it uses: rotary dim, ``i`` for the interleaved (pair) rotation."""
        return f"{self.rotary_dim or self.head_dim}{'i' if self.interleaved else ''}"

    def _matrix(self) -> torch.Tensor:
        return W.rotate_half_matrix(self.head_dim, self.x.dtype, self.rotary_dim, self.interleaved)

    def constrain(self, c: ir.Constraints) -> None:
        c.same(self.x, self.out)
        c.heads(self.x, self.head_dim)

    def constants(self, ctx: Context) -> dict[str, ir.Constant]:
        dt = str(self.x.dtype).split(".")[-1]
        key = f"c_rot_{self.head_dim}_{self.rotary_key}_{dt}"
        role = f"rotation:{self.head_dim}:{self.rotary_key}:{self.x.dtype}"
        matrix = self._matrix()
        lay = ctx.layout(self.x)
        if lay.split == 1:
            return {key: ir.Constant(matrix, role)}
        if not W.rotation_is_tile_swap(W.rotation_blocks(matrix, lay.P)):
            # a head split over partition tiles: the matrix as [P, S, S, P] blocks (the half swap needs none)
            return {key: ir.Constant(W.rotation_tiles(matrix, lay.P), role)}
        return {}

    def setup(self, ctx: Context) -> list[str]:
        """This step's cos/sin broadcast over the heads, one DMA each, shared by every layer."""
        lay = ctx.layout(self.x)
        out = []
        for which, val in (("cos", self.cos), ("sin", self.sin)):
            key = rope_table_key(which, lay, self.table)
            if key in ctx.inputs:
                continue
            var = f"{which}_h{lay.FT}" if lay.split == 1 else f"{which}_h{lay.heads}x{lay.split}"
            earlier = sum(1 for k in ctx.inputs if k.startswith(rope_table_key(which, lay) + "@"))
            var = var if not earlier else f"{var}_t{earlier}"  # a second table of this layout (Gemma-3)
            ctx.inputs[key] = var
            out.append(code("rope_tables.j2", var=var, heads=lay.FT, P=lay.P, T=ctx.tokens, dtype=nl_dtype(val.dtype),
                            src=val.name, split=lay.split, D=self.head_dim))
        return out

    def emit(self, ctx: Context, i: int) -> Emitted:
        lay = ctx.layout(self.x)
        T = ctx.tokens
        if lay.split != 1 and lay.FT * T > PSUM_FREE_FP32:  # unsplit heads rotate in PSUM column blocks
            raise CodegenError(f"RoPE over {lay.FT} heads x {T} tokens exceeds one PSUM bank")
        v = ctx.var(self.out)
        e = Emitted(sbuf=3 * lay.FT * T * nbytes(self.out.dtype), psum_banks=1)
        if lay.split != 1:
            return self._emit_split(ctx, lay, e)
        e.code("rope.j2", module=self.module or "", aten=aten(self), name=inst_name(self), P=lay.P, FT=lay.FT, T=T,
               rot=f"{v}_rot", rotation=ctx.consts[f"rotation:{lay.P}:{self.rotary_key}:{self.x.dtype}"],
               x=ctx.var(self.x), split=1,
               a=f"{v}_a", b=f"{v}_b", out=v, dtype=nl_dtype(self.out.dtype),
               cos=ctx.inputs[rope_table_key("cos", lay, self.table)],
               sin=ctx.inputs[rope_table_key("sin", lay, self.table)])
        return e

    def _emit_split(self, ctx: Context, lay: Layout, e: Emitted) -> Emitted:
        """RoPE on heads split over partition tiles (head_dim > 128): rotate_half maps tile j to tile j +- S/2, so
        when every block of the rotation is a signed identity it is a signed copy per tile (out_j = x_j cos_j +- x_i
        sin_j, no matmul, exact like the eager negation); other rotations (partial, interleaved) contract over the
        tiles with one [P, P] block matmul each, accumulated in PSUM."""
        blocks = W.rotation_blocks(self._matrix(), lay.P)
        swap = W.rotation_is_tile_swap(blocks)
        v = ctx.var(self.out)
        rotation = "" if swap else ctx.consts[f"rotation:{self.head_dim}:{self.rotary_key}:{self.x.dtype}"]
        e.code("rope.j2", module=self.module or "", aten=aten(self), name=inst_name(self), P=lay.P, FT=lay.FT,
               T=ctx.tokens, split=lay.split, H=lay.heads, D=self.head_dim, blocks=blocks, swap=swap, rot=f"{v}_rot",
               rotation=rotation, x=ctx.var(self.x), a=f"{v}_a", b=f"{v}_b", out=v, dtype=nl_dtype(self.out.dtype),
               cos=ctx.inputs[rope_table_key("cos", lay, self.table)],
               sin=ctx.inputs[rope_table_key("sin", lay, self.table)])
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        x = env[self.x.name]
        T = x.shape[0]
        xh = x.reshape(T, -1, self.head_dim)
        cos = env[self.cos.name].reshape(T, 1, self.head_dim)
        sin = env[self.sin.name].reshape(T, 1, self.head_dim)
        r = self.rotary_dim or self.head_dim
        part = xh[..., :r]
        turned = (torch.stack((-part[..., 1::2], part[..., 0::2]), -1).flatten(-2) if self.interleaved
                  else rotate_half(part))
        rot = torch.cat((turned, torch.zeros_like(xh[..., r:])), dim=-1)  # cos/sin padded past r
        env[self.out.name] = ((xh * cos) + (rot * sin)).reshape(self.out.shape)


def rotary_key(ins: Rope) -> str:
    return ins.rotary_key


def _check(m: Any, graph: Any, tokens: int | None) -> str | None:
    D = graph.nodes[m.inputs["x"]]["shape"][-1]
    R = graph.nodes[m.inputs["cos"]]["shape"][-1]
    if R > D or R % 2:
        return f"rotary dim {R} does not fit the head size {D}"
    return None


@register_lowering(rope, rope_partial, rope_interleaved, rope_interleaved_partial, check=_check, instructions=[Rope])
def lower_rope(L: Lowerer, m: Any) -> None:
    x_node = L.input(m, "x")
    x = L.act(x_node, L.views(m, "x"))
    D = int(L.node(x_node)["shape"][-1])
    R = int(L.node(L.input(m, "cos"))["shape"][-1])
    if R > D or R % 2:
        raise CodegenError(f"rotary dim {R} does not fit the head size {D}")
    # partial rotary: the kernel rotates whole heads with cos padded by 1 and sin by 0 past R (exact: x*1 + 0)
    cos = L.step_input(L.input(m, "cos"), (L.T, D), label="rope_cos")
    sin = L.step_input(L.input(m, "sin"), (L.T, D), label="rope_sin")
    if R < D:
        L.arg_source(cos).pad = (D, 1.0)
        L.arg_source(sin).pad = (D, 0.0)
    out = L.new_act(L.output(m), L.label(m, "rope"))
    L.emit(Rope(x=x, cos=cos, sin=sin, out=out, head_dim=D, rotary_dim=R if R < D else 0,
                interleaved=m.pattern.template == "rope_interleaved", table=_table_of(L, L.input(m, "cos"))), m)


#: single-tensor view ops between a rotary table and a layer's use of it (``cos.unsqueeze(1)``)
_TABLE_VIEWS = frozenset({"aten.unsqueeze.default", "aten.view.default", "aten._unsafe_view.default",
                          "aten.expand.default", "aten.reshape.default", "aten.squeeze.dim", "aten.alias.default"})


def _table_of(L: Lowerer, nid: str) -> str:
    """Which table a layer's cos comes from, by the node it is a per-layer view of: layers that read the same
    table get the same name (one load per step), layers with their own table (Gemma-3's sliding layers) another.
    The name is the table's ordinal in the kernel ("t0", "t1"), not its node id: node ids carry the graph
    ("g1.cos"), and the same kernel compiled as graph 0 or graph 1 must have one cache key."""
    while True:
        d = L.node(nid)
        refs = [a for a in d.get("args", ()) if hasattr(a, "node")]
        if d.get("kind") != "op" or d.get("op") not in _TABLE_VIEWS or len(refs) != 1:
            break
        nid = refs[0].node
    tables = L.shared.setdefault("rope_tables", {})
    return tables.setdefault(nid, f"t{len(tables)}")
