"""Tensor parallelism: what used to be refused is lowered now, and what is still left to eager PyTorch.

Issue 11 (item 8) made tensor-parallel graphs (DTensor parameters, device meshes, functional collectives) fall back
with one warning instead of crashing at the first call. Issue 13 (item 1) lowers them over each rank's local
shards (``docs/tp.md``; the multi-rank tests are in ``tests/tp``). Still refused, each with one warning and the
eager path: a DTensor whose local shard is itself a tensor subclass, other wrapper tensor subclasses, and (before
lowering is used) collectives on a process group this process does not know.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx as fx

from fusegraph import FusegraphWarning


def _skip_without_distributed() -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")


def _compile(fn, *args):
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        out = torch.compile(fn, backend="fusegraph", options={"executor": "eager"})(*args)
        ref = fn(*args)
    return out, ref, [str(m.message) for m in caught if issubclass(m.category, FusegraphWarning)]


def test_dtensor_module_on_a_one_rank_mesh_is_lowered_not_refused(world1) -> None:
    """The graph issue 11 refused ("tensor-parallel (DTensor) graphs are not fused yet"): now no warning, a
    program over local shards, the TP module's result."""
    import fusegraph
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    parallelize_module(mlp, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    out, ref, msgs = _compile(mlp, torch.randn(2, 8))
    assert msgs == []
    assert type(out) is torch.Tensor and torch.equal(out, ref)
    program = fusegraph.last_capture().program
    assert sorted(p.module for p in program.inputs() if p.sharding is not None) == \
        ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_dtensor_with_a_subclass_shard_runs_eagerly(world1) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.testing._internal.two_tensor import TwoTensor

    torch.manual_seed(0)
    w = DTensor.from_local(TwoTensor(torch.randn(4, 4), torch.randn(4, 4)), init_device_mesh("cpu", (1,)),
                           [Replicate()], run_check=False)

    def f(x):
        return torch.relu(x @ w.to_local()) + 1

    out, ref, msgs = _compile(f, torch.randn(2, 4))
    assert len(msgs) == 1 and "is a DTensor (Replicate() over 1 rank) whose local shard is a TwoTensor" in msgs[0]
    assert "running it eagerly" in msgs[0], msgs
    assert type(out) is TwoTensor and torch.equal(out.a, ref.a) and torch.equal(out.b, ref.b)


def _graph_with(target, *args) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(target, (x, *args)))
    return fx.GraphModule(torch.nn.Module(), g)


def test_functional_collective_on_an_unknown_group_is_refused() -> None:
    """A collective is lowered only when this process knows its group (the executors run it there)."""
    _skip_without_distributed()
    import torch.distributed._functional_collectives  # noqa: F401 - registers the _c10d_functional ops
    from fusegraph.capture.checks import CaptureRefused, check_collectives

    with pytest.raises(CaptureRefused, match=r"_c10d_functional\.all_reduce\.default .* process group 'nobody'"):
        check_collectives(_graph_with(torch.ops._c10d_functional.all_reduce.default, "sum", "nobody"))
    check_collectives(_graph_with(torch.ops.aten.relu.default))  # ordinary ops pass


def test_wrapper_tensor_subclass_input_runs_eagerly() -> None:
    """A wrapper subclass other than DTensor (here ``TwoTensor``): one make_fx pass would bake its fake inner
    tensors into the program and return a subclass of *fake* tensors; it is refused instead."""
    from torch.testing._internal.two_tensor import TwoTensor

    torch.manual_seed(0)
    w = TwoTensor(torch.randn(4, 4), torch.randn(4, 4))

    def f(x):
        return torch.relu(x @ w) + 1

    out, ref, msgs = _compile(f, torch.randn(2, 4))
    assert len(msgs) == 1 and "tensor subclass inputs are not lowered yet" in msgs[0] and "TwoTensor" in msgs[0], msgs
    assert type(out) is TwoTensor and torch.equal(out.a, ref.a) and torch.equal(out.b, ref.b)
