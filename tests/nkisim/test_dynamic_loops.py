"""``nl.dynamic_range`` is a hardware loop: the body is traced once and replayed per iteration (fusegraph.nkisim.loops).

Sources (aws-neuron-sdk mirror): SDK 2.29 and newer ``nki/deep-dives/nki-dynamic-loops.rst`` (called *loops page*
below) and ``nki/get-started/nki-language-guide.rst`` ("Dynamic Control Flow", the *language guide*).
"""

from __future__ import annotations

import numpy as np
import pytest

from fusegraph import nkisim
from fusegraph.nkisim import load_kernel_source
from fusegraph.nkisim.errors import NkiValidationError

HDR = "import nki\nimport nki.language as nl\nimport nki.isa as nisa\n"
RNG = np.random.default_rng(7)


def build(body: str, name: str = "k"):
    path = f"/virtual/dynamic_loops_{abs(hash(body))}.py"
    return load_kernel_source(HDR + body, path, target="trn2")[name], path


def run(body: str, *args, **kw):
    k, _ = build(body)
    return nkisim.run(k, *args, **kw)


def count(n: int) -> np.ndarray:
    return np.array([[n]], dtype=np.int32)


_REG = """
    c = nl.ndarray(shape=(1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=c, src=n)
    r = nisa.register_alloc()
    nisa.register_load(r, c)
"""


def test_replayed_instructions_are_profiled_at_their_body_line():
    """Loops page, 'Hardware Lowering': "a single copy of the body is generated and the hardware iterates over it";
    each replayed iteration's instructions are counted at their own body line (one site, count = trips), as the
    cost model's hardware-loop schedule (fusegraph/perf/hwloops.py) expects."""
    k, path = build("""
@nki.jit
def k(n):
    o = nl.ndarray(shape=(1, 4), dtype=nl.float32, buffer=nl.shared_hbm)
""" + _REG + """
    acc = nl.zeros((1, 4), dtype=nl.float32)
    for i in nl.dynamic_range(r):
        nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=2.0)
    nisa.dma_copy(dst=o, src=acc)
    return o
""")
    out = nkisim.run(k, count(5))
    np.testing.assert_array_equal(out, np.full((1, 4), 10.0, np.float32))
    sites = [s for s in nkisim.last_profile().sites if s.opcode == "tensor_scalar"]
    assert len(sites) == 1 and sites[0].count == 5 and sites[0].file == path


def test_python_body_traced_once():
    """Loops page: the body is traced once, not executed as Python per iteration."""
    traces: list = []
    k, _ = build("""
@nki.jit
def k(n, hook):
    o = nl.ndarray(shape=(1, 4), dtype=nl.float32, buffer=nl.shared_hbm)
""" + _REG + """
    acc = nl.zeros((1, 4), dtype=nl.float32)
    for i in nl.dynamic_range(r):
        hook(i)
        nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
    nisa.dma_copy(dst=o, src=acc)
    return o
""")
    out = nkisim.run(k, count(4), traces.append)
    np.testing.assert_array_equal(out, np.full((1, 4), 4.0, np.float32))
    assert len(traces) == 1


def test_body_tensors_are_allocated_once_and_reused():
    """Loops page, 'Register Allocation Implications': "Tensors allocated inside the loop body are allocated once
    and reused across iterations" -- a tile allocated in the body keeps its contents from the previous iteration,
    and a replayed nl.zeros re-zeroes the same tile."""
    out = run("""
@nki.jit
def k(n, hook):
    o = nl.ndarray(shape=(2, 4), dtype=nl.float32, buffer=nl.shared_hbm)
""" + _REG + """
    first = nl.ndarray(shape=(1, 4), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=first, value=1.0)
    for i in nl.dynamic_range(r):
        z = nl.zeros((1, 4), dtype=nl.float32)
        nisa.tensor_scalar(dst=z, data=z, op0=nl.add, operand0=3.0)
        t = nl.ndarray(shape=(1, 4), dtype=nl.float32, buffer=nl.sbuf)
        hook(t)
        nisa.tensor_copy(dst=t, src=first)
        nisa.tensor_scalar(dst=first, data=t, op0=nl.add, operand0=1.0)
    nisa.dma_copy(dst=o[0:1, :], src=z)
    nisa.dma_copy(dst=o[1:2, :], src=first)
    return o
""", count(3), lambda t: None, trace=True)
    np.testing.assert_array_equal(out[0], np.full(4, 3.0, np.float32))  # re-zeroed each iteration: 3, not 9
    np.testing.assert_array_equal(out[1], np.full(4, 4.0, np.float32))
    events = nkisim.last_profile().trace[(0, 0)]
    copies = [e for e in events if e.opcode == "tensor_copy"]
    assert len(copies) == 3 and len({e.writes for e in copies}) == 1  # one tile t, written by all 3 iterations


