"""A DMA transpose is costed at O6's fraction of the DMA throughput (perf_anchors.md O6: up to 90% HBM->SBUF,
50% SBUF->SBUF), not like a plain copy of the same bytes: why, the streamed attention loads K^T with
``nisa.dma_transpose`` instead of Tensor-engine transposes, and the comparison is only honest with the cost."""
import pytest

from fusegraph.perf.costmodel import line_work
from fusegraph.perf.kernelview import KernelLine
from fusegraph.perf.params import load_params


def _line(opcode: str, src_buffer: str) -> KernelLine:
    dma = {"count": 4, "bytes": 4 * 128 * 2048, "descriptors": 4 * 128, "partitions": 128, "dge_mode": "swdge",
           "queue": "gpsimd", "src_buffer": src_buffer, "dst_buffer": "sbuf", "src_tensor": "k", "dst_tensor": "kT"}
    return KernelLine(0, 1, opcode, "L0.attn.kT_dma", "L0.attn", 0, ("k",), ("kT",), False, (), dmas=[dma])


@pytest.mark.parametrize("target", ["trn2", "trn3"])
@pytest.mark.parametrize("src,fraction", [("hbm", 0.9), ("sbuf", 0.5)])
def test_dma_transpose_moves_bytes_at_the_o6_fraction(target, src, fraction):
    hw = load_params(target)
    copy, transpose = line_work(hw, _line("dma_copy", src), 0), line_work(hw, _line("dma_transpose", src), 0)
    assert transpose.nbytes == copy.nbytes
    assert transpose.occupancy == pytest.approx(copy.occupancy / fraction)
    assert transpose.own == pytest.approx(copy.own / fraction)
    assert hw.param("dma_transpose_efficiency_" + src).source.startswith("perf_anchors.md O6")
