"""Test cases of the in-kernel collectives (:class:`~.lowering.AllReduce`, :class:`~.lowering.AllGather`) that run
in one process: a process group of ONE rank, where the reduction and the concatenation are the identity. What they
check is that the generated ``nki.collectives`` calls are valid and run in the interpreter, and that the values
come back through them in the layouts the instructions pin (chunk-major tiles for a gather, the partition-major
tile a stored gather writes to HBM itself). The eager reference is the reduction / concatenation over the group's
ranks in plain PyTorch (the patterns' own functions need a ``torch.distributed`` group to run).

What these cases cannot check, the sum or concatenation of several ranks' values, is tested on thread ranks of the
interpreter (``tests/tp/test_tp_collective_kernels.py``) and in the multi-process decode steps of ``tests/tp``; the
reference VM does a real collective only inside a ``torch.distributed`` job."""
from __future__ import annotations

import torch

from fusegraph.codegen.api import EXACT, Builder, CaseProgram, OpCase, register_cases

from .lowering import AllGather, AllReduce

F32, BF16 = torch.float32, torch.bfloat16
RANKS = (0,)
REDUCE = {"sum": lambda xs: torch.stack(xs).sum(0), "max": lambda xs: torch.stack(xs).amax(0)}


def _input(T: int, F: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(T, F, generator=torch.Generator().manual_seed(T * F)).to(dtype)


def _all_reduce(T: int, F: int, dtype: torch.dtype, reduce: str) -> CaseProgram:
    x = _input(T, F, dtype)
    b = Builder(T)
    y = b.new("y", F, dtype)
    b.ins.append(AllReduce(x=b.act("x", x), out=y, ranks=RANKS, reduce=reduce, layer=0))
    b.store(y)
    return CaseProgram(b, {"x": x}, lambda t: {"y": REDUCE[reduce]([t["x"]])})  # the ranks' x: this one


def _all_gather(T: int, F: int, dtype: torch.dtype, stored: bool) -> CaseProgram:
    x = _input(T, F, dtype)
    b = Builder(T)
    y = b.new("y", len(RANKS) * F, dtype)
    b.ins.append(AllGather(x=b.act("x", x), out=y, ranks=RANKS, store=stored, layer=None))
    b.store(y)
    return CaseProgram(b, {"x": x}, lambda t: {"y": torch.cat([t["x"]], dim=-1)})


register_cases(__package__, [
    OpCase("all_reduce_sum_one_rank_T2_H256_f32", lambda: _all_reduce(2, 256, F32, "sum"), EXACT),
    OpCase("all_reduce_max_one_rank_T1_H200_bf16", lambda: _all_reduce(1, 200, BF16, "max"), EXACT),
    OpCase("all_gather_one_rank_T3_F96_bf16", lambda: _all_gather(3, 96, BF16, stored=False), EXACT),
    OpCase("all_gather_stored_one_rank_T2_F256_f32", lambda: _all_gather(2, 256, F32, stored=True), EXACT),
])
