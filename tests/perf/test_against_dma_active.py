"""``fusegraph bench --against``: "DMA active" is the time with any DMA in flight (the union of the DMAs' windows),
not the bandwidth occupancy, which has its own row (issue 14: compare like quantities). A kernel of our own whose
DMAs overlap: per layer four independent weight loads issued back to back, then one matmul on each."""
import json
import textwrap

import pytest

from fusegraph.cli import main
from fusegraph.perf import against
from fusegraph.perf.costmodel import union_length

KERNEL = """
import nki
import nki.isa as nisa
import nki.language as nl


def body(x, ws, n_layers):
    out = nl.ndarray((128, 4), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    x_sb = nl.ndarray((128, 4), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb, src=x)
    for layer in range(n_layers):
        tiles = []
        for j in range(4):  # four loads in flight at once
            w = nl.ndarray((128, 128), dtype=nl.bfloat16, buffer=nl.sbuf, name=f"w{layer}_{j}")
            nisa.dma_copy(dst=w, src=ws[layer][j])
            tiles.append(w)
        for w in tiles:
            ps = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=ps, stationary=w, moving=x_sb)
            nisa.activation(dst=x_sb, op=nl.relu, data=ps)
    nisa.dma_copy(dst=out, src=x_sb)
    return out


@nki.jit
def overlapping(x, w00, w01, w02, w03, w10, w11, w12, w13):
    return body(x, ((w00, w01, w02, w03), (w10, w11, w12, w13)), 2)
"""

SPEC = """
from fusegraph.nkisim import Abstract
from fusegraph.perf.against import KernelSpec
import ml_dtypes

BF = ml_dtypes.bfloat16


def spec(layers=None):
    import overlap_dma_kernel
    return KernelSpec(kernel=overlap_dma_kernel.overlapping,
                      args=[Abstract((128, 4), BF)] + [Abstract((128, 128), BF)] * 8, layers=2,
                      layer_var="body:layer", target="trn3", name="overlapping-dmas")
"""


@pytest.fixture
def overlap_spec(tmp_path, monkeypatch):
    (tmp_path / "overlap_dma_kernel.py").write_text(textwrap.dedent(KERNEL))
    (tmp_path / "overlap_dma_spec.py").write_text(textwrap.dedent(SPEC))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "overlap_dma_spec.py"


def _layer_dmas(side):
    s = side.estimate.schedule
    return [i for i, w in enumerate(s.works) if w.kind == "dma" and isinstance(w.layer, int)]


def test_dma_active_is_the_union_of_windows_not_the_occupancy(overlap_spec):
    side = against.cost_spec(against.load_spec(str(overlap_spec)))
    s = side.estimate.schedule
    idx = _layer_dmas(side)
    assert len(idx) == 8  # 2 layers x 4 weight loads
    windows = sorted(s.dma_windows[i] for i in idx)
    # the precondition: the loads of a layer are in flight together
    assert any(b[0] < a[1] for a, b in zip(windows, windows[1:]))
    per = side.per_layer
    assert per["dma_active"] == pytest.approx(union_length(windows) / 2)
    assert per["dma_active"] < sum(b - a for a, b in windows) / 2 * 0.9  # overlaps count once
    occupancy = sum(s.works[i].occupancy for i in idx) / 2
    assert per["dma_occupancy"] == pytest.approx(occupancy)
    # 32 KiB loads: the fixed latency in flight dominates the bandwidth they occupy
    assert per["dma_active"] > 1.5 * per["dma_occupancy"]
    # per issuing engine: every load is triggered from the Sync queue here
    assert {k for k in per if ":" in k} == {"dma_active:sync", "dma_occupancy:sync"}
    assert per["dma_active:sync"] == pytest.approx(per["dma_active"])
    assert per["dma_occupancy:sync"] == pytest.approx(per["dma_occupancy"])


def test_bench_against_shows_both_quantities_for_both_kernels(overlap_spec, tmp_path, capsys):
    out = tmp_path / "against.json"
    assert main(["bench", "--against", str(overlap_spec), "--models", "llama-tiny", "--layers", "1",
                 "--cache-len", "16", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    active = next(ln for ln in lines if ln.startswith("DMA active (any DMA in flight)"))
    occ = next(ln for ln in lines if ln.startswith("DMA bandwidth occupancy"))
    assert active.count(" us") == 2 and occ.count(" us") == 2  # fusegraph and theirs
    assert any(ln.startswith("theirs: DMA by issuing engine, per layer (in flight / bandwidth occupancy): sync ")
               for ln in lines)
    assert any(ln.startswith("fusegraph: DMA by issuing engine") for ln in lines)
    res = json.loads(out.read_text())["results"][0]
    rows = {r["quantity"]: r for r in res["comparison"]["rows"]}
    a, o = rows["DMA active (any DMA in flight)"], rows["DMA bandwidth occupancy"]
    for side in ("fusegraph_s", "theirs_s"):
        assert a[side] > 0 and o[side] > 0 and a[side] != pytest.approx(o[side], rel=0.05)
    assert "dma" not in res["theirs"]["per_layer_s"]  # no unnamed quantity left
    assert a["theirs_s"] == pytest.approx(res["theirs"]["per_layer_s"]["dma_active"])
