"""Done-means of issue #4 on the bundled tiny models: coverage, one decoder-stack region, pattern counts per layer."""
import pytest

from fg_cases import DEFAULT, FULL, analyzed, config_id

LLAMA_LAYER = {"fusegraph.cache_position": 1, "fusegraph.decode_attention": 1, "fusegraph.kv_cache_update": 2,
               "fusegraph.linear": 7, "fusegraph.residual_add": 2, "fusegraph.rmsnorm": 2, "fusegraph.rope": 2,
               "fusegraph.swiglu": 1}
QWEN3_LAYER = dict(LLAMA_LAYER, **{"fusegraph.rmsnorm": 4})  # input, post-attention, q_norm, k_norm
MOE_LAYER = {"fusegraph.cache_position": 1, "fusegraph.decode_attention": 1, "fusegraph.kv_cache_update": 2,
             "fusegraph.linear": 4, "fusegraph.moe_experts": 1, "fusegraph.moe_router": 1, "fusegraph.residual_add": 2,
             "fusegraph.rmsnorm": 4, "fusegraph.rope": 2}
OUTSIDE = {"fusegraph.causal_mask": 1, "fusegraph.embedding": 1, "fusegraph.linear": 1, "fusegraph.rmsnorm": 1,
           "fusegraph.rope_tables": 1}  # mask, embedding, lm_head, final norm, rotary tables
PER_LAYER = {"llama-tiny": LLAMA_LAYER, "qwen3-tiny": QWEN3_LAYER, "qwen3-moe-tiny": MOE_LAYER}


def _check(cfg):
    case, cap, a = analyzed(*cfg)
    layers = cap.program.layers()
    assert layers == [0, 1]
    assert a.coverage >= 0.98, [u.to_dict() for u in a.unmatched]
    # the whole decoder stack is one region, and it holds every layer
    stacks = [r for r in a.regions if r.kind == "decoder_stack"]
    assert len(stacks) == 1 and stacks[0].layers == layers
    assert len(a.regions) == 1 and a.boundaries_per_step == 1
    for layer in layers:
        assert a.pattern_counts(layer) == PER_LAYER[cfg[0]], f"layer {layer}"
    assert a.pattern_counts(None) == OUTSIDE
    # the region's blocks: attention and MLP/MoE per layer, plus embedding / prologue / head
    kinds = [(b.kind, b.layer) for b in stacks[0].blocks]
    mlp = "moe" if "moe" in cfg[0] else "mlp"
    for layer in layers:
        assert ("attention", layer) in kinds and (mlp, layer) in kinds


@pytest.mark.parametrize("cfg", DEFAULT, ids=[config_id(c) for c in DEFAULT])
def test_coverage_and_counts(cfg):
    _check(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [c for c in FULL if c not in DEFAULT], ids=[config_id(c) for c in FULL if c not in DEFAULT])
def test_coverage_and_counts_full_matrix(cfg):
    _check(cfg)


def test_variants_seen_per_configuration():
    """The same math matched through the implementation each configuration captures to."""
    seen = {}
    for cfg in DEFAULT:
        _, _, a = analyzed(*cfg)
        for m in a.matches:
            if m.pattern.name in ("fusegraph.decode_attention", "fusegraph.moe_experts", "fusegraph.causal_mask"):
                seen.setdefault((config_id(cfg), m.pattern.name), set()).add(m.variant.split("[")[0].split("/")[0])
                if m.pattern.name == "fusegraph.causal_mask":
                    seen.setdefault((config_id(cfg), "form"), set()).add(m.params["form"])
    assert seen[("qwen3-moe-tiny-sdpa-grouped_mm-bfloat16", "fusegraph.moe_experts")] == {"grouped_mm"}
    assert seen[("qwen3-moe-tiny-eager-grouped_mm-float32", "fusegraph.moe_experts")] == {"grouped_mm_fallback"}
    assert seen[("qwen3-moe-tiny-eager-eager-bfloat16", "fusegraph.moe_experts")] == {"eager_rewrite"}
    assert seen[("qwen3-moe-tiny-eager-batched_mm-float32", "fusegraph.moe_experts")] == {"default"}
    assert seen[("llama-tiny-sdpa-bfloat16", "fusegraph.decode_attention")] == {"sdpa"}
    assert seen[("llama-tiny-eager-float32", "fusegraph.decode_attention")] == {"default"}
    assert seen[("llama-tiny-sdpa-bfloat16", "fusegraph.causal_mask")] == {"boolean"}
    assert seen[("llama-tiny-sdpa-bfloat16", "form")] == {"boolean"}
    assert seen[("llama-tiny-eager-float32", "form")] == {"additive"}


