"""Serving rows on the tensor-parallel configuration (fusegraph.modelperf.tp, issue 15 item 5).

A tiny Llama at TP=2 on torch's fake process group with a 4096-position cache: the rank's kernel holds the
streamed (flash-decoding) attention, it is profiled with every sequence at the cache's last position, and the
row's serving figures (HBM bytes, SBUF peak, extrapolated full-model time) come from that profile.
"""
from __future__ import annotations

import pytest

from fusegraph.codegen.api import position_assumption
from fusegraph.modelperf import tp
from fusegraph.perf.params import load_params

L = 4096
# blocks of 1,024 pinned (4 blocks): the modeled choice takes the rank's one kv head in one block of 4,096, where a
# position-0 step reads as much as a full one (tests/serving/test_stream_choice.py checks that choice)
CFG = tp.TPConfig("llama-tiny", "trn3", 2, 1, layers=1, cache_len=L, batch=2, full_cache=True,
                  options=(("attn_block", 1024),))


@pytest.fixture(scope="module")
def built():
    with tp.fake_rank(CFG.tp):
        step, case = tp.capture_rank(CFG)
        full, refused = tp.build_rank_kernels(step, CFG.target, assume=position_assumption(L - 1))
        first, _ = tp.build_rank_kernels(step, CFG.target)  # default assumption: position 0, one block read
    assert not refused
    hw = load_params(CFG.target)
    row = tp.model_rank(step, full, CFG, tp.row_config(CFG), hw)
    row.update(tp.serving_figures(row, full, CFG, case.config, hw))
    return step, case, full, first, row, hw


def test_rank_kernel_streams_the_cache(built):
    step, case, full, _, row, _ = built
    assert tuple(case.cache.layers[0].keys.shape) == (2, 1, L, 64)  # batch 2, the rank's one KV head
    decoder = [k for k in full if k.layers]
    assert decoder and any("cache positions streamed in blocks of" in k.plan.generated.source for k in decoder)
    assert row["streamed_attention"] and row["batch"] == 2
    assert row["collectives_per_step"] >= 3


def test_serving_figures_come_from_the_profile(built):
    _, case, full, first, row, hw = built
    hbm = sum(k.profile["hbm_read_bytes"] for k in full)
    assert row["hbm_read_gb"] == pytest.approx(hbm / 1e9)
    # a full cache reads every block of both sequences' K and V: at least 2 x 2 x L x 64 x 4 bytes (fp32 tiny)
    kv = 2 * 2 * L * 64 * 4
    assert hbm - sum(k.profile["hbm_read_bytes"] for k in first) >= 0.9 * kv * (1 - 1 / 4)
    need = tp.rank_min_bytes(dict(case.config, num_hidden_layers=1), L, 2, 2)
    assert row["hbm_vs_min"] == pytest.approx(hbm / need["total_bytes"])
    assert row["sbuf_peak_kib"] == max(k.profile["peak_sbuf_bytes_per_partition"] for k in full) / 1024
    assert 0 < row["sbuf_peak_kib"] <= row["sbuf_kib"]
    # extrapolation to the model's 2 layers: step + 1 x per-layer time, per token = per step / batch
    step_ms = sum(k.estimate.seconds for k in full) * 1e3 + len(full) * hw.boundary_sync * 1e3 + row[
        "collectives_between_ms"]
    assert row["modeled_ms_per_token"] == pytest.approx(step_ms)
    assert row["full_model_ms_per_step"] == pytest.approx(step_ms + row["modeled_us_per_layer"] / 1e3)
    assert row["full_model_ms_per_token"] == pytest.approx(row["full_model_ms_per_step"] / 2)


def test_bench_serving_tp_mode_writes_the_rows(tmp_path):
    """``bench_serving.py --tp`` runs the TP rows at every cache length and batch and writes them as JSON."""
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_serving.py")
    spec = importlib.util.spec_from_file_location("bench_serving_tp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "serving_tp.json"
    assert mod.main(["--tp", "--tp-rows", "llama-tiny:trn3:2:1", "--cache-lens", "4096", "--batches", "1",
                     "--layers", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["cache_len"], r["batch"], r["status"]) for r in rows] == [(4096, 1, "run")]
    r = rows[0]
    assert r["streamed_attention"] and r["assumed_position"] == "L - 1" and r["full_layers"] == 2
    assert r["full_model_ms_per_token"] == pytest.approx(r["modeled_ms_per_token"] + r["modeled_us_per_layer"] / 1e3)
