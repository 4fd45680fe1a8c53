"""The tensor-parallel benchmark (fusegraph.modelperf.tp, benchmarks/bench_tp.py): one rank of a real TP capture.

A tiny Llama at TP=2 on torch's fake process group (rank 0, no peers), on the meta device, shape-only: the captured
program holds the rank's local shards and the functional collectives, and the benchmark row is computed from the
profile of the kernels built for it. Full-size rows are slow (``test_full_size_rows``).
"""
from __future__ import annotations

import math

import pytest
import torch

from fusegraph.modelperf import tp
from fusegraph.perf.costmodel import estimate_kernel
from fusegraph.perf.kernelview import build_view
from fusegraph.perf.params import load_params

CFG = tp.TPConfig("llama-tiny", "trn3", 2, 1, layers=1, cache_len=64)


@pytest.fixture(scope="module")
def rank():
    with tp.fake_rank(CFG.tp):
        step, case = tp.capture_rank(CFG)
        kernels, refused = tp.build_rank_kernels(step, CFG.target)
    assert not refused
    hw = load_params(CFG.target)
    row = tp.model_rank(step, kernels, CFG, tp.row_config(CFG), hw)
    return step, case, kernels, row, hw


def test_capture_holds_local_shards_and_collectives(rank):
    step, case, _, row, _ = rank
    attn = case.model.model.layers[0].self_attn
    assert type(attn.q_proj.weight).__name__ == "DTensor"  # sharded by HF's own tp_plan="auto"
    facts = tp.rank_facts(step.program)
    by_module = {s["node"]: s for s in facts["sharded"]}
    shards = list(by_module.values())
    # q/k/v/gate/up Shard(0), o/down Shard(1), embedding and lm_head over the vocabulary: local = global / 2
    assert len(shards) == 9
    for s in shards:
        g, loc = s["global_shape"], s["local_shape"]
        assert math.prod(g) == 2 * math.prod(loc), s
    q = [s for s in shards if s["global_shape"] == [256, 256] and s["placements"] == ["Shard(dim=0)"]]
    assert q and all(s["local_shape"] == [128, 256] for s in q)
    # the rank's KV cache holds its own KV head (2 heads / 2 ranks)
    assert tuple(case.cache.layers[0].keys.shape)[1] == 1
    ops = sorted(c["op"] for c in facts["collectives"])
    assert ops == ["all_gather_into_tensor", "all_reduce", "all_reduce", "all_reduce"]  # embed, o_proj, down; lm_head
    assert all(c["group_size"] == 2 and c["ranks"] == [0, 1] for c in facts["collectives"])
    assert row["collectives_per_step"] == 4 and row["sharded_inputs"] == 9


def test_row_is_computed_from_the_kernels_profiles(rank):
    step, _, kernels, row, hw = rank
    assert kernels, "the executor built no kernel for the rank"
    between = sum(c["seconds"] for c in row["collectives"] if c["seconds"] is not None)
    expected = sum(k.estimate.seconds for k in kernels) + len(kernels) * hw.boundary_sync + between
    assert row["modeled_ms_per_token"] == pytest.approx(expected * 1e3, rel=1e-9)
    assert row["kernels"] == len(kernels)
    assert row["collectives_inside_kernels"] + row["collectives_between_kernels"] == 4
    # the profile is of the rank's kernels: they read its local weights (half of each sharded matrix; one row of
    # the embedding), not the whole model's
    local = sum(math.prod(p.shape) * 4 for p in step.program.inputs()
                if p.kind == "weight" and p.shape and "embed_tokens" not in (p.module or ""))
    full = sum(math.prod(s["global_shape"]) * 4 for s in tp.rank_facts(step.program)["sharded"])
    read = sum(k.profile["hbm_read_bytes"] for k in kernels)
    assert row["hbm_read_gb_per_rank"] == pytest.approx(read / 1e9)
    assert local <= read < full
    # the HBM limit is the unsharded model's bytes over the chips' bandwidth (one chip: 2 ranks x LNC=1)
    assert row["limit"]["chips"] == 1
    assert row["limit_ms_per_token"] == pytest.approx(row["limit"]["total_bytes"] / hw.hbm_bandwidth_chip * 1e3)


def test_collectives_inside_the_kernel_are_costed_as_collectives(rank):
    """With the codegen lowering of the collectives, the kernel holds them; the cost model charges them on the
    collective engine with the ring model, in the line view as in the trace view of program 0."""
    _, _, kernels, row, _ = rank
    inside = row["collectives_inside_kernels"]
    if not inside:
        pytest.skip("no collective lowering in this tree: collectives run between kernels")
    cc_trace = sum(k.estimate.total.cc_count for k in kernels)
    assert cc_trace == inside
    for k in kernels:
        v = build_view(k.plan.generated.source, k.profile)
        e = estimate_kernel(v, load_params(CFG.target))
        assert e.total.cc_count == k.estimate.total.cc_count
        assert e.total.busy.get("cc", 0.0) == pytest.approx(k.estimate.total.busy.get("cc", 0.0))
    assert row["collective_us_per_layer"] > 0  # the o_proj and down_proj all-reduces are attributed to layer 0


