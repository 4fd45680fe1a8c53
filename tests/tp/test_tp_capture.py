"""Tensor-parallel capture in one process (fast): DTensor inputs lowered over their local shards, collectives as
program nodes with their group, their ordering edges, the canonical form of HF's in-place all-reduce, and the
collective patterns. The multi-rank behaviour (real sharding, real collectives) is in ``test_tp_decode.py``.

A one-rank gloo group over an in-memory store makes real process groups without any connection; graphs whose
collectives name groups this process does not know are only traced and analyzed, never run.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from fusegraph import FusegraphWarning
from tp_harness import skip_without_distributed


def _compile(fn, *args, **options):
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        opts = {"executor": "eager", "cache_dir": "off", **options}
        out = torch.compile(fn, backend="fusegraph", options=opts)(*args)
    import fusegraph

    msgs = [str(m.message) for m in caught if issubclass(m.category, FusegraphWarning)]
    return out, msgs, fusegraph.last_capture().program


def _mlp(*, gather_output: bool = False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8), torch.nn.Linear(8, 12))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "3": ColwiseParallel(use_local_output=not gather_output)}
    return parallelize_module(mlp, init_device_mesh("cpu", (1,)), plan)


def test_dtensor_weights_are_local_shard_inputs_with_their_sharding(world1) -> None:
    """torch's parallelize_module: every DTensor parameter is a plain local-shard input of the ATen graph; its
    node records the mesh, placements and global shape; the result equals the TP module run eagerly."""
    mlp = _mlp()
    x = torch.randn(2, 8)
    out, msgs, program = _compile(mlp, x)
    with torch.no_grad():
        ref = mlp(x)
    assert msgs == []
    assert type(out) is torch.Tensor and torch.equal(out, ref)
    shards = {p.module: p for p in program.inputs() if p.sharding is not None}
    assert set(shards) == {f"{i}.{w}" for i in (0, 2, 3) for w in ("weight", "bias")}
    w0, w2, b2 = shards["0.weight"].sharding, shards["2.weight"].sharding, shards["2.bias"].sharding
    assert w0.placements == ("Shard(dim=0)",) and w0.global_shape == (16, 8) and w0.local_shape == (16, 8)
    assert w2.placements == ("Shard(dim=1)",) and w2.shard_dims == (1,) and b2.placements == ("Replicate()",)
    assert w0.mesh.ranks == (0,) and w0.mesh.groups == (world1.group.WORLD.group_name,)
    assert shards["0.weight"].to_dict()["sharding"]["global_shape"] == [16, 8]
    gm = program.graphs[0].gm
    from torch.distributed.tensor import DTensor

    assert not any(isinstance(n.meta.get("val"), DTensor) for n in gm.graph.nodes)  # local tensors only


def test_dtensor_outputs_are_wrapped_again(world1) -> None:
    """``use_local_output=False``: the step returns a DTensor; the program computes its local shard and the
    runner wraps it again with the traced placements and global shape."""
    from torch.distributed.tensor import DTensor

    mlp = _mlp(gather_output=True)
    x = torch.randn(3, 8)
    out, msgs, program = _compile(mlp, x)
    with torch.no_grad():
        ref = mlp(x)
    assert msgs == []
    assert isinstance(out, DTensor) and out.placements == ref.placements and out.shape == ref.shape
    assert torch.equal(out.to_local(), ref.to_local())
    assert program.node(program.graphs[0].outputs[0].node)["shape"] == tuple(ref.to_local().shape)


def _two_all_reduces(dist):
    import torch.distributed._functional_collectives as funcol

    def f(x, w):
        y = funcol.all_reduce(x @ w.t(), "sum", dist.group.WORLD)  # DTensor/funcol's out-of-place form
        z = x @ w.t()
        dist.all_reduce(z)  # HF's inference form: in place (dynamo: functional pair + copy_)
        return y + x, z * 2

    return f


def test_collectives_are_program_nodes_with_their_group(world1) -> None:
    from fusegraph.matching import analyze
    from fusegraph.matching.canonicalize import canonicalize

    f = _two_all_reduces(world1)
    x, w = torch.randn(1, 1, 16), torch.randn(16, 16)
    out, msgs, program = _compile(f, x, w)
    ref = f(x, w)
    assert msgs == [] and all(torch.equal(a, b) for a, b in zip(out, ref))
    G = program.graph
    first, second = program.collectives()
    for n in (first, second):
        c = G.nodes[n]["collective"]
        assert (c.op, c.reduce_op, c.group.name, c.group.ranks, c.group.size) == \
            ("all_reduce", "sum", world1.group.WORLD.group_name, (0,), 1)
        assert G.nodes[c.wait]["op"] == "_c10d_functional.wait_tensor.default"
        assert G.nodes[c.wait]["collective_wait"] == n
        data_preds = tuple(p for p in G.predecessors(n) if not G.edges[p, n].get("hazard"))
        assert c.inputs == data_preds and G.nodes[c.inputs[0]]["shape"] == (1, 1, 16)
    assert G.edges[first, second] == {"hazard": True, "collective": True}  # one group: program order kept
    ops = {G.nodes[n]["op"] for n in program.op_nodes()}
    assert "aten.copy.default" in ops  # HF's in-place form, as captured ...
    cv = canonicalize(program)
    assert not any(d.get("orig_op") == "aten.copy.default" for _, d in cv.data.nodes(data=True))  # ... folded
    matches = [m for m in analyze(program).matches if m.pattern.name == "fusegraph.all_reduce"]
    assert len(matches) == 2
    for m in matches:
        assert m.params["reduce_op"] == "sum" and m.params["group_size"] == 1 and m.params["ranks"] == (0,)
        assert m.params["group_name"] == world1.group.WORLD.group_name


def _traced(fn, *shapes):
    """A one-graph program of ``fn`` on fake inputs (collectives may name groups nobody has: never run)."""
    from fusegraph.capture.lower import to_aten
    from fusegraph.program import Program
    from fusegraph.program.build import DynamoInput, add_graph
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = [torch.randn(s) for s in shapes]
    gm = to_aten(fn, args, fake_mode=FakeTensorMode())
    program = Program()
    add_graph(program, gm, 0, [DynamoInput(f"L['a{i}']", True, False) for i in range(len(args))])
    return program


def test_collectives_are_ordered_per_group() -> None:
    """Hazard edges chain each group's collectives in program order (and only those of one group); an
    unknown group is recorded by name."""
    skip_without_distributed()
    c10d = torch.ops._c10d_functional

    def f(x):
        a = c10d.wait_tensor(c10d.all_reduce(x, "sum", "tp"))
        b = c10d.wait_tensor(c10d.all_reduce(x * 2, "sum", "dp"))
        c = c10d.wait_tensor(c10d.all_reduce(x * 3, "max", "tp"))
        return a, b, c

    program = _traced(f, (2, 8))
    G = program.graph
    a, b, c = program.collectives()
    hazards = [(u, v) for u, v, e in G.edges(data=True) if e.get("collective")]
    assert hazards == [(a, c)]
    assert G.nodes[b]["collective"].group.to_dict() == {"name": "dp", "ranks": None, "size": None}
    assert G.nodes[c]["collective"].reduce_op == "max"


def test_a_collective_on_an_unknown_group_is_refused() -> None:
    skip_without_distributed()
    from fusegraph.capture.checks import CaptureRefused, check_collectives

    c10d = torch.ops._c10d_functional
    program = _traced(lambda x: c10d.wait_tensor(c10d.all_reduce(x, "sum", "nobody")), (4,))
    with pytest.raises(CaptureRefused, match=r"process group 'nobody', which this process does not know"):
        check_collectives(program.graphs[0].gm)
    check_collectives(_traced(lambda x: x.relu(), (4,)).graphs[0].gm)  # no collective: nothing to refuse


def test_copy_folds_only_when_it_is_its_source() -> None:
    """``copy(dst, src)`` folds to ``src`` only without broadcast or cast (then it is not ``src``)."""
    from fusegraph.matching.canonicalize import canonicalize

    def same(x):
        y = x * 2
        y.copy_(x + 1)
        return y * 3

    def broadcast(x, r):
        y = x * 2
        y.copy_(r)
        return y * 3

    for fn, shapes, folded in ((same, [(3, 4)], True), (broadcast, [(3, 4), (4,)], False)):
        program = _traced(fn, *shapes)
        assert "aten.copy.default" in {program.node(n)["op"] for n in program.op_nodes()}
        cv = canonicalize(program)
        kept = any(d.get("orig_op") == "aten.copy.default" for _, d in cv.data.nodes(data=True))
        assert kept is not folded, fn.__name__


def _gather_matches(fn, *shapes):
    from fusegraph.matching import analyze

    return [m for m in analyze(_traced(fn, *shapes)).matches if m.pattern.name == "fusegraph.all_gather"]


def test_all_gather_forms() -> None:
    """The three spellings of a gather along one dim match, with group size, gather dim and group name; a
    reshape of gathered rows that is not a concatenation does not."""
    skip_without_distributed()
    c10d = torch.ops._c10d_functional

    def gather(x, w=2):
        return c10d.wait_tensor(c10d.all_gather_into_tensor(x, w, "tp"))

    def view(x):  # DTensor's one-token form: [W, 1, N] read as [1, 1, W*N]
        return gather(x).view(1, 1, -1) * 1.5

    def chunk_cat(x):  # the general form (batch 2)
        return torch.cat(torch.chunk(gather(x, 4), 4, dim=0), dim=-1) * 1.5

    def dim0(x):
        return gather(x) * 1.5

    def not_a_cat(x):  # [2, N] gathered to [4, N] and read as [2, 2N]: rows interleave, not a concatenation
        return gather(x).view(2, -1) * 1.5

    (m,) = _gather_matches(view, (1, 1, 16))
    assert m.variant.startswith("view") and (m.params["group_size"], m.params["gather_dim"]) == (2, -1)
    assert m.params["group_name"] == "tp" and m.outputs["out"] in m.nodes
    (m,) = _gather_matches(chunk_cat, (2, 1, 16))
    assert m.variant.startswith("default[group_size=4]") and m.params["gather_dim"] == -1
    (m,) = _gather_matches(dim0, (3, 16))
    assert m.variant.startswith("dim0") and m.params["gather_dim"] == -2
    matches = _gather_matches(not_a_cat, (2, 16))
    assert all(not m.variant.startswith("view") for m in matches)  # only the bare gather (dim0) is taken


def test_collective_patterns_are_traced_on_meta_only() -> None:
    """They need the group they name to run, so single-process ``verify_pattern`` has nothing to run (every
    case is a meta case); ``test_tp_decode.py`` recomputes their matches with the real collective."""
    skip_without_distributed()
    from fusegraph.matching import get_pattern
    from fusegraph.matching.verify import verify_pattern

    for name in ("fusegraph.all_reduce", "fusegraph.all_gather"):
        p = get_pattern(name)
        cases = [c for impl in p.implementations for c in (impl.cases or p.cases)]
        assert cases and all(c.get("_device") == "meta" for c in cases)
        assert verify_pattern(p) == []
