"""The strategies on real generated kernels: orderings that must hold, and sensitivity to the kernel's structure."""
import pytest

from fusegraph.perf import baselines
from fusegraph.perf.analysis import cost_strategies, shard_overrides, strategy_summary
from fusegraph.perf.costmodel import estimate_kernel
from fusegraph.perf.params import load_params


def test_strategies_order_and_limit(tiny_builds, tiny_program):
    for target in ("trn2", "trn3"):
        b = tiny_builds[target]
        hw = load_params(target)
        s = cost_strategies(b, hw, program=tiny_program)
        mk, hy, po, xm = s.megakernel.seconds, s.hybrid.seconds, s.per_op.seconds, s.xla_nki_moe.seconds
        assert mk < hy < xm < po, (mk, hy, xm, po)
        limit = baselines.physical_limit(b.config, 64, hw)
        assert limit["one_core_seconds_per_token"] < mk
        assert s.launches["megakernel"] == 1 and s.launches["per_op"] > s.launches["xla_nki_moe"] > s.launches["hybrid"]
        # per-op pays a boundary per op kernel
        assert s.per_op.schedule.barriers == s.launches["per_op"] - 1
        summ = strategy_summary(s.megakernel, 1)
        assert set(summ["per_layer_busy_s"]) >= {"tensor", "vector", "sync", "dma"}
        assert summ["bound"] in ("compute", "memory", "dma-overhead", "sync")


def test_trn3_is_faster_than_trn2(tiny_builds):
    t2 = estimate_kernel(tiny_builds["trn2"].view, load_params("trn2")).seconds
    t3 = estimate_kernel(tiny_builds["trn3"].view, load_params("trn3")).seconds
    assert t3 < t2


def test_per_layer_and_region_breakdown(tiny_builds):
    est = estimate_kernel(tiny_builds["trn2"].view, load_params("trn2"))
    assert {0, 1, "outside"} <= set(est.layers)
    assert est.decoder_seconds() + est.layers["outside"].wall == pytest.approx(est.seconds)
    r = est.regions["L0.experts.experts"].to_dict()
    assert r["dma_count"] > 0 and r["bound"] in ("compute", "memory", "dma-overhead", "sync")
    top = est.top_lines(5)
    assert len(top) == 5 and top[0]["cost_s"] + top[0]["exposed_s"] >= top[-1]["cost_s"] + top[-1]["exposed_s"]
    groups = est.top_templates(100)
    names = {g["name"] for g in groups}
    assert "L*.q_proj.linear.mm" in names and "L*.experts.experts.t#k#.gu.w#" in names
    mm = next(g for g in groups if g["name"] == "L*.q_proj.linear.mm")
    assert mm["lines"] == 2  # one line per layer, grouped
    assert sum(g["cost_s"] for g in est.top_templates(10_000)) == pytest.approx(sum(w.cost for w in est.schedule.works))


def test_the_model_sees_kernel_structure():
    """Smaller weight chunks (more, smaller DMAs) and a shallower ring must not be modeled as faster."""
    from fusegraph.api import build_decode_kernel
    from fusegraph.codegen.megakernel import generate

    from fusegraph.perf.analysis import profile_shape_only
    from fusegraph.perf.kernelview import build_view

    hw = load_params("trn2")
    prog = build_decode_kernel("qwen3-moe-tiny", target="trn2", profile=False,
                               case_kwargs={"num_layers": 1, "max_cache_len": 64}).lowered.program

    def modeled(**kw):
        gen = generate(prog, target="trn2", **kw)
        return estimate_kernel(build_view(gen.source, profile_shape_only(gen, "trn2")), hw)

    base = modeled(chunk_bytes=16 * 1024, ring=4)
    small = modeled(chunk_bytes=512, ring=4)
    shallow = modeled(chunk_bytes=512, ring=2)
    assert small.total.dma_count > base.total.dma_count
    assert small.seconds > base.seconds
    assert shallow.seconds >= small.seconds


def test_shard_overrides():
    cfg = {"num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "hidden_size": 2048,
           "intermediate_size": 6144, "moe_intermediate_size": 768, "vocab_size": 151936}
    o = shard_overrides(cfg, 8)
    assert o == {"num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 768,
                 "moe_intermediate_size": 96, "vocab_size": 19072}


def test_like_for_like_runs_on_the_pipeline_kernel():
    from fusegraph.modelperf.analysis import analyze_model

    perf = analyze_model("qwen3-moe-tiny", ["trn3"], cache_len=64, like_for_like=True, per_op=False)["trn3"]
    lfl = perf.to_dict()["like_for_like"]
    assert lfl["status"] == "run", lfl
    assert lfl["cores"] == 8 and lfl["shard_overrides"]["num_attention_heads"] == 1
    rows = {(r["quantity"], r["strategy"]) for r in lfl["calibration"]}
    assert ("per-layer wall", "megakernel") in rows and ("ms/token", "megakernel") in rows
    assert lfl["goal"]["target_us_per_layer"] == 134.47
    slower = {w["what_if"]: w["seconds_per_layer"] for w in lfl["what_if"]}
    base = lfl["goal"]["modeled_us_per_layer"] * 1e-6
    assert set(slower) == {"DMA as slow per byte as measured", "Tensor engine as slow as measured", "both"}
    assert slower["both"] >= max(slower["DMA as slow per byte as measured"], base) * 0.999
    assert len(lfl["sensitivity"]) == 6


def test_a_kernel_that_fits_no_target_is_not_run(monkeypatch):
    """A kernel that needs more SBUF than the budget (here a 32 KiB budget, ``FUSEGRAPH_SBUF_BUDGET``; long caches
    no longer overflow since attention streams the cache): the pipeline refuses on every target, so there is nothing
    to model (this used to end in a BudgetError traceback)."""
    from fusegraph.modelperf.analysis import NotRun, build_kernels

    monkeypatch.setenv("FUSEGRAPH_SBUF_BUDGET", str(32 * 1024))
    (nr,) = build_kernels("llama-tiny", ["trn3"], layers=1, cache_len=640).values()
    assert isinstance(nr, NotRun) and nr.stage == "codegen" and nr.program is not None
    assert nr.reason.startswith("BudgetError: the kernel needs ") and "trn3 has 32.0 KiB" in nr.reason