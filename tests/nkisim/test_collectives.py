"""nki.collectives in the interpreter, ranks as threads (``run(..., ranks=N)``): all_reduce, all_gather,
reduce_scatter and all_to_all on HBM and SBUF, fp32 and bf16, LNC=2 x ranks, the rules of the 2.29 stub docstrings,
failures without hangs, shape-only runs without peers and the profile's per-rank collectives.

``KERNELS`` is also what ``test_collectives_dist.py`` runs over torch.distributed (gloo) to compare the two
transports."""
from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest

from fusegraph import nkisim
from fusegraph.nkisim import NkiSyncError, NkiValidationError

BF16 = ml_dtypes.bfloat16

KERNELS = '''
import nki
import nki.language as nl
import nki.isa as nisa
import nki.collectives as nccl

OPS = {"add": nl.add, "minimum": nl.minimum, "maximum": nl.maximum}


@nki.jit
def ar_hbm(x, y, op="add", groups=((0, 1),)):
    """Coalesced HBM all-reduce of two kernel arguments."""
    ox = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    oy = nl.ndarray(y.shape, dtype=y.dtype, buffer=nl.shared_hbm)
    nccl.all_reduce(srcs=[x, y], dsts=[ox, oy], replica_group=nccl.ReplicaGroup(groups), op=OPS[op])
    return ox, oy


@nki.jit
def ar_sbuf(x, op="add", groups=((0, 1),)):
    """SBUF all-reduce, then + rank_id() (so each rank's output differs)."""
    P, F = x.shape
    t = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    r = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.sbuf)
    nccl.all_reduce(srcs=[t], dsts=[r], replica_group=nccl.ReplicaGroup(groups), op=OPS[op])
    s = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=s, data=r, op0=nl.add, operand0=float(nccl.rank_id()))
    out = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=s)
    return out


@nki.jit
def ag_hbm(x, n=2, groups=((0, 1),)):
    out = nl.ndarray((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, buffer=nl.shared_hbm)
    nccl.all_gather(srcs=[x], dsts=[out], replica_group=nccl.ReplicaGroup(groups), collective_dim=0)
    return out


@nki.jit
def ag_sbuf(x, dim=1, n=2, groups=((0, 1),)):
    P, F = x.shape
    t = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    shape = (n * P, F) if dim == 0 else (P, n * F)
    g = nl.ndarray(shape, dtype=x.dtype, buffer=nl.sbuf)
    nccl.all_gather(srcs=[t], dsts=[g], replica_group=nccl.ReplicaGroup(groups), collective_dim=dim)
    out = nl.ndarray(shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=g)
    return out


@nki.jit
def rs_hbm(x, y, op="add", n=2, groups=((0, 1),)):
    """Coalesced HBM reduce-scatter along dim 0."""
    ox = nl.ndarray((x.shape[0] // n,) + tuple(x.shape[1:]), dtype=x.dtype, buffer=nl.shared_hbm)
    oy = nl.ndarray((y.shape[0] // n,) + tuple(y.shape[1:]), dtype=y.dtype, buffer=nl.shared_hbm)
    nccl.reduce_scatter(srcs=[x, y], dsts=[ox, oy], replica_group=nccl.ReplicaGroup(groups), collective_dim=0,
                        op=OPS[op])
    return ox, oy


@nki.jit
def rs_sbuf(x, n=2, groups=((0, 1),)):
    P, F = x.shape
    t = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    r = nl.ndarray((P // n, F), dtype=x.dtype, buffer=nl.sbuf)
    nccl.reduce_scatter(srcs=[t], dsts=[r], replica_group=nccl.ReplicaGroup(groups), collective_dim=0, op=nl.add)
    out = nl.ndarray((P // n, F), dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=r)
    return out


@nki.jit
def a2a_hbm(x, groups=((0, 1),)):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nccl.all_to_all(srcs=[x], dsts=[out], replica_group=nccl.ReplicaGroup(groups), collective_dim=0)
    return out


@nki.jit
def lnc_halves(x, groups=((0, 1),)):
    """LNC=2: program p all-reduces its half of the rows with program p of the other ranks."""
    P2, F = x.shape
    P = P2 // 2
    pid = nl.program_id(axis=0)
    t = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[pid * P:(pid + 1) * P, :])
    r = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.sbuf)
    nccl.all_reduce(srcs=[t], dsts=[r], replica_group=nccl.ReplicaGroup(groups), op=nl.add)
    s = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=s, data=r, op0=nl.add, operand0=float(100 * pid))
    out = nl.ndarray((P2, F), dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[pid * P:(pid + 1) * P, :], src=s)
    return out


@nki.jit
def lnc_one_program(x, groups=((0, 1),)):
    """LNC=2: only program 0 communicates (program 1 copies its half through): groups are per program id."""
    P2, F = x.shape
    P = P2 // 2
    pid = nl.program_id(axis=0)
    t = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[pid * P:(pid + 1) * P, :])
    out = nl.ndarray((P2, F), dtype=x.dtype, buffer=nl.shared_hbm)
    if pid == 0:
        r = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.sbuf)
        nccl.all_reduce(srcs=[t], dsts=[r], replica_group=nccl.ReplicaGroup(groups), op=nl.add)
        nisa.dma_copy(dst=out[0:P, :], src=r)
    else:
        nisa.dma_copy(dst=out[P:P2, :], src=t)
    return out


@nki.jit
def fail_on_rank(x, bad_rank=1, groups=((0, 1),)):
    """Rank ``bad_rank`` breaks a rule (rule op) before the all-reduce the others are waiting in."""
    P, F = x.shape
    t = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    r = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.sbuf)
    if nccl.rank_id() == bad_rank:
        nisa.tensor_scalar(dst=r, data=t, op0=nl.exp, operand0=1.0)
    nccl.all_reduce(srcs=[t], dsts=[r], replica_group=nccl.ReplicaGroup(groups), op=nl.add)
    out = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=r)
    return out


@nki.jit
def skip_on_rank(x, bad_rank=1, groups=((0, 1),)):
    """Rank ``bad_rank`` never issues the all-reduce (divergent control flow): the others must time out."""
    P, F = x.shape
    t = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    r = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.sbuf)
    if nccl.rank_id() != bad_rank:
        nccl.all_reduce(srcs=[t], dsts=[r], replica_group=nccl.ReplicaGroup(groups), op=nl.add)
    else:
        nisa.tensor_copy(dst=r, src=t)
    out = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=r)
    return out
'''