def test_rebound_name_is_not_a_new_tensor_per_iteration():
    """Loops page (the body is traced once): `acc = new` rebinds a Python name after the instruction was traced, so
    every iteration adds x to the *outer* acc: the result is 1x, not 3x."""
    x = RNG.standard_normal((1, 4)).astype(np.float32)
    out = run("""
@nki.jit
def k(n, x):
    o = nl.ndarray(shape=(1, 4), dtype=nl.float32, buffer=nl.shared_hbm)
""" + _REG + """
    xs = nl.ndarray(shape=(1, 4), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=xs, src=x)
    acc = nl.zeros((1, 4), dtype=nl.float32)
    for i in nl.dynamic_range(r):
        new = nl.ndarray(shape=(1, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=new, data1=acc, data2=xs, op=nl.add)
        acc = new
    nisa.dma_copy(dst=o, src=acc)
    return o
""", count(3), x)
    np.testing.assert_array_equal(out, x)


def test_matmul_accumulate_none_is_one_static_flag():
    """nc_matmul has one acc_flags; traced once (loops page), accumulate=None onto an outer PSUM tile decides
    'overwrite' when traced (fresh PSUM) and overwrites in every iteration: 1x, not 3x."""
    a = RNG.standard_normal((16, 8)).astype(np.float32)
    b = RNG.standard_normal((16, 12)).astype(np.float32)
    out = run("""
@nki.jit
def k(n, a, b):
    o = nl.ndarray(shape=(8, 12), dtype=nl.float32, buffer=nl.shared_hbm)
""" + _REG + """
    sa = nl.ndarray(shape=(16, 8), dtype=nl.float32, buffer=nl.sbuf)
    sb = nl.ndarray(shape=(16, 12), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=sa, src=a)
    nisa.dma_copy(dst=sb, src=b)
    ps = nl.ndarray(shape=(8, 12), dtype=nl.float32, buffer=nl.psum)
    for _ in nl.dynamic_range(r):
        nisa.nc_matmul(dst=ps, stationary=sa, moving=sb)
    res = nl.ndarray(shape=(8, 12), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res, src=ps)
    nisa.dma_copy(dst=o, src=res)
    return o
""", count(3), a, b)
    np.testing.assert_allclose(out, a.T @ b, rtol=1e-5, atol=1e-5)
    assert [s.count for s in nkisim.last_profile().sites if s.opcode == "nc_matmul"] == [3]


def test_explicit_accumulate_in_loop_accumulates():
    """accumulate=True is the static flag the loop needs to sum over iterations (after an overwrite before it)."""
    a = RNG.standard_normal((16, 8)).astype(np.float32)
    b = RNG.standard_normal((16, 12)).astype(np.float32)
    out = run("""
@nki.jit
def k(n, a, b):
    o = nl.ndarray(shape=(8, 12), dtype=nl.float32, buffer=nl.shared_hbm)
""" + _REG + """
    sa = nl.ndarray(shape=(16, 8), dtype=nl.float32, buffer=nl.sbuf)
    sb = nl.ndarray(shape=(16, 12), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=sa, src=a)
    nisa.dma_copy(dst=sb, src=b)
    ps = nl.ndarray(shape=(8, 12), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=ps, stationary=sa, moving=sb, accumulate=False)
    for _ in nl.dynamic_range(r):
        nisa.nc_matmul(dst=ps, stationary=sa, moving=sb, accumulate=True)
    res = nl.ndarray(shape=(8, 12), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res, src=ps)
    nisa.dma_copy(dst=o, src=res)
    return o
""", count(3), a, b)
    np.testing.assert_allclose(out, 4 * (a.T @ b), rtol=1e-5, atol=1e-5)


