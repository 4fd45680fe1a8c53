"""``fusegraph bench --against`` and kernels split across files: a small two-file kernel of our own (a layer loop
in one module calling a helper in another), traced, attributed per line in both files and per layer, costed by
the same model, and printed beside fusegraph's kernel of a tiny model."""
import json
import logging
import textwrap

import pytest

from fusegraph import nkisim
from fusegraph.cli import main
from fusegraph.perf import against
from fusegraph.perf.costmodel import estimate_kernel
from fusegraph.perf.kernelview import build_view, file_lines, view_from_trace
from fusegraph.perf.params import load_params

HELPER = """
import nki.isa as nisa
import nki.language as nl


def mlp(x_sb, w_hbm, layer):
    w = nl.ndarray((128, 128), dtype=nl.bfloat16, buffer=nl.sbuf, name=f"w{layer}")
    nisa.dma_copy(dst=w, src=w_hbm)
    ps = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=ps, stationary=w, moving=x_sb)
    nisa.activation(dst=x_sb, op=nl.relu, data=ps)
"""

KERNEL = """
import nki
import nki.isa as nisa
import nki.language as nl
from two_file_helper import mlp


def body(x, ws, n_layers):
    out = nl.ndarray((128, 4), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    x_sb = nl.ndarray((128, 4), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb, src=x)
    for layer in range(n_layers):
        mlp(x_sb, ws[layer], layer)
    nisa.dma_copy(dst=out, src=x_sb)
    return out


@nki.jit
def two_layer(x, w0, w1):
    return body(x, (w0, w1), 2)
"""

SPEC = """
from fusegraph.nkisim import Abstract
from fusegraph.perf.against import KernelSpec
import ml_dtypes

BF = ml_dtypes.bfloat16


def spec(layers=None):
    import two_file_kernel
    return KernelSpec(kernel=two_file_kernel.two_layer, args=[Abstract((128, 4), BF), Abstract((128, 128), BF),
                      Abstract((128, 128), BF)], layers=2, layer_var="body:layer", target="trn3", name="two-file")


def args():
    return [Abstract((128, 4), BF), Abstract((128, 128), BF), Abstract((128, 128), BF)], {}
"""


@pytest.fixture
def two_file(tmp_path, monkeypatch):
    (tmp_path / "two_file_helper.py").write_text(textwrap.dedent(HELPER))
    (tmp_path / "two_file_kernel.py").write_text(textwrap.dedent(KERNEL))
    (tmp_path / "two_file_spec.py").write_text(textwrap.dedent(SPEC))
    monkeypatch.syspath_prepend(str(tmp_path))
    with nkisim.as_nki():
        import two_file_kernel
    return tmp_path, two_file_kernel


def _run(mod, trace=False):
    import ml_dtypes

    from fusegraph.nkisim import Abstract

    a = [Abstract((128, 4), ml_dtypes.bfloat16)] + [Abstract((128, 128), ml_dtypes.bfloat16)] * 2
    nkisim.run(mod.two_layer, *a, shape_only=True, target="trn3", trace=trace, trace_layer="body:layer")
    return nkisim.last_profile()


def test_line_view_of_the_top_file_says_what_it_leaves_out(two_file, caplog):
    tmp, mod = two_file
    prof = _run(mod)
    with caplog.at_level(logging.WARNING, logger="fusegraph.perf.kernelview"):
        view = build_view((tmp / "two_file_kernel.py").read_text(), prof, filename=str(tmp / "two_file_kernel.py"))
    assert view.other_files == {str(tmp / "two_file_helper.py"): 6}  # 2 layers x (DMA, matmul, activation)
    assert any("other file" in r.getMessage() for r in caplog.records)
    fl = file_lines(prof)
    helper = [f for f in fl if f.file.endswith("two_file_helper.py")]
    assert [(f.line, f.count) for f in helper] == [(8, 2), (10, 2), (11, 2)]
    assert helper[0].dma_count == 2 and helper[0].dma_bytes == 2 * 128 * 128 * 2
    assert helper[1].text.startswith("nisa.nc_matmul(")


