"""Read StableHLO (text, bytecode or an MLIR module object) into :mod:`.ir` with the MLIR Python bindings that
ship with jaxlib (``jaxlib.mlir``), so any producer's StableHLO works: ``jax.jit(f).lower(...)``, a serialized
``jax.export`` artifact, or torch-xla's StableHLO export (the last cannot be tried here: no torch-xla on CPU).

Only ranked tensors with static shapes are read; anything else (tokens, tuples, dynamic dimensions, quantized
types) raises :class:`~.ir.UnsupportedOp` naming the op, so callers fall back instead of guessing.
"""
from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np

from .ir import Block, Function, Module, Op, TensorType, UnsupportedOp, Value

log = logging.getLogger(__name__)

_DTYPES = {"f32", "f16", "bf16", "f64", "i1", "i8", "i16", "i32", "i64", "ui8", "ui16", "ui32", "ui64"}
_LOC_NAME = re.compile(r'^loc\("(?P<name>[^"]*)"')
_LOC_FILE = re.compile(r'"(?P<file>[^"]+\.py)":(?P<line>\d+)')


def _context():
    """An MLIR context with the StableHLO, CHLO and func dialects registered (jax's own helper)."""
    try:
        from jax._src.interpreters import mlir as jax_mlir

        return jax_mlir.make_ir_context()
    except Exception:  # noqa: BLE001 - jax internals moved: register the dialects ourselves
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import chlo, stablehlo

        ctx = ir.Context()
        stablehlo.register_dialect(ctx)
        chlo.register_dialect(ctx)
        return ctx


def parse_module(source: Any) -> Module:
    """Parse StableHLO given as text, portable-artifact bytecode (``bytes``) or a ``jaxlib.mlir.ir.Module``."""
    from jaxlib.mlir import ir

    if isinstance(source, ir.Module):
        with source.context:
            return _convert(source)
    ctx = _context()
    with ctx:
        if isinstance(source, (bytes, bytearray)):
            from jaxlib.mlir.dialects import stablehlo

            try:
                mod = stablehlo.deserialize_portable_artifact(ctx, bytes(source))
            except Exception:  # noqa: BLE001 - plain MLIR bytecode rather than a portable artifact
                mod = ir.Module.parse(bytes(source))
        else:
            mod = ir.Module.parse(str(source))
        return _convert(mod)


# ---- types and attributes -----------------------------------------------------------------------------------
def tensor_type(t: Any, what: str) -> TensorType:
    from jaxlib.mlir import ir

    try:
        rt = ir.RankedTensorType(t)
    except Exception as e:  # noqa: BLE001
        raise UnsupportedOp(what, f"type {t} is not a ranked tensor") from e
    if not rt.has_static_shape:
        raise UnsupportedOp(what, f"dynamic shape {t}")
    dtype = str(rt.element_type)
    if dtype not in _DTYPES:
        raise UnsupportedOp(what, f"element type {dtype}")
    return TensorType(tuple(int(d) for d in rt.shape), dtype)


def _numpy_dtype(dtype: str):
    import ml_dtypes

    return {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "f64": np.float64, "i1": np.bool_,
            "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64, "ui8": np.uint8, "ui16": np.uint16,
            "ui32": np.uint32, "ui64": np.uint64}[dtype]


def _dense(attr: Any, ttype: TensorType) -> np.ndarray:
    """A dense elements attribute as a numpy array of its element type (bf16 through ml_dtypes)."""
    from jaxlib.mlir import ir

    d = attr if isinstance(attr, ir.DenseElementsAttr) else ir.DenseElementsAttr(attr)
    npt = _numpy_dtype(ttype.dtype)
    if d.is_splat:
        v = d.get_splat_value()
        if ttype.dtype == "i1":
            scalar = bool(v.value)
        elif ttype.dtype.startswith(("i", "ui")):
            scalar = int(v.value)
        else:
            scalar = float(v.value)
        return np.full(ttype.shape, scalar, dtype=npt)
    text = str(attr)
    m = re.search(r'dense<"0x([0-9A-Fa-f]+)">', text)
    if m:  # large or exotic constants print as raw little-endian hex
        raw = bytes.fromhex(m.group(1))
        if ttype.dtype == "i1":
            return np.frombuffer(raw, dtype=np.uint8).astype(bool).reshape(ttype.shape)
        return np.frombuffer(raw, dtype=npt).reshape(ttype.shape).copy()
    try:
        return np.array(d, copy=True).astype(npt).reshape(ttype.shape)
    except Exception:  # noqa: BLE001 - e.g. bf16 without buffer support: go through the text form
        body = text[text.index("<") + 1:text.rindex(">")]
        body = body[:body.rindex(">")] if body.endswith(">") else body
        nums = re.findall(r"-?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|inf|nan|0x[0-9A-Fa-f]+)|true|false", body)
        vals = [v == "true" if v in ("true", "false") else float(v) for v in nums]
        return np.array(vals, dtype=np.float64).astype(npt).reshape(ttype.shape)


