"""nki-library's TKG and utility kernels, unmodified, against the library's own torch references.

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


def test_every_listed_kernel_has_a_case():
    assert sorted({c.kernel for c in CASES}) == sorted(A.KERNELS)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_nkilib_kernel_matches_torch_reference(case):
    errs = A.check(case)
    assert errs, case.name