def test_trace_view_attributes_every_instruction_to_its_file_line_and_layer(two_file):
    _, mod = two_file
    prof = _run(mod, trace=True)
    view = view_from_trace(prof.trace[(0, 0)])
    assert [(ln.file.rsplit("/", 1)[-1], ln.opcode, ln.layer) for ln in view.lines] == [
        ("two_file_kernel.py", "dma_copy", None),
        *[("two_file_helper.py", op, layer) for layer in (0, 1) for op in ("dma_copy", "nc_matmul", "activation")],
        ("two_file_kernel.py", "dma_copy", None),
    ]
    est = estimate_kernel(view, load_params("trn3"))
    s = est.schedule
    # the matmul waits for its weight DMA and the activation; layer 1's matmul waits for layer 0's activation
    assert s.start[2] >= s.ready[1] and s.start[3] >= s.ready[2] and s.start[5] >= s.ready[3]
    per, attributed = against.per_layer_figures(est, 2)
    assert attributed and per["wall"] > 0 and per["tensor"] > 0 and per["dma_occupancy"] > 0
    assert per["dma_active"] > per["dma_occupancy"]  # one small DMA per layer: its 1.3 us latency is in flight
    assert per["wall"] == pytest.approx((est.layers[0].wall + est.layers[1].wall) / 2)


def test_cost_spec_and_both_ways_of_naming_a_kernel(two_file):
    tmp, _ = two_file
    spec = against.load_spec(str(tmp / "two_file_spec.py"))
    side = against.cost_spec(spec)
    assert side.attributed and side.layers == 2 and side.info["instructions"] == 8
    assert set(side.info["files"]) == {"two_file_kernel.py", "two_file_helper.py"}
    assert {r["file"].rsplit("/", 1)[-1] for r in side.lines} == {"two_file_kernel.py", "two_file_helper.py"}
    # the kernel named directly, its arguments from another spec
    spec2 = against.load_spec("two_file_kernel:two_layer", f"{tmp / 'two_file_spec.py'}:args")
    side2 = against.cost_spec(spec2)
    assert side2.estimate.seconds == pytest.approx(side.estimate.seconds) and not side2.attributed
    assert side2.per_layer["wall"] == pytest.approx(side2.estimate.seconds)  # one layer: the whole kernel


def test_bench_against_prints_both_kernels_per_layer_and_engine(two_file, capsys):
    tmp, _ = two_file
    out = tmp / "against.json"
    assert main(["bench", "--against", str(tmp / "two_file_spec.py"), "--models", "llama-tiny", "--layers", "1",
                 "--cache-len", "16", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for row in ("wall", "Sync (DMA issue)", "DMA active (any DMA in flight)", "DMA bandwidth occupancy", "Tensor",
                "Vector", "Scalar", "GpSimd", "collectives"):
        assert row in text
    assert "two_file_helper.py:" in text  # line attribution in the helper file
    data = json.loads(out.read_text())
    res = data["results"][0]
    rows = {r["quantity"]: r for r in res["comparison"]["rows"]}
    assert rows["wall"]["fusegraph_s"] > 0 and rows["wall"]["theirs_s"] > 0
    assert rows["wall"]["ratio"] == pytest.approx(rows["wall"]["theirs_s"] / rows["wall"]["fusegraph_s"])
    assert res["fusegraph"]["layers"] == 1 and res["theirs"]["per_layer_attributed"]


def test_a_spec_model_fusegraph_does_not_bundle_is_not_run_not_a_crash():
    """A spec may name a model fusegraph has no bundled config for (the GPT-OSS hand kernel's gpt-oss-20b): with a
    shard, fusegraph's side is a 'not run' row naming why, and the comparison still prints their side."""
    from fusegraph.modelperf.against import cost_generated

    r = cost_generated("gpt-oss-20b", "trn3", layers=2, cache_len=640, shard=(8, 1))
    assert isinstance(r, str) and r.startswith("not run: unknown model 'gpt-oss-20b'")