_ROWS = """
@nki.jit
def k(n, x):
    o = nl.ndarray(shape=(8, 4), dtype=nl.float32, buffer=nl.shared_hbm)
""" + _REG + """
    t = nl.ndarray(shape=(1, 4), dtype=nl.float32, buffer=nl.sbuf)
    for i in nl.dynamic_range(1, r, 2):
        nisa.dma_copy(dst=t, src=x.ap(pattern=[[4, 1], [1, 4]], scalar_offset=i, indirect_dim=0){MODE})
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(dst=o.ap(pattern=[[4, 1], [1, 4]], scalar_offset=i, indirect_dim=0), src=t)
    return o
"""


def test_induction_register_addresses_each_iteration():
    """Loops page, 'Runtime trip count': the induction variable is a register usable as .ap(scalar_offset=i); the
    replayed DMAs address row i of each iteration (start 1, step 2)."""
    x = RNG.standard_normal((8, 4)).astype(np.float32)
    out = run(_ROWS.replace("{MODE}", ""), count(8), x, )
    rows = [1, 3, 5, 7]
    np.testing.assert_array_equal(out[rows], 2 * x[rows])


def test_dge_none_dma_with_induction_register_rejected():
    """A runtime scalar_offset needs a DGE (the same rule as for a loaded register, rule dge-mode): the induction
    variable is a register (loops page, language guide 'Dynamic Control Flow')."""
    x = RNG.standard_normal((8, 4)).astype(np.float32)
    with pytest.raises(NkiValidationError, match=r"\[dge-mode\]"):
        run(_ROWS.replace("{MODE}", ", dge_mode=nisa.dge_mode.none"), count(8), x)


def test_register_step_rejected():
    """Loops page, 'Parameter Constraints': the step "Must be a compile-time positive integer. Passing a
    VirtualRegister raises"."""
    with pytest.raises(NkiValidationError, match=r"\[loop\].*step must be a compile-time positive int"):
        run("""
@nki.jit
def k(n):
""" + _REG + """
    for i in nl.dynamic_range(0, 8, r):
        pass
    return None
""", count(2))


@pytest.mark.parametrize("step", ["0", "-1", "1.5"])
def test_non_positive_or_non_int_step_rejected(step):
    """Loops page, 'Parameter Constraints': step is a compile-time *positive* int."""
    with pytest.raises(NkiValidationError, match=r"\[loop\]"):
        run(f"""
@nki.jit
def k():
    for i in nl.dynamic_range(0, 8, {step}):
        pass
    return None
""")


def test_dynamic_range_inside_no_reorder_rejected():
    """Loops page, 'Interaction with no_reorder': "dynamic_range loops inside a nl.no_reorder() block are not
    currently supported"; no_reorder inside the loop body is the documented workaround."""
    with pytest.raises(NkiValidationError, match=r"\[loop\].*no_reorder"):
        run("""
@nki.jit
def k():
    with nl.no_reorder():
        for i in nl.dynamic_range(4):
            pass
    return None
""")
    out = run("""
@nki.jit
def k():
    o = nl.ndarray(shape=(1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    acc = nl.zeros((1, 1), dtype=nl.float32)
    for i in nl.dynamic_range(4):
        with nl.no_reorder():
            nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
    with nl.no_reorder():
        for j in nl.static_range(2):
            nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
    nisa.dma_copy(dst=o, src=acc)
    return o
""")
    assert float(out[0, 0]) == 6.0


@pytest.mark.parametrize("cond", ["i == 0", "i", "i > 1", "not i"])
def test_python_if_on_induction_variable_rejected(cond):
    """Loops page, 'Hardware Lowering': "The loop variable is a device register, not a Python int. You cannot use
    it in host-side Python expressions (e.g., if i == 0:)"."""
    with pytest.raises(NkiValidationError, match=r"\[loop\].*register"):
        run(f"""
@nki.jit
def k():
    acc = nl.zeros((1, 1), dtype=nl.float32)
    for i in nl.dynamic_range(4):
        if {cond}:
            nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
    return None
""")


@pytest.mark.parametrize("use", ["range(r)", "range(i)", "[0, 1, 2][i:]", "i * 128", "int(r)"])
def test_builtin_range_and_python_use_of_registers_rejected(use):
    """Language guide, 'Dynamic Control Flow': a VirtualRegister "holds a value that exists at runtime" (loop bound
    of dynamic_range, while condition, scalar_offset) -- builtin range() of it and Python arithmetic on it are not
    NKI; the interpreter used to run range(register) with the register's value."""
    with pytest.raises(NkiValidationError, match=r"\[loop\].*runtime value"):
        run("""
@nki.jit
def k(n):
""" + _REG + f"""
    for i in nl.dynamic_range(2):
        v = {use}
    return None
""", count(3))