def test_lnc2_view_is_program_0(rank):
    """At LNC=2 the cost model gets one physical core's work (program 0), not both programs added up."""
    from fusegraph.codegen.megakernel import generate
    from fusegraph.perf.analysis import profile_program0
    from fusegraph.settings import Settings

    _, _, kernels, _, hw = rank
    k = kernels[0]
    gen = generate(k.plan.lowered.program, target=CFG.target, lnc=2)
    settings = Settings.from_options({"target": CFG.target, "lnc": 2})
    prof, view = profile_program0(gen, CFG.target, settings)
    both = estimate_kernel(build_view(gen.source, prof), hw)
    one = estimate_kernel(view, hw)
    assert prof["lnc"] == 2
    assert one.total.dma_bytes < both.total.dma_bytes
    assert one.total.instructions < both.total.instructions


def test_fake_rank_refuses_a_running_job():
    with tp.fake_rank(2):
        with pytest.raises(RuntimeError, match="already initialized"):
            with tp.fake_rank(2):
                pass
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_full_size_rows():
    """The published configuration at full size (48 layers): a real TP=4 rank, modeled."""
    r = tp.run_row(tp.DEFAULT_ROWS[0])
    assert r["status"] == "run", r
    assert r["layers"] == 48 and r["tp"] == 4 and r["lnc"] == 2
    assert r["collectives_per_step"] == 2 * 48 + 2
    assert r["published_ms_per_token"] == 8.15
    assert 0 < r["modeled_us_per_layer"] < 1000


def test_gathered_logits_store_is_contiguous_and_lm_head_has_128_partitions(rank):
    """The vocabulary-parallel lm_head (local vocabulary 500 = no multiple of 128) is two projections, the bulk on
    128 output partitions (one matmul per 128 vocabulary rows and K chunk, not per 125), and its logits gather
    stores the HBM output itself from partition-major blocks: one descriptor per (partition, rank) of each piece,
    not one per element as from the chunk-major gathered tile (1000 descriptors)."""
    from fusegraph.patterns.collectives.lowering import AllGather
    from fusegraph.patterns.linear.lowering import Linear

    _, _, kernels, _, _ = rank
    k = kernels[0]
    prog, gen = k.plan.lowered.program, k.plan.generated
    heads = [i for i in prog.instructions if isinstance(i, Linear) and i.weight.name.startswith("lm_head")]
    assert [i.out.features for i in heads] == [384, 116]
    assert gen.layouts[heads[0].out.name].P == 128 and gen.layouts[heads[0].out.name].pmajor
    (g,) = [i for i in prog.instructions if isinstance(i, AllGather)]
    assert g.store and g.tail is heads[1].out
    W = len(g.ranks)
    want = sum(gen.layouts[v.name].P * W for v in (g.x, g.tail))  # 128 x 2 + 116 x 2
    stores = [d for d in k.profile["dmas"] if d["dst_tensor"].startswith("out_") and "allgather" in d["dst_tensor"]]
    assert sum(d["bytes"] for d in stores) == 1000 * 4  # the whole [1, 1000] fp32 row, once
    assert sum(d["descriptors"] for d in stores) == want < 1000


def test_any_rank_builds_and_is_costed():
    """Rank 1 of the same deployment (its own vocabulary slice and shards): its kernel is profiled and costed like
    rank 0's (the interpreter's trace is keyed by the rank it ran as)."""
    with tp.fake_rank(CFG.tp, rank=1):
        step, _ = tp.capture_rank(CFG)
        kernels, refused = tp.build_rank_kernels(step, CFG.target)
    assert not refused and kernels
    assert all(k.estimate.seconds > 0 for k in kernels)
    assert sum(k.estimate.total.cc_count for k in kernels) == 4  # embedding, o_proj, down_proj; lm_head gather


def test_gpt_oss_rank_gets_fusegraphs_complete_plan():
    """GPT-OSS-20B's rank 0 at TP=8 (issue 28 item 5: beside the hand-written kernel's deployment): HF 5.24's own
    plan shards only the embedding; build_rank applies fusegraph.tp_plan, so attention heads, experts (on the
    intermediate dimension) and sinks are per-rank shards."""
    with tp.fake_rank(8):
        case = tp.build_rank("gpt-oss-20b", 8, layers=2)
    layer = case.model.model.layers[0]
    local = lambda p: p.to_local() if hasattr(p, "to_local") else p  # noqa: E731
    assert tuple(local(layer.self_attn.q_proj.weight).shape) == (64 * 64 // 8, 2880)
    assert tuple(local(layer.self_attn.sinks).shape) == (64 // 8,)
    assert local(layer.mlp.experts.down_proj).shape[1] == 2880 // 8
    assert case.cache.layers[0].keys.shape[1] == 1  # one KV head per rank
