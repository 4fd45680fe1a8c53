"""Source lines of instructions: O(1) per lookup (cached f_lasti -> line tables), equal to ``frame.f_lineno``."""

import sys
import time

from fusegraph import nkisim
from fusegraph.nkisim import Abstract, location

HDR = "import nki\nimport nki.language as nl\nimport nki.isa as nisa\n"


def _generated(n: int, filename: str):
    """A function of ~n lines calling ``probe`` from plain, multi-line, looped and nested-call statements."""
    body = []
    for i in range(n):
        if i % 7 == 3:
            body.append("    x = probe(\n        x,\n    )")
        elif i % 11 == 5:
            body.append("    for _ in range(2):\n        x = probe(x)")
        elif i % 13 == 1:
            body.append("    x = (probe(x) if x >= 0 else\n         probe(probe(x)))")
        else:
            body.append(f"    x = probe(x)  # {i}")
    src = "def f(probe, x):\n" + "\n".join(body) + "\n    return x\n"
    ns: dict = {}
    exec(compile(src, filename, "exec"), ns)
    return ns["f"]


def test_frame_line_equals_f_lineno_everywhere():
    f = _generated(1500, "<gen-lines>")
    seen = []

    def probe(x):
        fr = sys._getframe(1)
        seen.append((location.frame_line(fr), fr.f_lineno))
        return x

    f(probe, 0)
    assert len(seen) > 1500
    assert all(a == b for a, b in seen), [s for s in seen if s[0] != s[1]][:5]
    table = location.line_table(f.__code__)
    assert table is not None and location.line_table(f.__code__) is table  # built once, then cached


def test_small_functions_use_f_lineno_and_the_cache_is_bounded():
    def small():
        return location.frame_line(sys._getframe())

    assert small() == small.__code__.co_firstlineno + 1
    assert location.line_table(small.__code__) is None
    for i in range(location.MAX_TABLES + 5):
        location.line_table(compile(f"x = {i}", f"<c{i}>", "exec"))
    assert len(location._tables) <= location.MAX_TABLES
    location.clear_cache()
    assert not location._tables


def _kernel(n: int):
    body = "\n".join("    nisa.memset(dst=t, value=0.0)" for _ in range(n))
    src = HDR + ("@nki.jit\ndef k(x):\n    t = nl.ndarray(shape=(128, 8), dtype=nl.float32, buffer=nl.sbuf)\n"
                 f"{body}\n    return x\n")
    return nkisim.load_kernel_source(src, f"/virtual/straight_line_{n}.py")["k"]


def _per_instruction(n: int) -> float:
    fn = _kernel(n)
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        nkisim.run(fn, Abstract((128, 8), "float32"), shape_only=True)
        best = min(best, time.perf_counter() - t0)
    p = nkisim.last_profile()
    assert p.instructions == n and p.sites[-1].line == n + 6  # every instruction on its own line
    return best / n


def test_profile_time_per_instruction_does_not_grow_with_kernel_length():
    # With f_lineno (an O(position) scan on CPython 3.11+) the 20k-line kernel costs ~7x more per instruction
    # than the 2k-line one; with the cached tables the two are within noise.
    small = _per_instruction(2_000)
    large = _per_instruction(20_000)
    assert large < 3 * small, (small, large)