def test_induction_register_is_frozen():
    """Language guide, 'Dynamic Control Flow': the induction variable "is frozen: you cannot write to it with
    register_move or register_load"; moving it into another register is fine (and recorded in the profile)."""
    for write in ("nisa.register_move(i, 3)", "nisa.register_load(i, c)"):
        with pytest.raises(NkiValidationError, match=r"\[register\].*frozen"):
            run("""
@nki.jit
def k(n):
""" + _REG + f"""
    for i in nl.dynamic_range(2):
        {write}
    return None
""", count(3))


def test_register_move_is_profiled_and_carries_the_induction_value():
    """register_move is a register instruction like register_load/store: one profile record per execution (same
    shape: gpsimd, 1x1), and a register moved from the induction variable carries each iteration's value."""
    x = RNG.standard_normal((4, 4)).astype(np.float32)
    out = run("""
@nki.jit
def k(n, x):
    o = nl.ndarray(shape=(4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
""" + _REG + """
    v = nisa.register_alloc(0)
    t = nl.ndarray(shape=(1, 4), dtype=nl.float32, buffer=nl.sbuf)
    for i in nl.dynamic_range(r):
        nisa.register_move(dst=v, src=i)
        nisa.dma_copy(dst=t, src=x.ap(pattern=[[4, 1], [1, 4]], scalar_offset=v, indirect_dim=0))
        nisa.dma_copy(dst=o.ap(pattern=[[4, 1], [1, 4]], scalar_offset=v, indirect_dim=0), src=t)
    return o
""", count(4), x)
    np.testing.assert_array_equal(out, x)
    p = nkisim.last_profile()
    mv = [s for s in p.sites if s.opcode == "register_move"]
    ld = [s for s in p.sites if s.opcode == "register_load"]
    assert len(mv) == 1 and mv[0].count == 4 and mv[0].engine == "gpsimd" == ld[0].engine
    assert (mv[0].max_partitions, mv[0].max_free) == (ld[0].max_partitions, ld[0].max_free) == (1, 1)


def test_nested_dynamic_loops_replay_the_inner_loop():
    """A dynamic loop in a dynamic loop's body (loops page: each is one hardware loop with one body): the inner
    loop is replayed as a whole by every outer iteration, its bound read each time (a register loaded in the
    outer body)."""
    out = run("""
@nki.jit
def k(n):
    o = nl.ndarray(shape=(1, 2), dtype=nl.float32, buffer=nl.shared_hbm)
""" + _REG + """
    acc = nl.zeros((1, 2), dtype=nl.float32)
    inner = nisa.register_alloc()
    for i in nl.dynamic_range(3):
        nisa.register_load(inner, c)
        for j in nl.dynamic_range(inner):
            nisa.tensor_scalar(dst=acc[:, 0:1], data=acc[:, 0:1], op0=nl.add, operand0=1.0)
        nisa.tensor_scalar(dst=acc[:, 1:2], data=acc[:, 1:2], op0=nl.add, operand0=1.0)
        nisa.tensor_scalar(dst=c, data=c, op0=nl.add, operand0=1)
    nisa.dma_copy(dst=o, src=acc)
    return o
""", count(2))
    assert out.tolist() == [[2.0 + 3.0 + 4.0, 3.0]]


def test_zero_trip_loop_runs_nothing():
    """A loop with no iteration executes no instruction (its body is not traced by the interpreter)."""
    out = run("""
@nki.jit
def k(n):
    o = nl.ndarray(shape=(1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
""" + _REG + """
    acc = nl.zeros((1, 1), dtype=nl.float32)
    for i in nl.dynamic_range(5, r):
        nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
    nisa.dma_copy(dst=o, src=acc)
    return o
""", count(3))
    assert float(out[0, 0]) == 0.0


def test_nested_loop_untraced_at_first_then_run_is_not_implemented():
    """The interpreter traces a body only when it runs: an inner loop with no iteration in the outer loop's traced
    (first) iteration and some later cannot be replayed -- a clear not-implemented error, never wrong numbers."""
    from fusegraph.nkisim.errors import NkiNotImplementedError

    with pytest.raises(NkiNotImplementedError, match=r"\[not-implemented\].*nested nl.dynamic_range"):
        run("""
@nki.jit
def k(n):
""" + _REG + """
    acc = nl.zeros((1, 1), dtype=nl.float32)
    inner = nisa.register_alloc()
    for i in nl.dynamic_range(3):
        nisa.register_load(inner, c)
        for j in nl.dynamic_range(inner):
            nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
        nisa.tensor_scalar(dst=c, data=c, op0=nl.add, operand0=1)
    return None
""", count(0))


