"""The collective instructions (``patterns/collectives/lowering.py``) in generated kernels, on ranks simulated as threads
of this process (``nkisim.run(..., ranks=N)``): an SBUF all-reduce after a per-rank activation and an SBUF
all-gather of per-rank features, checked against torch's sum / concatenation of the ranks' inputs, with LNC=1 and
LNC=2 (two programs per rank: program p of every rank forms its own collective group), plus the region-formation
checks of their lowerings. Fast (no torchrun); the multi-process path is ``test_tp_decode.py``.
"""
from __future__ import annotations

import pytest
import torch

from fusegraph import nkisim
from fusegraph.codegen.megakernel import generate
from fusegraph.patterns.collectives.lowering import AllGather, AllReduce, group_refusal, reference_collective
from fusegraph.nkisim.torch_io import InterpretedKernel, to_numpy, to_torch
from fusegraph.codegen.testing import Builder


def _run_ranks(b: Builder, per_rank: list[dict[str, torch.Tensor]], lnc: int) -> tuple[list[dict], object]:
    """Generate ``b``'s kernel (conformance-checked) and run it on len(per_rank) thread ranks."""
    prog = b.program()
    gen = generate(prog, lnc=lnc)
    kernel = InterpretedKernel(gen)
    rank_args = []
    for tensors in per_rank:
        t = {**b.tensors, **tensors}
        prepared = kernel.prepare(t)
        rank_args.append(tuple(to_numpy(prepared[n] if n in prepared else gen.constants[n]) for n in gen.args))
    outs = nkisim.run(kernel._fn, ranks=len(per_rank), rank_args=rank_args, lnc=lnc, target="trn2")
    names = [v.name for v in prog.outputs]
    return [dict(zip(names, [to_torch(a) for a in (o if isinstance(o, tuple) else (o,))])) for o in outs], gen


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_reduce_kernel_sums_the_ranks(lnc: int, dtype: torch.dtype) -> None:
    T, F, W = 2, 256, 2
    torch.manual_seed(0)
    xs = [torch.randn(T, F).to(dtype) for _ in range(W)]
    b = Builder(tokens=T)
    x = b.act("x", xs[0])
    y = b.new("y", F, dtype)
    b.ins.append(AllReduce(x=x, out=y, ranks=(0, 1), reduce="sum", layer=0))
    b.store(y)
    outs, gen = _run_ranks(b, [{"in_x": xr} for xr in xs], lnc)
    assert "nki.collectives.all_reduce(" in gen.source and "collective_dim" not in gen.source
    want = (xs[0].float() + xs[1].float()).to(dtype)  # fp32 sum, rounded once (= gloo's for two ranks)
    for r in range(W):
        assert torch.equal(outs[r]["out_y"], want), r


def test_all_reduce_max_and_min() -> None:
    T, F = 1, 128
    xs = [torch.randn(T, F) for _ in range(2)]
    for reduce, fn in (("max", torch.maximum), ("min", torch.minimum)):
        b = Builder(tokens=T)
        x = b.act("x", xs[0])
        y = b.new("y", F, torch.float32)
        b.ins.append(AllReduce(x=x, out=y, ranks=(0, 1), reduce=reduce, layer=0))
        b.store(y)
        outs, _ = _run_ranks(b, [{"in_x": xr} for xr in xs], 1)
        assert all(torch.equal(o["out_y"], fn(xs[0], xs[1])) for o in outs), reduce


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("W,T,F", [(2, 1, 500), (2, 3, 64), (4, 2, 96)])
def test_all_gather_kernel_concatenates_features(lnc: int, W: int, T: int, F: int) -> None:
    """Rank r's features land at [r*F, (r+1)*F) of the gathered vector, for one and several tokens."""
    torch.manual_seed(1)
    xs = [torch.randn(T, F) for _ in range(W)]
    b = Builder(tokens=T)
    x = b.act("x", xs[0])
    y = b.new("y", W * F, torch.float32)
    b.ins.append(AllGather(x=x, out=y, ranks=tuple(range(W)), layer=0))
    b.store(y)
    outs, gen = _run_ranks(b, [{"in_x": xr} for xr in xs], lnc)
    assert gen.layouts["y"].P == gen.layouts["x"].P and not gen.layouts["y"].pmajor
    want = torch.cat(xs, dim=-1)
    for r in range(W):
        assert torch.equal(outs[r]["out_y"], want), r