def kernels():
    return nkisim.load_kernel_source(KERNELS, "cc_kernels.py", target="trn2")


def case_args(name: str, rank: int, dtype: str, n: int = 2) -> tuple:
    """Deterministic per-rank inputs of a case (the same in thread mode and in every process)."""
    rng = np.random.default_rng([sum(map(ord, name)), rank, len(dtype)])
    dt = np.float32 if dtype == "float32" else BF16

    def a(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 3).astype(dt)

    if name in ("ar_hbm", "rs_hbm"):
        return a(4 * n, 8), a(2 * n, 3, 5)
    if name in ("ar_sbuf", "ag_sbuf0", "ag_sbuf1", "rs_sbuf"):
        return (a(32 * n if name == "rs_sbuf" else 32, 16),)
    if name == "ag_hbm":
        return (a(3, 4, 5),)
    if name == "a2a_hbm":
        return (a(2 * n, 6),)
    if name in ("lnc_halves", "lnc_one_program", "fail_on_rank", "skip_on_rank"):
        return (a(64 if name.startswith("lnc") else 32, 8),)
    raise KeyError(name)


#: (case name, kernel, lnc, kernel kwargs)
CASES = [
    ("ar_hbm", "ar_hbm", 1, {}),
    ("ar_hbm_min", "ar_hbm", 1, {"op": "minimum"}),
    ("ar_hbm_max", "ar_hbm", 1, {"op": "maximum"}),
    ("ar_sbuf", "ar_sbuf", 1, {}),
    ("ag_hbm", "ag_hbm", 1, {}),
    ("ag_sbuf0", "ag_sbuf", 1, {"dim": 0}),
    ("ag_sbuf1", "ag_sbuf", 1, {"dim": 1}),
    ("rs_hbm", "rs_hbm", 1, {}),
    ("rs_sbuf", "rs_sbuf", 1, {}),
    ("a2a_hbm", "a2a_hbm", 1, {}),
    ("lnc_halves", "lnc_halves", 2, {}),
    ("lnc_one_program", "lnc_one_program", 2, {}),
]