def test_break_out_of_the_body_rejected():
    """Loops page: the hardware runs the one body every iteration; leaving it with break is not a hardware loop."""
    with pytest.raises(NkiValidationError, match=r"\[loop\].*break"):
        run("""
@nki.jit
def k():
    acc = nl.zeros((1, 1), dtype=nl.float32)
    for i in nl.dynamic_range(4):
        nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
        break
    return None
""")


def test_error_in_a_replayed_iteration_names_the_body_line():
    """An iteration that goes out of bounds (row 8 of 8 at i = 8) fails on the body's line, not the for line."""
    body = """
@nki.jit
def k(n, x):
    o = nl.ndarray(shape=(8, 4), dtype=nl.float32, buffer=nl.shared_hbm)
""" + _REG + """
    t = nl.ndarray(shape=(1, 4), dtype=nl.float32, buffer=nl.sbuf)
    for i in nl.dynamic_range(0, r, 4):
        nisa.dma_copy(dst=t, src=x.ap(pattern=[[4, 1], [1, 4]], scalar_offset=i, indirect_dim=0))
    return o
"""
    k, path = build(body)
    line = 1 + next(n for n, text in enumerate((HDR + body).splitlines()) if "scalar_offset=i" in text)
    x = RNG.standard_normal((8, 4)).astype(np.float32)
    nkisim.run(k, count(8), x)  # rows 0 and 4
    with pytest.raises(NkiValidationError) as e:
        nkisim.run(k, count(9), x)  # rows 0, 4, 8
    assert e.value.location == f"{path}:{line}", e.value.location


def test_shape_only_run_counts_every_iteration():
    """A shape-only run replays the body with the assumed register values: the same instruction counts."""
    k, _ = build("""
@nki.jit
def k(n):
    o = nl.ndarray(shape=(1, 4), dtype=nl.float32, buffer=nl.shared_hbm)
""" + _REG + """
    acc = nl.zeros((1, 4), dtype=nl.float32)
    for i in nl.dynamic_range(r):
        nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=2.0)
    nisa.dma_copy(dst=o, src=acc)
    return o
""")
    nkisim.run(k, count(6))
    data = nkisim.last_profile().counters()
    nkisim.run(k, nkisim.Abstract((1, 1), "int32"), shape_only=True, assume=6)
    assert nkisim.last_profile().counters() == data


def _nkilib():
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import anchor_nkilib as A  # noqa: E402 - the anchor tests' loader (NKILIB=<dir holding nkilib>)

    return A


