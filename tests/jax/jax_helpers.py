"""Run StableHLO through fusegraph's importer and compare with JAX's own result."""
from __future__ import annotations

import numpy as np
import torch


def run_imported(imported, *arrays):
    """Execute the imported ATen graph on ``arrays`` (what the program would compute, op by op in PyTorch)."""
    from fusegraph.jax.convert import to_torch

    from fusegraph.stablehlo.importer import experts_weight

    tensors = []
    for spec in imported.inputs:
        if spec.experts:
            srcs = [arrays[spec.arg]] + ([arrays[spec.experts[1]]] if spec.experts[0] == "gate_up" else [])
            tensors.append(experts_weight(spec, *[to_torch(np.asarray(x), spec.dtype) for x in srcs]))
        elif spec.arg is None:
            tensors.append(spec.value)
        else:
            tensors.append(spec.take(to_torch(np.asarray(arrays[spec.arg]), spec.dtype, copy=True,
                                              transpose=spec.transpose, contract=spec.contract)))
    with torch.no_grad():
        outs = imported.results(imported.gm(*tensors))
    return [o.float().numpy() if o.dtype == torch.bfloat16 else o.numpy() for o in outs]


def import_jax(fn, *args, **kw):
    """Lower ``fn`` with jax.jit and import its StableHLO text."""
    import jax

    from fusegraph.stablehlo import import_stablehlo

    text = jax.jit(fn).lower(*args).as_text(debug_info=True)
    return import_stablehlo(text, **kw), text


def check_against_jax(fn, *args, rtol=1e-6, atol=1e-6, **kw):
    """Import ``fn``'s StableHLO, run it through PyTorch, and compare every result with ``jax.jit(fn)``."""
    import jax

    imported, text = import_jax(fn, *args, **kw)
    expected = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    got = run_imported(imported, *jax.tree_util.tree_leaves(args))
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        e = np.asarray(e)
        e = e.astype(np.float32) if e.dtype.name == "bfloat16" else e
        assert g.shape == e.shape, (g.shape, e.shape)
        if e.dtype.kind in "biu":
            np.testing.assert_array_equal(g.astype(e.dtype), e)
        else:
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol)
    return imported, text


def aten_ops(imported) -> list[str]:
    return [str(n.target) for n in imported.gm.graph.nodes if n.op == "call_function"]
