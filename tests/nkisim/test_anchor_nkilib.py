"""nki-library's TKG and utility kernels, unmodified, against the library's own torch references.

Every kernel runs at the rows of the library's own tests (``anchor_nkilib.py`` lists them with their test
file); rows the interpreter's SBUF model refuses although the library runs them are strict expected failures.

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
@pytest.mark.xfail(raises=A.nkisim.NkiCapacityError, strict=True,
                   reason="interpreter SBUF liveness is stricter than the compiler's (docs/interpreter.md, anchors)")
def test_nkilib_rows_over_the_interpreters_sbuf_model(case):
    A.check(case)