def test_batch_of_two():
    case, cap, a = analyzed("qwen3-moe-tiny", "eager", "batched_mm", "float32", batch=2)
    assert a.coverage >= 0.98, [u.to_dict() for u in a.unmatched]
    assert len(a.regions) == 1
    assert a.pattern_counts(0) == MOE_LAYER
    mask = a.matches_of("fusegraph.causal_mask")[0]
    assert mask.params["batch"] == 2 and mask.params["kv_length"] == 32


def test_params_and_bindings_for_codegen():
    case, cap, a = analyzed("qwen3-moe-tiny", "sdpa", "grouped_mm", "bfloat16")
    G = cap.program.graph
    cfg = case.model.config
    attn = a.matches_of("fusegraph.decode_attention")[0]
    assert attn.params["scale"] == pytest.approx(cfg.head_dim ** -0.5)
    assert attn.params["num_key_value_groups"] == cfg.num_attention_heads // cfg.num_key_value_heads
    # k and v are the caches as updated in place this step
    assert G.nodes[attn.inputs["k"]]["op"] == "aten.index_copy_.default"
    assert G.nodes[attn.inputs["v"]]["op"] == "aten.index_copy_.default"
    norms = a.matches_of("fusegraph.rmsnorm")
    assert all(m.params["eps"] == cfg.rms_norm_eps for m in norms)
    assert {m.module for m in norms if m.layer == 0} == {
        f"model.layers.0.{n}" for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")}
    router = a.matches_of("fusegraph.moe_router")[0]
    assert router.params["top_k"] == cfg.num_experts_per_tok and router.params["normalize"] is True
    assert set(router.outputs) == {"weights", "indices"}
    experts = a.matches_of("fusegraph.moe_experts")[0]
    assert experts.params["act"] == "silu"
    assert experts.inputs["indices"] == router.outputs["indices"]
    kv = a.matches_of("fusegraph.kv_cache_update")
    assert all(m.params["dim"] == 2 for m in kv)
    assert all(G.nodes[m.inputs["cache"]]["input_kind"].value == "state" for m in kv)
    lm_head = [m for m in a.matches_of("fusegraph.linear") if m.module == "lm_head"]
    assert len(lm_head) == 1 and lm_head[0].layer is None
    # folded no-op views between a provider and its match are exposed (alias before lm_head)
    assert lm_head[0].input_views["x"] and lm_head[0].input_layout_preserving["x"]
    tables = a.matches_of("fusegraph.rope_tables")[0]
    assert tables.params["attention_scaling"] == 1.0 and G.nodes[tables.inputs["inv_freq"]]["input_kind"].value == "buffer"
    # every match's nodes are original program nodes, disjoint between matches
    seen = set()
    for m in a.matches:
        assert m.nodes <= set(G.nodes) and not (m.nodes & seen)
        seen |= m.nodes


def test_analysis_is_deterministic():
    from fusegraph.matching import analyze

    _, cap, a = analyzed("qwen3-moe-tiny", "eager", "batched_mm", "float32")
    b = analyze(cap.program)
    assert [m.to_dict() for m in a.matches] == [m.to_dict() for m in b.matches]
    assert [r.to_dict() for r in a.regions] == [r.to_dict() for r in b.regions]
    assert [d.to_dict() for d in a.decisions] == [d.to_dict() for d in b.decisions]