def test_profile_records_the_in_kernel_collective() -> None:
    """The cost model's input: the interpreter's profile lists the collective with its group and bytes."""
    T, F = 1, 256
    b = Builder(tokens=T)
    x = b.act("x", torch.randn(T, F))
    y = b.new("y", F, torch.float32)
    b.ins.append(AllReduce(x=x, out=y, ranks=(0, 1), layer=0))
    b.store(y)
    gen = generate(b.program())
    kernel = InterpretedKernel(gen)
    kernel(kernel.prepare(dict(b.tensors)), shape_only=True)  # one rank alone: shape-only needs no peers
    rows = nkisim.last_profile().collectives
    assert [(r["op"], r["buffer"], r["group"], r["bytes"]) for r in rows] == [("all_reduce", "sbuf", [0, 1], F * 4)]


def test_group_checks_and_reference_without_a_job() -> None:
    assert group_refusal(None, None) == "its process group is unknown in this process"
    assert "not increasing" in group_refusal([1, 0], 2)
    assert "does not match" in group_refusal([0, 1], 4)
    assert group_refusal([0, 1], 2) is None  # no torch.distributed job here: accepted, the group is resolved
    x = torch.randn(1, 8)
    assert torch.equal(reference_collective("all_reduce", x, (0,)), x)  # a group of one: identity
    with pytest.raises(Exception, match="needs those ranks' torch.distributed job"):
        reference_collective("all_gather", x, (0, 1))


def test_lowering_checks_refuse_what_the_kernel_cannot_do() -> None:
    """Region formation asks these: an ``avg`` reduction and a gather along another dim than the features stay
    on the eager path (the collective splits the kernel), with the reason."""
    from types import SimpleNamespace

    from fusegraph.patterns.collectives.lowering import _check_all_gather, _check_all_reduce

    def match(**params: object) -> SimpleNamespace:
        return SimpleNamespace(params={"ranks": (0, 1), "group_size": 2, **params})

    assert _check_all_reduce(match(reduce_op="sum"), None, 1) is None
    assert "no NKI reduce op" in _check_all_reduce(match(reduce_op="avg"), None, 1)
    assert _check_all_gather(match(gather_dim=-1), None, 1) is None
    assert "not the features" in _check_all_gather(match(gather_dim=-3), None, 1)
    assert "unknown" in _check_all_reduce(match(reduce_op="sum", ranks=None), None, 1)


def test_rank_agreement_without_a_job_and_its_warning_text() -> None:
    """Without torch.distributed the outcome is this rank's own; the warning names the rank that failed on its own
    before one that only timed out waiting for it."""
    from fusegraph.executors.kernels import FAILED, OK, RETRY, agree, describe_disagreement

    class _P:  # a program with no collectives
        graph = None

        @staticmethod
        def collectives(graph_index=None):
            return []

    assert agree(_P(), [], OK, "")[0] == OK
    assert agree(_P(), [], RETRY, "guard")[0] == RETRY
    rows = [(0, FAILED, "kernel failed (NkiSyncError: no matching collective)"), (1, FAILED, "kernel failed (boom)"),
            (2, OK, "")]
    assert describe_disagreement(rows) == "rank 1: kernel failed (boom) (and rank(s) [0])"



