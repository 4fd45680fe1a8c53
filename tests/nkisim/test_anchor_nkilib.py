"""nki-library's TKG and utility kernels, unmodified, against the library's own torch references.

Every kernel runs at the rows of the library's own tests (``anchor_nkilib.py`` lists them with their test
file). Rows whose live SBUF exceeds the partition (nki-library's RoPE at its long-sequence rows, one
output-projection row) run under ``sbuf_overflow="compiler"``, the way neuronx-cc's allocator fits them (spilling);
their test also checks that the over-budget demand was recorded, and that the default mode still refuses them.

Needs a checkout: ``NKILIB=<dir holding the nkilib package>`` (``shared/tools/prepare_anchors.sh``).  Marked slow
and skipped cleanly without it; the cases themselves live in ``anchor_nkilib.py`` (also runnable as a script).
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import anchor_nkilib as A  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(A.nkilib_root() is None, reason=f"{A.ENV} is not set to a directory holding nkilib"),
]

CASES = A.cases()
OVER = A.over_capacity_cases()


def test_every_listed_kernel_has_a_case():
    assert sorted({c.kernel for c in CASES}) == sorted(A.KERNELS)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_nkilib_kernel_matches_torch_reference(case):
    errs = A.check(case)
    assert errs, case.name


def test_case_names_are_unique():
    names = [c.name for c in CASES + OVER]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("case", OVER, ids=[c.name for c in OVER])
def test_nkilib_rows_over_the_partition_run_as_the_compiler_fits_them(case, monkeypatch):
    """Hardware-tested rows the interpreter used to reject: their live compiler-placed SBUF exceeds the budget.
    Under ``sbuf_overflow="compiler"`` they match their torch reference and the profile names the over-budget
    peak; under the default ("error", fusegraph's policy for its own kernels) they are still refused."""
    monkeypatch.setenv(A.nkisim.memory.ENV_SBUF_OVERFLOW, "compiler")
    errs = A.check(case)
    assert errs, case.name
    prof = A.nkisim.last_profile()
    assert prof.sbuf_over_budget_bytes > prof.sbuf_budget_bytes, prof.summary()
    monkeypatch.setenv(A.nkisim.memory.ENV_SBUF_OVERFLOW, "error")
    with pytest.raises(A.nkisim.NkiCapacityError, match="sbuf_overflow='compiler'"):
        A.check(case)