def _cast(cls: Any, attr: Any) -> Any:
    """``cls(attr)`` when ``attr`` is one (dialect attributes come back as plain ``Attribute``), else ``None``."""
    if isinstance(attr, cls):
        return attr
    try:
        return cls(attr)
    except Exception:  # noqa: BLE001 - not that attribute kind
        return None


def _attr(name: str, attr: Any, op_name: str) -> Any:
    """Decode one attribute to Python values (tuples of ints, dicts for dimension numbers, strings...)."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import stablehlo as sh

    for cls in (ir.DenseI64ArrayAttr, ir.DenseI32ArrayAttr, ir.DenseBoolArrayAttr):
        if isinstance(attr, cls):
            return tuple(attr)
    if isinstance(attr, ir.BoolAttr):
        return bool(attr.value)
    if isinstance(attr, ir.IntegerAttr):
        return int(attr.value)
    if isinstance(attr, ir.FloatAttr):
        return float(attr.value)
    if isinstance(attr, ir.StringAttr):
        return str(attr.value)
    if isinstance(attr, ir.FlatSymbolRefAttr):
        return str(attr.value)
    if isinstance(attr, ir.DenseIntElementsAttr) and name != "value":
        return tuple(int(x) for x in attr)
    if isinstance(attr, ir.ArrayAttr):
        return [_attr(name, a, op_name) for a in attr]
    if isinstance(attr, ir.DictAttr):
        return {attr[i].name: _attr(attr[i].name, attr[i].attr, op_name) for i in range(len(attr))}
    d = _cast(sh.DotDimensionNumbers, attr)
    if d is not None:
        return {"lhs_batch": tuple(d.lhs_batching_dimensions), "rhs_batch": tuple(d.rhs_batching_dimensions),
                "lhs_contract": tuple(d.lhs_contracting_dimensions),
                "rhs_contract": tuple(d.rhs_contracting_dimensions)}
    g = _cast(sh.GatherDimensionNumbers, attr)
    if g is not None:
        return {"offset_dims": tuple(g.offset_dims), "collapsed_slice_dims": tuple(g.collapsed_slice_dims),
                "operand_batching_dims": tuple(g.operand_batching_dims),
                "start_indices_batching_dims": tuple(g.start_indices_batching_dims),
                "start_index_map": tuple(g.start_index_map), "index_vector_dim": int(g.index_vector_dim)}
    s = _cast(sh.ScatterDimensionNumbers, attr)
    if s is not None:
        return {"update_window_dims": tuple(s.update_window_dims),
                "inserted_window_dims": tuple(s.inserted_window_dims),
                "input_batching_dims": tuple(s.input_batching_dims),
                "scatter_indices_batching_dims": tuple(s.scatter_indices_batching_dims),
                "scatter_dims_to_operand_dims": tuple(s.scattered_dims_to_operand_dims),
                "index_vector_dim": int(s.index_vector_dim)}
    c = _cast(sh.ComparisonDirectionAttr, attr)
    if c is not None:
        return str(c.value)
    c = _cast(sh.ComparisonTypeAttr, attr)
    if c is not None:
        return str(c.value)
    return str(attr)


def _attr_dict(attrs: Any, op_name: str) -> dict[str, Any]:
    out = {}
    for i in range(len(attrs)):
        na = attrs[i]
        try:
            out[na.name] = na.attr if na.name == "value" else _attr(na.name, na.attr, op_name)
        except Exception:  # noqa: BLE001 - an attribute we do not decode stays text; handlers refuse what they need
            log.debug("%s: attribute %s kept as text", op_name, na.name, exc_info=True)
            out[na.name] = str(na.attr)
    return out


def _location(loc: Any) -> tuple[str, str | None]:
    """(JAX name stack without the ``jit(f)`` root and the primitive name, ``file:line``) of an op location."""
    text = str(loc)
    m = _LOC_NAME.match(text)
    scope = ""
    if m:
        parts = [p for p in m.group("name").split("/") if p]
        if parts and parts[0].startswith(("jit(", "pjit(")):
            parts = parts[1:]
        parts = [p for p in parts[:-1] if not p.startswith(("jit(", "pjit(", "jvp(", "vmap("))]
        scope = "/".join(parts)
    f = None
    for fm in _LOC_FILE.finditer(text):  # the innermost user frame is printed first
        f = f"{fm.group('file')}:{fm.group('line')}"
        break
    return scope, f


# ---- conversion ---------------------------------------------------------------------------------------------
class _Converter:
    def __init__(self) -> None:
        self.values: dict[Any, Value] = {}
        self.count = 0

    def value(self, v: Any) -> Value:
        from jaxlib.mlir import ir

        key = ir.Value(v)
        found = self.values.get(key)
        if found is None:
            raise UnsupportedOp("parse", f"value {v.get_name()} used before definition")
        return found

    def new(self, v: Any, what: str, producer: Op | None = None, index: int = 0, arg: int | None = None) -> Value:
        from jaxlib.mlir import ir

        self.count += 1
        try:
            name = v.get_name()
        except Exception:  # noqa: BLE001
            name = f"%v{self.count}"
        out = Value(name=name, type=tensor_type(v.type, what), producer=producer, index=index, arg=arg)
        self.values[ir.Value(v)] = out
        return out

    def block(self, blk: Any, what: str) -> Block:
        args = [self.new(a, f"{what} argument", arg=i) for i, a in enumerate(blk.arguments)]
        ops: list[Op] = []
        returns: list[Value] = []
        for o in blk.operations:
            op = o.operation
            if op.name in ("func.return", "stablehlo.return"):
                returns = [self.value(v) for v in op.operands]
                continue
            ops.append(self.op(op))
        return Block(args=args, ops=ops, returns=returns)

    def op(self, o: Any) -> Op:
        name = o.name
        operands = [self.value(v) for v in o.operands]
        scope, source = _location(o.location)
        attrs = _attr_dict(o.attributes, name)
        regions = [self.block(r.blocks[0], name) for r in o.regions if len(r.blocks)]
        op = Op(name=name, operands=operands, results=[], attrs=attrs, regions=regions, scope=scope, source=source)
        op.results = [self.new(r, name, producer=op, index=i) for i, r in enumerate(o.results)]
        if name == "stablehlo.constant":
            op.attrs["value"] = _dense(attrs["value"], op.results[0].type)
        for v in operands:
            v.users.append(op)
        return op


def _arg_attrs(f: Any, n: int, key: str) -> list[dict[str, Any]]:
    from jaxlib.mlir import ir

    try:
        arr = f.attributes[key]
    except (KeyError, IndexError):
        return [{} for _ in range(n)]
    out = []
    for d in arr:
        out.append({d[i].name: _attr(d[i].name, d[i].attr, key) for i in range(len(d))})
    return out + [{} for _ in range(n - len(out))]


def _convert(mod: Any) -> Module:
    conv = _Converter()
    functions: dict[str, Function] = {}
    for f in mod.body.operations:
        if f.operation.name != "func.func":
            continue
        from jaxlib.mlir import ir

        name = str(f.attributes["sym_name"].value)
        try:
            visibility = str(f.attributes["sym_visibility"].value)
        except (KeyError, IndexError):
            visibility = "public"
        blk = f.regions[0].blocks[0]
        body = conv.block(blk, f"func {name}")
        functions[name] = Function(
            name=name, body=body, arg_attrs=_arg_attrs(f, len(body.args), "arg_attrs"),
            result_attrs=_arg_attrs(f, len(body.returns), "res_attrs"), public=visibility != "private")
    if not functions:
        raise UnsupportedOp("module", "no func.func in the module")
    main = "main" if "main" in functions else next(n for n, f in functions.items() if f.public)
    log.debug("parsed StableHLO: %d function(s), %d ops", len(functions), sum(len(f.body.ops) for f in functions.values()))
    return Module(functions=functions, main=main)
