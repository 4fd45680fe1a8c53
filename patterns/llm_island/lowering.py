"""An accepted LLM-written kernel as one op of the megakernel (``llm_island`` matches).

Ops that no pattern and no generic lowering covers can be written by the LLM kernel writer
(:mod:`fusegraph.llm`, docs/llm.md). Once the writer has *verified* such a kernel (AST allow-list, API
conformance, kernel contract, an isolated run against the island's own ATen ops on edge-case inputs), the
executor offers it to region formation as an ``llm_island`` match, and this module lowers it *inside* the
megakernel, so the step stays one launch:

* the verified source is turned into a module-level sub-function of the megakernel (:func:`sub_function`): its
  top-level names get a per-kernel prefix (so two islands, or an island and the kernel, never collide) and its
  ``@nki.jit`` decorator is dropped (a plain helper, inlined at trace time like any NKI helper);
* the instruction (:class:`LlmIsland`) stores each activation operand from SBUF to a scratch HBM tensor of the
  island's input shape, calls the sub-function with those (weights are passed as the kernel's own HBM
  arguments), and loads each returned HBM tensor back into an SBUF activation.

The source is untrusted text even after verification: a cached or mutated string is never inlined blindly. The
lowering re-hashes it against the SHA-256 recorded when it passed verification and re-runs the writer's static
checks (parse, allow-list, conformance, contract) through the ``recheck`` hook the executor supplies (codegen
sits below :mod:`fusegraph.llm` and cannot import it); :meth:`LlmIsland.module_code` hashes it once more right
where it is inlined. Any mismatch is a :class:`CodegenError` naming the match, so the executor drops the island
and its ops run eagerly (one warning). The megakernel's first-call verification against eager covers the island
like every other op.
"""
from __future__ import annotations

import ast
import hashlib
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from fusegraph.codegen.api import (CodegenError, Context, Emitted, InlineSource, inst_name, ir, Lowerer, nl_dtype,
                                    register_lowering)

TEMPLATE = "llm_island"


