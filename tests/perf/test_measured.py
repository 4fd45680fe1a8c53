"""The measured-kernel registry (``fusegraph.perf.measured``): its data file is complete and honest (every figure
a point or an upper bound with its source and derivation, every spec a real factory), kernels whose checkout is
absent are listed with a reason instead of being faked, and a kernel's deployment parameters reach its costing."""
import os

import pytest

from fusegraph.perf import crossval as X
from fusegraph.perf import measured as M
from fusegraph.perf.fit import FIGURES
from fusegraph.perf.params import load_params

from .test_fit import view  # noqa: F401


def test_every_entry_is_complete():
    entries = M.entries()
    names = [e.name for e in entries]
    assert len(set(names)) == len(names) >= 4
    assert "qwen3-30b-a3b O1" in names and "gpt-oss-20b exp 7" in names
    for e in entries:
        assert "wall" in e.targets, e.name  # the per-layer wall is what a modeled time is quoted on
        for f, v in e.targets.items():
            assert f in FIGURES, (e.name, f)
            if isinstance(v, tuple):
                assert v[0] == 0.0 and v[1] > 0, (e.name, f)  # an upper bound, never a made-up interval
            else:
                assert 1e-6 < v < 1e-3, (e.name, f, v)  # microseconds per layer
            assert e.sources.get(f), (e.name, f)
        assert e.spec.count(":") == 1
    gpt = {e.name: e for e in entries if e.name.startswith("gpt-oss")}
    assert {e.spec_kwargs["variant"] for e in gpt.values()} == {"exp7", "exp6", "canonical"}
    # a whole-profile engine time that holds the LM head is only an upper bound per layer
    assert isinstance(gpt["gpt-oss-20b exp 7"].targets["sync"], tuple)
    assert gpt["gpt-oss-20b exp 7"].deployment == {"dma_default_trigger": "swdge_gpsimd", "dma_runtime_offset_issue": 5.2e-07}


def test_absent_checkouts_are_listed_not_faked(monkeypatch):
    for var in ("MK", "MK_GPTOSS", "MK_GPTOSS_EXP7", "MK_GPTOSS_EXP6", "MK_GPTOSS_CANONICAL", "NKILIB",
                "NKILIB_GPTOSS_CANONICAL"):
        monkeypatch.delenv(var, raising=False)
    got, missing = M.available(layers=2)
    assert got == []
    assert set(missing) == {e.name for e in M.entries()}
    assert all(why and "\n" not in why for why in missing.values())


def test_deployment_parameters_reach_the_costing(view):  # noqa: F811
    hw = load_params("trn3")
    plain = X.MeasuredKernel("plain", view, {"sync": 1e-6}, {})
    swdge = X.MeasuredKernel("swdge", view, {"sync": 1e-6}, {}, deployment={"dma_default_trigger": "swdge_gpsimd"})
    a, b = plain.modeled(hw), swdge.modeled(hw)
    assert a["sync"] > 0 and b["sync"] == 0.0  # the small kernel's DMAs name no mode: the compiler's choice
    assert b["gpsimd"] > a["gpsimd"]


@pytest.mark.skipif(not (os.environ.get("MK") and os.environ.get("NKILIB")), reason="needs MK and NKILIB checkouts")
def test_the_qwen3_kernel_loads_as_a_measured_kernel():
    (e,) = [e for e in M.entries() if e.name == "qwen3-30b-a3b O1"]
    k = M.load(e, layers=2)
    figs = k.modeled(load_params("trn3"))
    assert k.layers == 2 and set(k.targets) <= set(figs)
    assert 50e-6 < figs["wall"] < 400e-6


def test_runtime_offset_companions_are_a_deployment_setting():
    """A DMA whose address takes a runtime scalar offset costs its issuing engine dma_runtime_offset_issue more:
    0 by default (the Qwen3 kernel's deployment), 0.52 us where the compile enables DGE on indirect DMAs (the GPT-OSS
    profiles). Three expert loads by a runtime id: the Sync engine gets 3 x 0.52 us more, nothing else moves."""
    from fusegraph import nkisim
    from fusegraph.nkisim import Abstract
    from fusegraph.perf.costmodel import estimate_kernel
    from fusegraph.perf.kernelview import view_from_trace
    import importlib

    with nkisim.as_nki():
        mod = importlib.import_module("tests.nkisim.nki_kernels")
    nkisim.run(mod.expert_gather_matmul, Abstract((128, 4), "bfloat16"), Abstract((8, 128, 256), "bfloat16"),
               Abstract((1, 3), "int32"), shape_only=True, trace=True, target="trn3")
    view = view_from_trace(nkisim.last_profile().trace[(0, 0)])
    hw = load_params("trn3")
    assert hw.dma_runtime_offset_issue == 0.0
    base = estimate_kernel(view, hw).schedule.busy
    more = estimate_kernel(view, hw.what_if("deployment", dma_runtime_offset_issue=0.52e-6)).schedule.busy
    assert more["sync"] - base["sync"] == pytest.approx(3 * 0.52e-6, rel=1e-6)
    assert more["tensor"] == base["tensor"] and more["dma"] == base["dma"]


def test_every_modeled_time_is_quoted_with_the_model_error():
    """The recorded cross-validation gives one line printed beside modeled times (bench, kernel --profile,
    bench --against, the HTML report): each set's largest per-layer error on the measured kernels and the error of
    a fit on kernels left out of it."""
    v = M.validation()
    assert set(v["wall_error_max"]) >= {"sourced", "left out"} and v["kernels"]
    assert set(v["kernels"]) <= {e.name for e in M.entries()}
    note = M.band_note("sourced")
    assert f"within {v['wall_error_max']['sourced']:.0%} per layer" in note and "MODELED" in note
    assert f"within {v['wall_error_max']['left out']:.0%} on kernels left out" in note
    assert "not cross-validated" in M.band_note("no such set")
    from fusegraph.modelperf.html import _params_section

    assert note in _params_section([], "sourced").replace("&#x27;", "'")


def test_the_bench_tables_end_with_the_model_error():
    from fusegraph.modelperf.bench import format_tables

    out = format_tables({"rows": [], "like_for_like": [], "parameter_set": "o1_hand_megakernel"})
    assert out.splitlines()[-1] == M.band_note("o1_hand_megakernel")


def test_the_note_says_when_the_target_has_no_measured_kernel():
    assert "no measured kernel on trn2" in M.band_note("sourced", "trn2")
    assert "no measured kernel" not in M.band_note("sourced", "trn3")
