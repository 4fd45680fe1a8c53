"""A ``vector_offset`` index given as a ``[P, 1, 1]`` view (one element per partition, trailing unit dims).

The ``dma_copy`` docstring (SDK stubs, ``nki/api/nki/isa/__init__.py``) describes the index as an SBUF tensor of
shape ``(P, 1)``; nki-library's ``router_topk`` (indirect DMA scatter, ``test_router_topk.py``'s "Indirect DMA
scatter" rows, hardware-tested) passes ``index_tile.ap(pattern=[[k, T], [1, 1], [1, 1]], offset=k_idx)``, a
``[T, 1, 1]`` view.  Same elements, so it is accepted; a real second free dim stays an error.
"""

import textwrap

import numpy as np
import pytest

from fusegraph import nkisim
from fusegraph.nkisim import NkiValidationError, load_kernel_source

HDR = "import nki\nimport nki.language as nl\nimport nki.isa as nisa\n"


def gather_kernel(index_pattern: str):
    src = HDR + textwrap.dedent(f"""
    @nki.jit
    def k(table, idx):
        # idx: [P, 2] uint32, column 1 holds the rows to gather (like router_topk's column k_idx)
        idx_sb = nl.ndarray((8, 2), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx_sb, src=idx)
        out_sb = nl.ndarray((8, 4), dtype=nl.float32, buffer=nl.sbuf)
        col = idx_sb.ap(pattern={index_pattern}, offset=1)
        nisa.dma_copy(dst=out_sb, src=table.ap([[4, 8], [1, 4]], offset=0, vector_offset=col, indirect_dim=0))
        out = nl.ndarray((8, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=out_sb)
        return out
    """)
    return load_kernel_source(src, "/virtual/vector_offset_views.py", target="trn2")["k"]


def _inputs():
    r = np.random.default_rng(0)
    table = r.standard_normal((16, 4)).astype(np.float32)
    idx = np.stack([np.zeros(8), r.permutation(16)[:8]], axis=1).astype(np.uint32)
    return table, idx


@pytest.mark.parametrize("pattern", ["[[2, 8], [1, 1]]", "[[2, 8], [1, 1], [1, 1]]"])
def test_index_view_with_trailing_unit_dims_gathers_rows(pattern):
    table, idx = _inputs()
    got = nkisim.run(gather_kernel(pattern), table, idx)
    np.testing.assert_array_equal(got, table[idx[:, 1]])  # a copy: exact


def test_index_view_with_two_elements_per_partition_is_rejected():
    table, idx = _inputs()
    with pytest.raises(NkiValidationError) as ei:
        nkisim.run(gather_kernel("[[2, 8], [1, 1], [1, 2]]"), table, idx)
    assert ei.value.rule == "ap"