def sha256(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def sub_function(source: str, prefix: str) -> tuple[str, str]:
    """The verified module as megakernel-level code: every name the module binds at top level (functions,
    constants, ``import ... as`` aliases) is renamed to ``prefix + name`` wherever it occurs, decorators are
    dropped. Plain ``import nki.x`` / ``import math`` bind the same module objects as the megakernel's header and
    stay. Returns the code and the map of renamed names (old -> new)."""
    tree = ast.parse(source)
    bound: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            bound.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        bound.add(n.id)
        elif isinstance(node, ast.Import):
            bound |= {a.asname for a in node.names if a.asname}
        elif isinstance(node, ast.ImportFrom):
            bound |= {a.asname or a.name for a in node.names}
    new = {n: f"{prefix}{n}" for n in bound}

    class _Rename(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.AST:
            if node.id in new:
                node.id = new[node.id]
            return node

        def visit_arg(self, node: ast.arg) -> ast.AST:
            if node.arg in new:
                node.arg = new[node.arg]
            return node

        def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
            self.generic_visit(node)
            if node.name in new:
                node.name = new[node.name]
            node.decorator_list = []
            return node

        def visit_alias(self, node: ast.alias) -> ast.AST:
            if node.asname and node.asname in new:
                node.asname = new[node.asname]
            elif node.asname is None and node.name in new:  # from m import name
                node.asname = new[node.name]
            return node

    tree = _Rename().visit(tree)
    ast.fix_missing_locations(tree)
    return ast.unparse(tree) + "\n", new  # type: ignore[return-value]


@dataclass
class LlmIsland(ir.Instruction):
    """A verified LLM-written kernel over scratch HBM operands, called as a sub-function of the megakernel.

    ``args``: the kernel's operands in its parameter order (ACT values are stored to scratch HBM of shape
    ``arg_shapes[i]``; WEIGHT/STATE values are passed as the megakernel's own arguments); ``outs``: its results,
    loaded back into SBUF from the HBM tensors it returns (of shape ``out_shapes[i]``)."""

    opcode: ClassVar[str] = "llm_island"
    args: tuple[ir.Value, ...]
    arg_shapes: tuple[tuple[int, ...], ...]
    outs: tuple[ir.Value, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    source: str  # the verified text, exactly as it passed verification
    source_sha256: str
    entry: str
    what: str = ""
    island_reference: Any = None  # InlineSource.reference (stable repr)
    output_fields: ClassVar[tuple[str, ...]] = ()

    def reads(self) -> list[ir.Value]:
        return list(self.args)

    def writes(self) -> list[ir.Value]:
        return list(self.outs)

    @property
    def prefix(self) -> str:
        return f"llm_{self.source_sha256[:12]}_"

    @property
    def function(self) -> str:
        return self.prefix + self.entry

    def module_code(self, ctx: Context) -> list[str]:
        """The sub-function, from the verified text, re-hashed here (where it is inlined)."""
        if sha256(self.source) != self.source_sha256:
            raise CodegenError(f"LLM island ({self.what}): its kernel text changed after verification "
                               "(SHA-256 mismatch); refused at inlining")
        code, _ = sub_function(self.source, self.prefix)
        banner = (f"\n\n# ---- LLM-written kernel for {self.what} (verified; sha256 {self.source_sha256[:16]}), "
                  "called from the megakernel\n")
        return [banner + code]

    def emit(self, ctx: Context, i: int) -> Emitted:
        if ctx.lnc != 1:
            raise CodegenError("an LLM-written island runs on one core; it is not inlined into an LNC=2 kernel")
        name = inst_name(self)
        stores, hbm_args, loads = [], [], []
        for k, (v, shape) in enumerate(zip(self.args, self.arg_shapes)):
            if v.kind != ir.ValueKind.ACT:
                spec = ctx.specs.get(v.name)
                if spec is not None and (spec.transform is not None or tuple(spec.shape) != tuple(shape)):
                    raise CodegenError(f"LLM island ({self.what}): weight {v.name} is re-laid out for another op of "
                                       "the kernel; the island needs it as the model holds it")
                hbm_args.append(ctx.var(v))
                continue
            lay = ctx.layout(v)
            scratch = f"{ctx.var(v)}_llm{i}_{k}"
            stores.append({"var": scratch, "shape": tuple(shape), "dtype": nl_dtype(v.dtype), "x": ctx.var(v),
                           "pattern": lay.row_pattern() + [[v.features, ctx.tokens]]})
            hbm_args.append(scratch)
        results = [f"r_{ctx.var(o)}" for o in self.outs]
        for o, r in zip(self.outs, results):
            lay = ctx.layout(o)
            loads.append({"out": ctx.var(o), "src": r, "P": lay.P, "FT": lay.FT, "dtype": nl_dtype(o.dtype),
                          "pattern": lay.row_pattern() + [[o.features, ctx.tokens]]})
        e = Emitted()
        e.code("llm_island.j2", what=self.what, name=name, fn=self.function, stores=stores, args=hbm_args,
               results=results, loads=loads, T=ctx.tokens, sha=self.source_sha256[:16])
        e.sbuf = sum(ctx.layout(o).FT * ctx.tokens * o.dtype.itemsize for o in self.outs)
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        """The island's own ATen ops (what the kernel was verified against), on the logical values."""
        if self.island_reference is None:
            raise CodegenError("LLM island without a reference")
        ins = [env[v.name].reshape(s) for v, s in zip(self.args, self.arg_shapes)]
        outs = self.island_reference(*ins)
        for o, t in zip(self.outs, outs):
            env[o.name] = t.reshape(o.shape).to(o.dtype)


def _island_check(m: Any, graph: Any, tokens: int | None) -> str | None:
    spec = m.params.get("inline")
    if not isinstance(spec, InlineSource):
        return "an llm_island match without its verified kernel"
    return None


def recheck_source(spec: InlineSource) -> None:
    """Raise :class:`CodegenError` unless ``spec.source`` is byte-for-byte the verified text and passes the
    writer's static checks again."""
    if sha256(spec.source) != spec.sha256:
        raise CodegenError(f"LLM island ({spec.what}): its kernel text changed after verification (SHA-256 "
                           "mismatch); refused at inlining")
    why = spec.recheck(spec.source)
    if why:
        raise CodegenError(f"LLM island ({spec.what}): its kernel fails the static checks at inlining ({why})")
    try:
        tree = ast.parse(spec.source)
    except SyntaxError as e:  # pragma: no cover - recheck parses first
        raise CodegenError(f"LLM island ({spec.what}): unparsable kernel ({e})") from None
    if not any(isinstance(n, ast.FunctionDef) and n.name == spec.entry for n in tree.body):
        raise CodegenError(f"LLM island ({spec.what}): no top-level function {spec.entry!r} in its kernel")


@register_lowering(TEMPLATE, check=_island_check, instructions=[LlmIsland])
def lower_llm_island(L: Lowerer, m: Any) -> None:
    """An accepted LLM-written kernel (``match.params["inline"]``, an :class:`InlineSource`) as one instruction."""
    spec = m.params.get("inline")
    if not isinstance(spec, InlineSource):
        raise CodegenError("an llm_island match without its verified kernel")
    recheck_source(spec)
    args, shapes = [], []
    for nid in spec.inputs:
        d = L.node(nid)
        shape = tuple(int(s) for s in d["shape"])
        if d.get("kind") == "input" and str(getattr(d.get("input_kind"), "value", d.get("input_kind"))) in (
                "weight", "buffer"):
            v = L.hbm(nid)
        else:
            if not str(d.get("dtype")).startswith(("float", "bfloat")):
                raise CodegenError(f"LLM island ({spec.what}): operand {nid} is {d.get('dtype')}, not a float activation")
            v = L.act(nid)
        args.append(v)
        shapes.append(shape)
    outs, out_shapes = [], []
    for nid in spec.outputs:
        d = L.node(nid)
        if not str(d.get("dtype")).startswith(("float", "bfloat")):
            raise CodegenError(f"LLM island ({spec.what}): result {nid} is {d.get('dtype')}, not a float activation")
        outs.append(L.new_act(nid, f"llm_{d.get('name') or nid}"))
        out_shapes.append(tuple(int(s) for s in d["shape"]))
    L.emit(LlmIsland(args=tuple(args), arg_shapes=tuple(shapes), outs=tuple(outs), out_shapes=tuple(out_shapes),
                     source=spec.source, source_sha256=spec.sha256, entry=spec.entry, what=spec.what,
                     island_reference=spec.reference), m)