@pytest.mark.slow
@pytest.mark.parametrize("m_dim, h_dim", [(128, 512), (256, 1024), (1024, 2048)])
def test_nkilib_dynamic_elementwise_add_at_its_test_shapes(m_dim, h_dim):
    """nki-library's hardware-tested ``experimental/dynamic_shapes/dynamic_elementwise_add`` (unmodified; shapes of
    its ``test_dynamic_elementwise_add.py``): a ``dynamic_range`` over a loaded register whose body reads an SBUF
    offset the body itself advances (``tensor_scalar`` += 128): replayed, every M tile is added; only the first
    ``num_m_tiles`` tiles are written (a trip count below M // 128 leaves the rest untouched)."""
    A = _nkilib()
    if A.nkilib_root() is None:
        pytest.skip(f"{A.ENV} is not set to a directory holding nkilib")
    import ml_dtypes

    mod = A.load("experimental.dynamic_shapes.dynamic_elementwise_add")
    ref = A.load("experimental.dynamic_shapes.dynamic_elementwise_add_torch").dynamic_elementwise_add_torch_ref
    a = RNG.standard_normal((m_dim, h_dim)).astype(ml_dtypes.bfloat16)
    b = RNG.standard_normal((m_dim, h_dim)).astype(ml_dtypes.bfloat16)
    import torch

    want = ref(torch.from_numpy(a.astype(np.float32)), torch.from_numpy(b.astype(np.float32))).numpy()
    out = np.asarray(nkisim.run(mod.dynamic_elementwise_add, a, b, count(m_dim // 128), target="trn2"))
    np.testing.assert_allclose(out.astype(np.float32), want, rtol=1e-2, atol=1e-3)
    assert [s.count for s in nkisim.last_profile().sites if s.opcode == "tensor_tensor"] == [m_dim // 128 * (h_dim // 512)]
    if m_dim > 128:  # fewer trips than tiles: the rows after them are never written
        part = np.asarray(nkisim.run(mod.dynamic_elementwise_add, a, b, count(1), target="trn2")).astype(np.float32)
        np.testing.assert_allclose(part[:128], want[:128], rtol=1e-2, atol=1e-3)


_WHILE = """
@nki.jit
def k(n, hook):
    o = nl.ndarray(shape=(1, 4), dtype=nl.float32, buffer=nl.shared_hbm)
""" + _REG + """
    acc = nl.zeros((1, 4), dtype=nl.float32)
    while r:
        hook(r)
        nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=2.0)
        nisa.tensor_scalar(dst=c, data=c, op0=nl.subtract, operand0=1)
        nisa.register_load(r, c)
    nisa.dma_copy(dst=o, src=acc)
    return o
"""


@pytest.mark.parametrize("n", [1, 5])
def test_while_register_loop_is_traced_once_and_replayed(n):
    """Language guide, 'Dynamic Control Flow': `while reg:` is a hardware loop, like dynamic_range (one body the
    hardware re-runs while the register is non-zero; the body's register_load decides when it stops). The Python
    body runs once; every iteration's instructions are counted at their body line."""
    traces: list = []
    k, path = build(_WHILE)
    out = nkisim.run(k, count(n), traces.append)
    np.testing.assert_array_equal(out, np.full((1, 4), 2.0 * n, np.float32))
    assert len(traces) == 1
    sites = [s for s in nkisim.last_profile().sites if s.opcode == "tensor_scalar"]
    assert sorted(s.count for s in sites) == [n, n] and all(s.file == path for s in sites)


def test_while_register_zero_runs_nothing():
    traces: list = []
    out = run(_WHILE, count(0), traces.append)
    assert float(out[0, 0]) == 0.0 and traces == []


def test_while_register_that_never_reaches_zero_is_a_runaway_loop(monkeypatch):
    """A body that never writes its condition register would spin forever on hardware: the interpreter stops after
    WHILE_MAX_ITERATIONS replays with a [loop] error (instead of hanging a test or a forward pass)."""
    from fusegraph.nkisim import loops

    monkeypatch.setattr(loops, "WHILE_MAX_ITERATIONS", 10)
    with pytest.raises(NkiValidationError, match=r"\[loop\].*after 10 replayed iterations"):
        run(_WHILE.replace("        nisa.register_load(r, c)\n", ""), count(2), lambda r: None)


def test_if_on_a_register_rejected():
    """Only `while reg:` is NKI; `if reg:` asks the kernel's Python for a runtime value (the test never comes back)."""
    with pytest.raises(NkiValidationError, match=r"\[loop\].*only `while reg:` is NKI"):
        run("""
@nki.jit
def k(n):
""" + _REG + """
    acc = nl.zeros((1, 1), dtype=nl.float32)
    if r:
        nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
    return None
""", count(2))


def test_while_in_a_dynamic_loop_is_replayed_as_a_whole():
    """A `while reg:` in a dynamic_range body: each outer iteration re-runs the inner hardware loop from the register
    its body loads (1 + 2 + 3 inner iterations for counts 1, 2, 3)."""
    out = run("""
@nki.jit
def k(n):
    o = nl.ndarray(shape=(1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
""" + _REG + """
    acc = nl.zeros((1, 1), dtype=nl.float32)
    w = nisa.register_alloc()
    left = nl.ndarray(shape=(1, 1), dtype=nl.int32, buffer=nl.sbuf)
    for i in nl.dynamic_range(3):
        nisa.tensor_copy(dst=left, src=c)
        nisa.register_load(w, left)
        while w:
            nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
            nisa.tensor_scalar(dst=left, data=left, op0=nl.subtract, operand0=1)
            nisa.register_load(w, left)
        nisa.tensor_scalar(dst=c, data=c, op0=nl.add, operand0=1)
    nisa.dma_copy(dst=o, src=acc)
    return o
""", count(1))
    assert float(out[0, 0]) == 6.0
