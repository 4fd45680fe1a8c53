"""The parameter data file: every value sourced, both targets, and the derived byte counts of perf_anchors.md."""
import copy

import pytest

from fusegraph.perf import params
from fusegraph.perf.analysis import model_config
from fusegraph.perf.baselines import bytes_per_token, physical_limit


def test_data_file_validates():
    assert params.validate() == []


def test_every_parameter_has_a_source_unit_and_confidence_for_each_target():
    data = params.raw_data()
    assert set(data["targets"]) == {"trn2", "trn3"}
    for name, p in data["parameters"].items():
        for t in data["targets"]:
            src = p["source"][t] if isinstance(p["source"], dict) else p["source"]
            conf = p["confidence"][t] if isinstance(p["confidence"], dict) else p["confidence"]
            assert isinstance(src, str) and "perf_anchors.md" in src, f"{name}/{t} has no perf_anchors source"
            assert conf in ("H", "M", "L"), f"{name}/{t}"
            assert p["unit"], name
            assert t in p["values"], f"{name} has no value for {t}"
    for name, f in data["published"]["figures"].items():
        assert "perf_anchors.md" in f["source"], name


@pytest.mark.parametrize("field", ["source", "unit", "confidence"])
def test_validate_rejects_a_parameter_without(field):
    data = copy.deepcopy(params.raw_data())
    del data["parameters"]["dma_fixed_latency"][field]
    problems = params.validate(data)
    assert any("dma_fixed_latency" in p for p in problems)


def test_validate_rejects_a_missing_target_value_and_an_unsourced_figure():
    data = copy.deepcopy(params.raw_data())
    del data["parameters"]["pe_clock"]["values"]["trn3"]
    data["published"]["figures"]["xla_ms_per_token"]["source"] = ""
    problems = params.validate(data)
    assert any("pe_clock" in p and "trn3" in p for p in problems)
    assert any("xla_ms_per_token" in p for p in problems)


def test_load_params_per_target():
    t2, t3 = params.load_params("trn2"), params.load_params("trn3")
    assert t2.hbm_bandwidth_chip == 2.9e12 and t3.hbm_bandwidth_chip == 4.9e12
    assert t2.dma_bandwidth_core == 368e9 and t3.dma_bandwidth_core == 528e9
    assert t2.param("dma_issue_hwdge").confidence == "H" and t3.param("dma_issue_hwdge").confidence == "M"
    assert "O7" in t3.param("dma_issue_hwdge").source
    with pytest.raises(AttributeError):
        t2.no_such_parameter
    with pytest.raises(ValueError):
        params.load_params("trn1")


def test_what_if_is_marked_and_leaves_the_defaults_alone():
    hw = params.load_params("trn3")
    w = hw.what_if("half bandwidth", dma_bandwidth_core=264e9)
    assert w.dma_bandwidth_core == 264e9 and hw.dma_bandwidth_core == 528e9
    assert w.param("dma_bandwidth_core").source.startswith("what-if")


def test_published_figures():
    pub = params.published()
    f = pub["figures"]
    assert (pub["tp"], pub["lnc"], pub["target"]) == (4, 2, "trn3")
    assert f["xla_ms_per_token"].value == 14.37 and f["hybrid_ms_per_token"].value == 9.43
    assert f["megakernel_ms_per_token"].value == 8.15
    assert f["hybrid_us_per_layer"].value == 165.26 and f["megakernel_us_per_layer"].value == 134.47


def test_bytes_per_token_match_perf_anchors_section_5():
    b = bytes_per_token(model_config("qwen3-30b-a3b"), 640)
    assert b["weight_bytes"] == 6_083_739_648
    assert b["kv_bytes"] == 62_914_560
    assert b["total_bytes"] == 6_146_654_208
    lim3 = physical_limit(model_config("qwen3-30b-a3b"), 640, params.load_params("trn3"))
    lim2 = physical_limit(model_config("qwen3-30b-a3b"), 640, params.load_params("trn2"))
    assert lim3["seconds_per_token"] == pytest.approx(1.254e-3, rel=1e-3)  # 6.1467e9 / 4.9e12
    assert lim2["seconds_per_token"] == pytest.approx(2.12e-3, rel=2e-3)
    assert lim3["one_core_seconds_per_token"] == pytest.approx(6_146_654_208 / 528e9)


def test_dense_bytes_per_token():
    cfg = model_config("llama3-8b")
    b = bytes_per_token(cfg, 640)
    # 32 layers x (attention 4096*(4096+2*1024+4096) + 3*4096*14336 + norms) + lm_head + final norm + embedding row
    per_layer = 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336 + 2 * 4096
    assert b["weight_bytes"] == 2 * (32 * per_layer + 128256 * 4096 + 2 * 4096)