def args_name(case: str) -> str:
    return {"ar_hbm_min": "ar_hbm", "ar_hbm_max": "ar_hbm"}.get(case, case)


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def f32(a):
    return np.asarray(a, dtype=np.float32)


def bf(a):
    return f32(a).astype(BF16)


# ---- numerics against NumPy -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def K():
    return kernels()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_all_reduce_hbm_coalesced(K, dtype):
    args = [case_args("ar_hbm", r, dtype) for r in range(2)]
    outs = nkisim.run(K["ar_hbm"], ranks=2, rank_args=args)
    cast = f32 if dtype == "float32" else bf
    for r in range(2):
        for i in range(2):
            want = cast(f32(args[0][i]) + f32(args[1][i]))
            assert outs[r][i].dtype == args[0][i].dtype
            np.testing.assert_array_equal(f32(outs[r][i]), f32(want))
    outs = nkisim.run(K["ar_hbm"], ranks=2, rank_args=args, op="maximum")
    np.testing.assert_array_equal(f32(outs[1][0]), np.maximum(f32(args[0][0]), f32(args[1][0])))


def test_all_reduce_bf16_sums_in_fp32_and_rounds_once(K):
    # 1 + 2^-8 + 2^-8 = 1 + 2^-7 exactly in fp32 (then bf16); summing in bf16 would round 1 + 2^-8 down to 1 twice
    ones = [np.full((32, 16), v, dtype=np.float32).astype(BF16) for v in (1.0, 2 ** -8, 2 ** -8)]
    outs = nkisim.run(K["ar_sbuf"], ranks=3, rank_args=[(o,) for o in ones], groups=((0, 1, 2),))
    np.testing.assert_array_equal(f32(outs[0]), np.full((32, 16), 1 + 2 ** -7, np.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_all_reduce_sbuf_and_rank_id(K, dtype):
    args = [case_args("ar_sbuf", r, dtype) for r in range(2)]
    outs = nkisim.run(K["ar_sbuf"], ranks=2, rank_args=args)
    cast = f32 if dtype == "float32" else bf
    s = cast(f32(args[0][0]) + f32(args[1][0]))
    for r in range(2):
        np.testing.assert_array_equal(f32(outs[r]), f32(cast(f32(s) + r)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_all_gather_hbm_and_sbuf(K, dtype):
    args = [case_args("ag_hbm", r, dtype) for r in range(2)]
    outs = nkisim.run(K["ag_hbm"], ranks=2, rank_args=args)
    want = np.concatenate([args[0][0], args[1][0]], axis=0)
    for r in range(2):
        assert outs[r].tobytes() == want.tobytes()  # moved bit for bit
    for dim in (0, 1):
        args = [case_args(f"ag_sbuf{dim}", r, dtype) for r in range(2)]
        outs = nkisim.run(K["ag_sbuf"], ranks=2, rank_args=args, dim=dim)
        want = np.concatenate([args[0][0], args[1][0]], axis=dim)
        assert outs[0].shape == want.shape and outs[1].tobytes() == want.tobytes()


def test_all_gather_four_ranks_in_rank_order(K):
    args = [(np.full((32, 4), r, np.float32),) for r in range(4)]
    outs = nkisim.run(K["ag_sbuf"], ranks=4, rank_args=args, dim=1, n=4, groups=((0, 1, 2, 3),))
    np.testing.assert_array_equal(outs[2][0], np.repeat(np.arange(4, dtype=np.float32), 4))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reduce_scatter_hbm_coalesced_and_sbuf(K, dtype):
    cast = f32 if dtype == "float32" else bf
    args = [case_args("rs_hbm", r, dtype) for r in range(2)]
    outs = nkisim.run(K["rs_hbm"], ranks=2, rank_args=args)
    for i in range(2):
        full = cast(f32(args[0][i]) + f32(args[1][i]))
        half = full.shape[0] // 2
        for r in range(2):
            np.testing.assert_array_equal(f32(outs[r][i]), f32(full[r * half:(r + 1) * half]))
    args = [case_args("rs_sbuf", r, dtype) for r in range(2)]
    outs = nkisim.run(K["rs_sbuf"], ranks=2, rank_args=args)
    full = cast(f32(args[0][0]) + f32(args[1][0]))
    np.testing.assert_array_equal(f32(outs[1]), f32(full[32:]))


def test_all_to_all_hbm(K):
    args = [case_args("a2a_hbm", r, "float32") for r in range(2)]
    outs = nkisim.run(K["a2a_hbm"], ranks=2, rank_args=args)
    x0, x1 = args[0][0], args[1][0]
    np.testing.assert_array_equal(outs[0], np.concatenate([x0[:2], x1[:2]]))
    np.testing.assert_array_equal(outs[1], np.concatenate([x0[2:], x1[2:]]))


def test_two_groups_reduce_separately(K):
    args = [(np.full((32, 16), 10.0 ** r, np.float32),) for r in range(4)]
    outs = nkisim.run(K["ar_sbuf"], ranks=4, rank_args=args, groups=((0, 1), (2, 3)))
    np.testing.assert_array_equal(outs[1], np.full((32, 16), 11.0 + 1))
    np.testing.assert_array_equal(outs[2], np.full((32, 16), 1100.0 + 2))


# ---- LNC=2 x ranks --------------------------------------------------------------------------------------------
def test_lnc2_collectives_are_per_program_id(K):
    args = [case_args("lnc_halves", r, "float32") for r in range(2)]
    outs = nkisim.run(K["lnc_halves"], lnc=2, ranks=2, rank_args=args)
    s = args[0][0] + args[1][0]
    want = s + np.repeat([[0.0], [100.0]], 32, axis=0)
    for r in range(2):
        np.testing.assert_array_equal(outs[r], want.astype(np.float32))
    prof = nkisim.last_profile()
    rows = [(c["rank"], c["program"], c["group"]) for c in prof.collectives]
    assert rows == [(0, 0, [0, 1]), (0, 1, [0, 1]), (1, 0, [0, 1]), (1, 1, [0, 1])]
    # only program 0 communicates: program 1 of each rank is not part of the collective
    args = [case_args("lnc_one_program", r, "float32") for r in range(2)]
    outs = nkisim.run(K["lnc_one_program"], lnc=2, ranks=2, rank_args=args)
    np.testing.assert_array_equal(outs[1][:32], args[0][0][:32] + args[1][0][:32])
    np.testing.assert_array_equal(outs[1][32:], args[1][0][32:])


# ---- failures: no hang --------------------------------------------------------------------------------------
def test_failing_rank_aborts_the_others_quickly(K, monkeypatch):
    monkeypatch.setenv("FUSEGRAPH_NKISIM_SYNC_TIMEOUT", "30")
    x = np.ones((32, 8), np.float32)
    t0 = time.monotonic()
    with pytest.raises(NkiValidationError) as ei:  # the primary error, not the peers' NkiSyncError
        nkisim.run(K["fail_on_rank"], x, ranks=2)
    assert ei.value.rule == "op" and time.monotonic() - t0 < 10


def test_rank_that_never_issues_the_collective_times_out(K, monkeypatch):
    monkeypatch.setenv("FUSEGRAPH_NKISIM_SYNC_TIMEOUT", "1")
    x = np.ones((32, 8), np.float32)
    t0 = time.monotonic()
    with pytest.raises(NkiSyncError, match="no matching peer") as ei:
        nkisim.run(K["skip_on_rank"], x, ranks=2)
    assert ei.value.rule == "sync" and time.monotonic() - t0 < 10


# ---- shape-only: no peers --------------------------------------------------------------------------------------
def test_shape_only_needs_no_peers_and_profiles_each_collective(K):
    x = nkisim.Abstract((32, 16), "bfloat16")
    nkisim.run(K["ar_sbuf"], x, shape_only=True, groups=((0, 1, 2, 3),))
    prof = nkisim.last_profile()
    (c,) = prof.collectives
    assert (c["op"], c["reduce"], c["buffer"], c["group_size"], c["count"], c["bytes"], c["out_bytes"]) == \
        ("all_reduce", "add", "sbuf", 4, 1, 32 * 16 * 2, 32 * 16 * 2)
    assert "collective rank 0 program 0: 1 x all_reduce (sbuf, group of 4)" in prof.summary()
    nkisim.run(K["rs_hbm"], nkisim.Abstract((16, 8)), nkisim.Abstract((8, 3, 5)), shape_only=True, n=4,
               groups=((0, 1, 2, 3),))
    (c,) = nkisim.last_profile().collectives
    assert (c["op"], c["tensors"], c["bytes"], c["out_bytes"]) == ("reduce_scatter", 2, (128 + 120) * 4, 62 * 4)
    # the same launch with data needs every rank of the group
    with pytest.raises(NkiValidationError) as ei:
        nkisim.run(K["ar_sbuf"], np.zeros((32, 16), np.float32), groups=((0, 1, 2, 3),))
    assert ei.value.rule == "ranks"


def test_shape_only_counters_equal_data_counters(K):
    args = [case_args("ag_hbm", r, "float32") for r in range(2)]
    nkisim.run(K["ag_hbm"], ranks=2, rank_args=args)
    data = nkisim.last_profile().counters()
    nkisim.run(K["ag_hbm"], nkisim.Abstract((3, 4, 5)), ranks=2, shape_only=True)
    assert nkisim.last_profile().counters() == data
    assert len(data["collectives"]) == 2


def test_trace_events_carry_the_collective(K):
    nkisim.run(K["ar_sbuf"], nkisim.Abstract((32, 16), "bfloat16"), shape_only=True, trace=True,
               groups=((0, 1, 2, 3),))
    ev = [e for e in nkisim.last_profile().trace[(0, 0)] if e.opcode == "all_reduce"]
    assert len(ev) == 1 and ev[0].dma["queue"] == "cc"
    assert ev[0].dma["collective"]["group_size"] == 4 and ev[0].dma["collective"]["bytes"] == 1024


# ---- the rules -------------------------------------------------------------------------------------------------
BAD = '''
import nki
import nki.language as nl
import nki.isa as nisa
import nki.collectives as nccl

@nki.jit
def bad(x, case):
    rg = nccl.ReplicaGroup([[0]])
    s = nl.ndarray((32, 8), dtype=nl.float32, buffer=nl.sbuf)
    d = nl.ndarray((32, 8), dtype=nl.float32, buffer=nl.sbuf)
    h = nl.ndarray((32, 8), dtype=nl.float32, buffer=nl.shared_hbm)
    if case == "op":
        nccl.all_reduce(srcs=[s], dsts=[d], replica_group=rg, op=nl.multiply)
    elif case == "group-type":
        nccl.all_reduce(srcs=[s], dsts=[d], replica_group=[[0]], op=nl.add)
    elif case == "not-member":
        nccl.all_reduce(srcs=[s], dsts=[d], replica_group=nccl.ReplicaGroup([[1, 2]]), op=nl.add)
    elif case == "unsorted":
        nccl.all_reduce(srcs=[s], dsts=[d], replica_group=nccl.ReplicaGroup([[1, 0]]), op=nl.add)
    elif case == "overlap":
        nccl.ReplicaGroup([[0, 1], [1, 2]])
    elif case == "mixed":
        nccl.all_reduce(srcs=[s], dsts=[h], replica_group=rg, op=nl.add)
    elif case == "psum":
        p = nl.ndarray((32, 8), dtype=nl.float32, buffer=nl.psum)
        nccl.all_reduce(srcs=[p], dsts=[d], replica_group=rg, op=nl.add)
    elif case == "coalesced-sbuf":
        nccl.all_reduce(srcs=[s, s], dsts=[d, d], replica_group=rg, op=nl.add)
    elif case == "sbuf-3d":
        s3 = nl.ndarray((32, 2, 4), dtype=nl.float32, buffer=nl.sbuf)
        nccl.all_reduce(srcs=[s3], dsts=[s3], replica_group=rg, op=nl.add)
    elif case == "a2a-sbuf":
        nccl.all_to_all(srcs=[s], dsts=[d], replica_group=rg, collective_dim=0)
    elif case == "ag-hbm-dim1":
        nccl.all_gather(srcs=[x], dsts=[h], replica_group=rg, collective_dim=1)
    elif case == "ag-sbuf-dim2":
        nccl.all_gather(srcs=[s], dsts=[d], replica_group=rg, collective_dim=2)
    elif case == "rs-dim1":
        nccl.reduce_scatter(srcs=[x], dsts=[h], replica_group=rg, collective_dim=1, op=nl.add)
    elif case == "dtype":
        b = nl.ndarray((32, 8), dtype=nl.bfloat16, buffer=nl.sbuf)
        nccl.all_reduce(srcs=[s], dsts=[b], replica_group=rg, op=nl.add)
    elif case == "ag-shape":
        nccl.all_gather(srcs=[x], dsts=[h], replica_group=nccl.ReplicaGroup([[0, 1]]), collective_dim=0)
    elif case == "rs-shape":
        nccl.reduce_scatter(srcs=[x], dsts=[h], replica_group=nccl.ReplicaGroup([[0, 1]]), collective_dim=0,
                            op=nl.add)
    elif case == "a2a-shape":
        nccl.all_to_all(srcs=[x[0:3, :]], dsts=[h[0:3, :]], replica_group=nccl.ReplicaGroup([[0, 1]]),
                        collective_dim=0)
    elif case == "ar-size":
        nccl.all_reduce(srcs=[s], dsts=[d[0:16, :]], replica_group=rg, op=nl.add)
    elif case == "lists":
        nccl.all_reduce(srcs=s, dsts=[d], replica_group=rg, op=nl.add)
    elif case == "lengths":
        nccl.all_reduce(srcs=[s, s], dsts=[d], replica_group=rg, op=nl.add)
    elif case == "dynamic":
        i = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nccl.all_reduce(srcs=[x.ap([[8, 32], [1, 8]], scalar_offset=i, indirect_dim=0)], dsts=[h],
                        replica_group=rg, op=nl.add)
    return h
'''

RULES = [
    ("op", "op"), ("group-type", "replica-group"), ("not-member", "replica-group"), ("unsorted", "replica-group"),
    ("overlap", "replica-group"), ("mixed", "buffer"), ("psum", "buffer"), ("coalesced-sbuf", "shape"),
    ("sbuf-3d", "shape"), ("a2a-sbuf", "buffer"), ("ag-hbm-dim1", "collective-dim"),
    ("ag-sbuf-dim2", "collective-dim"), ("rs-dim1", "collective-dim"), ("dtype", "dtype"), ("ag-shape", "shape"),
    ("rs-shape", "shape"), ("a2a-shape", "shape"), ("ar-size", "shape"), ("lists", "shape"), ("lengths", "shape"),
    ("dynamic", "dynamic-offset"),
]


@pytest.mark.parametrize("case,rule", RULES, ids=[c for c, _ in RULES])
def test_rules(case, rule):
    ns = nkisim.load_kernel_source(BAD, "cc_bad.py", target="trn2")
    with pytest.raises(NkiValidationError) as ei:
        nkisim.run(ns["bad"], np.zeros((32, 8), np.float32), case=case, shape_only=True)
    assert ei.value.rule == rule, str(ei.value)
    assert "cc_bad.py" in (ei.value.location or "")


def test_group_of_one_is_a_local_copy(K):
    x = case_args("ar_sbuf", 0, "float32")[0]
    out = nkisim.run(K["ar_sbuf"], x, groups=((0,),))
    np.testing.assert_array_equal(out, x)


def test_process_group_needs_an_initialized_job_and_one_rank_per_process(K):
    dist = pytest.importorskip("torch.distributed")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(nkisim.NkiUsageError, match="needs an initialized torch.distributed job"):
        nkisim.run(K["ar_sbuf"], np.zeros((32, 16), np.float32), process_group=object())
    with pytest.raises(nkisim.NkiUsageError, match="every process runs its own rank"):
        nkisim.run(K["ar_sbuf"], np.zeros((32, 16), np.float32), ranks=2, process_group=object())
    # without a job, a plain launch stays in-process (the automatic mode needs an initialized job)
    out = nkisim.run(K["ar_sbuf"], np.ones((32, 16), np.float32), groups=((0,),))
    np.testing.assert_array_equal(out, np.ones((32, 16), np.float32))


def test_neuron_backend_needs_the_real_nki(K):
    """backend="neuron" hands the kernel to the real nki (device and Neuron runtime carry the collectives); here the
    SDK is missing and that is reported (the device path itself is not validated in this environment)."""
    with pytest.raises(nkisim.NkiUsageError, match="needs the Neuron SDK"):
        nkisim.run(K["ar_sbuf"], np.zeros((32, 16), np.float32), backend="neuron")


def test_process_group_of_one(K, world1):
    """process_group= in a job of one process: rank_id() is the process's rank, a group of one is a local copy,
    a data run naming a rank the job does not have is refused (rule ranks), shape-only needs no peers; the automatic
    mode stays in-process for a single-process job."""
    dist = world1
    x = case_args("ar_sbuf", 0, "float32")[0]
    out = nkisim.run(K["ar_sbuf"], x, process_group=dist.group.WORLD, groups=((0,),))
    np.testing.assert_array_equal(out, x)
    assert nkisim.last_profile().ranks == 1
    with pytest.raises(NkiValidationError) as ei:
        nkisim.run(K["ar_sbuf"], x, process_group=dist.group.WORLD)
    assert ei.value.rule == "ranks"
    nkisim.run(K["ar_sbuf"], nkisim.Abstract((32, 16)), process_group=dist.group.WORLD, shape_only=True)
    assert nkisim.last_profile().collectives[0]["group_size"] == 2


def test_ranks_with_other_tensors_are_caught(K):
    """Thread ranks must agree on the tensors of a collective (NumPy would broadcast a [32, 1] into a [32, 16])."""
    args = [(np.ones((32, 16), np.float32),), (np.ones((32, 1), np.float32),)]
    ns = nkisim.load_kernel_source(KERNELS, "cc_kernels_b.py", target="trn2")
    with pytest.raises(NkiSyncError, match="other tensors"):
        nkisim.run(ns["ar_hbm"], ranks=2, rank_args=[(a[0], a[0]) for a in args])
