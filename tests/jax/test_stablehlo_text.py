"""The importer on StableHLO that did not come from this JAX process: hand-written text and portable-artifact
bytecode (what `jax.export` serializes and torch-xla's StableHLO export writes)."""
import numpy as np
import pytest
import torch

pytest.importorskip("jaxlib")  # not "jax": tests/jax itself would satisfy that

from fusegraph.stablehlo import UnsupportedOp, import_stablehlo, parse_module, unsupported_ops  # noqa: E402

TEXT = """
module @m {
  func.func public @main(%x: tensor<2x4xf32>, %w: tensor<4x3xf32>, %cache: tensor<2x8x3xf32> {tf.aliasing_output = 1 : i32}, %p: tensor<i32>) -> (tensor<2x3xf32>, tensor<2x8x3xf32>) {
    %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32>
    %c = stablehlo.constant dense<2.000000e+00> : tensor<f32>
    %1 = stablehlo.broadcast_in_dim %c, dims = [] : (tensor<f32>) -> tensor<2x3xf32>
    %2 = stablehlo.multiply %0, %1 : tensor<2x3xf32>
    %3 = stablehlo.logistic %2 : tensor<2x3xf32>
    %4 = stablehlo.reshape %3 : (tensor<2x3xf32>) -> tensor<2x1x3xf32>
    %z = stablehlo.constant dense<0> : tensor<i32>
    %5 = stablehlo.dynamic_update_slice %cache, %4, %z, %p, %z : (tensor<2x8x3xf32>, tensor<2x1x3xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<2x8x3xf32>
    return %3, %5 : tensor<2x3xf32>, tensor<2x8x3xf32>
  }
}
"""


def _expected(x, w, cache, p):
    y = torch.sigmoid(2.0 * (x @ w))
    out = cache.clone()
    out[:, min(max(p, 0), 7)] = y
    return y, out


def _run(imported, x, w, cache, p):
    args = [x, w.t().contiguous() if imported.inputs[1].transpose else w, cache, torch.tensor(p)]
    return imported.gm(*args), args


def test_handwritten_text_with_state():
    imported = import_stablehlo(TEXT, arg_kinds=["step", "weight", "state", "step"])
    assert [i.kind for i in imported.inputs] == ["step", "weight", "state", "step"]
    assert imported.outputs[1].state_of == 2
    g = torch.Generator().manual_seed(0)
    x, w, cache = torch.randn(2, 4, generator=g), torch.randn(4, 3, generator=g), torch.randn(2, 8, 3, generator=g)
    for p in (0, 5, 11):  # 11: clamped to the last row
        (y, new), args = _run(imported, x, w, cache.clone(), p)
        ey, enew = _expected(x, w, cache, p)
        torch.testing.assert_close(y, ey)
        torch.testing.assert_close(new, enew)
        torch.testing.assert_close(args[2], enew)  # written in place into the state argument
    ops = [str(n.target) for n in imported.gm.graph.nodes if n.op == "call_function"]
    assert "aten.index_copy.default" in ops and ops[-1] == "aten.copy_.default"


def test_portable_artifact_bytecode():
    from jaxlib.mlir.dialects import stablehlo

    data = stablehlo.serialize_portable_artifact_str(TEXT, stablehlo.get_current_version())
    module = parse_module(data)
    assert module.entry.arg_attrs[2]["tf.aliasing_output"] == 1
    imported = import_stablehlo(module, arg_kinds=["step", "weight", "state", "step"])
    x, w, cache = torch.ones(2, 4), torch.full((4, 3), 0.1), torch.zeros(2, 8, 3)
    (y, new), _ = _run(imported, x, w, cache, 3)
    torch.testing.assert_close(y, _expected(x, w, torch.zeros(2, 8, 3), 3)[0])


def test_unsupported_op_is_named():
    text = """
    module @m {
      func.func public @main(%x: tensor<4xui32>) -> tensor<4xui32> {
        %c = stablehlo.constant dense<3> : tensor<4xui32>
        %0 = stablehlo.shift_left %x, %c : tensor<4xui32>
        return %0 : tensor<4xui32>
      }
    }
    """
    with pytest.raises(UnsupportedOp) as e:
        import_stablehlo(text)
    assert e.value.op in ("stablehlo.shift_left", "stablehlo.constant")
    text2 = text.replace("ui32", "i32")
    assert unsupported_ops(parse_module(text2)) == ["stablehlo.shift_left"]
    with pytest.raises(UnsupportedOp, match="stablehlo.shift_left"):
        import_stablehlo(text2)


def test_dynamic_shapes_are_refused():
    text = """
    module @m {
      func.func public @main(%x: tensor<?x4xf32>) -> tensor<?x4xf32> {
        %0 = stablehlo.negate %x : tensor<?x4xf32>
        return %0 : tensor<?x4xf32>
      }
    }
    """
    with pytest.raises(UnsupportedOp, match="dynamic shape"):
        import_stablehlo(text)


def test_non_splat_constants_are_buffer_inputs():
    text = """
    module @m {
      func.func public @main(%x: tensor<3xf32>) -> tensor<3xf32> {
        %c = stablehlo.constant dense<[1.0, 2.0, 4.0]> : tensor<3xf32>
        %0 = stablehlo.multiply %x, %c : tensor<3xf32>
        return %0 : tensor<3xf32>
      }
    }
    """
    imported = import_stablehlo(text)
    buf = imported.inputs[1]
    assert buf.kind == "buffer" and buf.arg is None
    torch.testing.assert_close(buf.value, torch.tensor([1.0, 2.0, 4.0]))
    (out,) = imported.gm(torch.ones(3), buf.value)
    np.testing.assert_allclose(out.numpy(), [1.0, 2.0, 4.0])