@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("W,T,F", [(2, 1, 500), (4, 2, 384), (3, 1, 640)])
def test_stored_all_gather_lands_contiguous_and_descriptors_are_large(lnc: int, W: int, T: int, F: int) -> None:
    """A gather that is only a kernel output (the logits) stores its tile itself from partition-major local
    blocks: the same concatenation, with FT contiguous features per descriptor (not one element each)."""
    torch.manual_seed(2)
    xs = [torch.randn(T, F).to(torch.bfloat16) for _ in range(W)]
    b = Builder(tokens=T)
    x = b.act("x", xs[0])
    y = b.new("y", W * F, torch.bfloat16)
    b.ins.append(AllGather(x=x, out=y, ranks=tuple(range(W)), store=True, layer=0))
    b.store(y)
    outs, gen = _run_ranks(b, [{"in_x": xr} for xr in xs], lnc)
    lx = gen.layouts["x"]
    assert lx.pmajor and lx.FT > 1
    want = torch.cat(xs, dim=-1)
    for r in range(W):
        assert torch.equal(outs[r]["out_y"], want), r
    kernel = InterpretedKernel(gen)
    kernel(kernel.prepare(dict(b.tensors)), shape_only=True)  # one rank alone: what the cost model reads
    stores = [d for d in nkisim.last_profile().dmas if d.dst_tensor.startswith("out_y")]
    assert stores and sum(d.bytes for d in stores) == W * F * T * 2
    # P x W descriptors of FT contiguous bf16 features per token (the chunk-major store: one per element)
    assert sum(d.descriptors for d in stores) == lx.P * W * T, stores


@pytest.mark.parametrize("lnc,T", [(1, 1), (2, 1), (2, 2)])
def test_split_lm_head_with_stored_gather_equals_the_unsplit_projection(lnc: int, T: int) -> None:
    """The lm_head as ops/linear.py splits it for a stored gather (a 128-partition bulk, split between the LNC=2
    cores, and the F mod 128 tail) gives the logits of the unsplit projection gathered chunk-major (bit for bit here):
    every element is the same bf16 x bf16 -> fp32 PSUM sum over the same K chunks, rounded once to bf16."""
    from fusegraph.patterns.linear.lowering import Linear

    K, F, W = 256, 608, 2  # 608 = 4 x 128 + 96: bulk FT=4 (even: split between the cores), tail 96
    torch.manual_seed(3)
    x = torch.randn(T, K).to(torch.bfloat16)
    ws = [(torch.randn(F, K) / 16).to(torch.bfloat16) for _ in range(W)]
    got = []
    for split in (False, True):
        b = Builder(tokens=T)
        xv = b.act("x", x)
        w = b.hbm("w", ws[0])
        y = b.new("y", W * F, torch.bfloat16)
        if split:
            wa, wb = b.hbm("wa", ws[0][:512]), b.hbm("wb", ws[0][512:])
            a, t = b.new("a", 512, torch.bfloat16), b.new("t", F - 512, torch.bfloat16)
            b.ins += [Linear(x=xv, weight=wa, out=a, layer=0), Linear(x=xv, weight=wb, out=t, layer=0),
                      AllGather(x=a, out=y, ranks=(0, 1), store=True, tail=t, layer=0)]
            per_rank = [{"wa": wr[:512], "wb": wr[512:], "w": wr} for wr in ws]
        else:
            a = b.new("a", F, torch.bfloat16)
            b.ins += [Linear(x=xv, weight=w, out=a, layer=0), AllGather(x=a, out=y, ranks=(0, 1), layer=0)]
            per_rank = [{"w": wr} for wr in ws]
        b.store(y)
        outs, gen = _run_ranks(b, per_rank, lnc)
        if split:
            assert gen.layouts["a"].P == 128 and gen.layouts["a"].pmajor and gen.layouts["t"].pmajor
            assert ("sendrecv" in gen.source) == (lnc == 2)  # the bulk's chunks split between the cores
        assert torch.equal(outs[0]["out_y"], outs[1]["out_y"])
        got.append(outs[0]["out_y"])
    # the same sums over the same K chunks, but in matmul instructions of other shapes (bulk + tail): the interpreter's
    # BLAS may order a dot product per shape, so within one bf16 step (observed bit-equal)
    torch.testing.assert_close(got[0].float(), got[1].float(), rtol=2 ** -7, atol=1e-6)
    ref = torch.cat([torch.nn.functional.linear(x.float(), wr.float()) for wr in ws], dim=-1)
    assert (got[1].float() - ref).abs().max() <= 2 ** -7 * ref.abs().max()  # bf16 rounding of the fp32 sum
    assert gen.source.count("nki.collectives.all_gather(") == 1  # the tail rides in the bulk's collective
