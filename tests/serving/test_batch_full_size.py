"""Full-size configs (meta device, shape-only) at batch 64: Qwen3-30B-A3B (128 experts top-8: every expert slot
may run, the shape-only run reads all 128 experts' weights once per layer, the per-token path would read 64 x 8)
and Llama-3-8B build one megakernel and run in the interpreter within trn2's SBUF budget, planned and measured.
Two layers: SBUF per partition does not depend on the layer count (the same instructions repeat); caches of
32 and 131,072 positions (the long one through the streamed attention)."""
import pytest

from fusegraph.api.kernel import build_decode_kernel

BATCH = 64


@pytest.mark.slow
@pytest.mark.parametrize("cache", [32, 131072])
@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "llama3-8b"])
def test_full_size_batch_64_builds_and_profiles_within_sbuf(model, cache):
    built = build_decode_kernel(model, target="trn2",
                                case_kwargs={"batch": BATCH, "num_layers": 2, "max_cache_len": cache})
    budget = built.generated.budget
    assert built.generated.program.tokens == BATCH
    assert budget.sbuf_peak <= budget.sbuf_budget, budget.to_dict()
    assert 0 < built.profile["peak_sbuf_bytes_per_partition"] <= budget.sbuf_peak
    # the logits ([64, vocab]) go to HBM chunk by chunk: never whole in SBUF
    assert "straight to HBM" in built.generated.source
    writes = built.profile["hbm_by_tensor"]
    logits = next(k for k in writes if k.startswith("out_") and writes[k]["write_bytes"] >= BATCH * 128000 * 2)
    assert writes[logits]["kind"] == "output"
    if model == "qwen3-30b-a3b":
        assert "grouped by expert" in built.generated.source
        E, H, I = 128, 2048, 768
        per_layer = E * (2 * I * H + H * I) * 2  # bf16: each expert's gate/up and down read once, not per token
        experts = sum(t["read_bytes"] for k, t in writes.items() if "experts" in k)
        assert experts == 2 * per_layer
