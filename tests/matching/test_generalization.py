"""Other HF decoder families built from tiny configs: what matches generalizes, what does not is explained."""
from fg_cases import analyzed_family

BASE_LAYER = {"fusegraph.cache_position": 1, "fusegraph.decode_attention": 1, "fusegraph.kv_cache_update": 2,
              "fusegraph.linear": 7, "fusegraph.residual_add": 2, "fusegraph.rmsnorm": 2, "fusegraph.rope": 2,
              "fusegraph.swiglu": 1}


def test_qwen2_projection_biases():
    case, cap, a = analyzed_family("Qwen2")
    assert a.coverage == 1.0 and len(a.regions) == 1
    assert a.pattern_counts(0) == BASE_LAYER
    biased = {m.module.rsplit(".", 1)[-1] for m in a.matches_of("fusegraph.linear") if m.layer == 0 and "bias" in m.inputs}
    assert biased == {"q_proj", "k_proj", "v_proj"}  # Qwen2: q/k/v have biases, o/gate/up/down do not
    G = cap.program.graph
    for m in a.matches_of("fusegraph.linear"):
        if "bias" in m.inputs:
            assert G.nodes[m.inputs["bias"]]["module"].endswith(".bias")


def test_gemma_offset_norm_gelu_and_scaled_embedding():
    case, cap, a = analyzed_family("Gemma", dtype="bfloat16")
    assert a.coverage == 1.0 and len(a.regions) == 1
    assert not a.matches_of("fusegraph.rmsnorm")  # (1 + weight) is never plain RMSNorm
    assert a.pattern_counts(0)["fusegraph.rmsnorm_offset"] == 2
    assert all(m.params["offset"] == 1.0 for m in a.matches_of("fusegraph.rmsnorm_offset"))
    (act,) = {m.params["act"] for m in a.matches_of("fusegraph.swiglu")}
    assert act == "gelu_tanh"
    (emb,) = a.matches_of("fusegraph.embedding")
    assert "scale" in emb.inputs


def test_mha_without_grouped_kv():
    case, cap, a = analyzed_family("Llama", num_key_value_heads=4)
    assert a.coverage == 1.0 and a.pattern_counts(0) == BASE_LAYER
    attn = a.matches_of("fusegraph.decode_attention")[0]
    assert attn.params["num_key_value_groups"] == 1 and "G=1" in attn.variant


def test_shared_expert_moe():
    case, cap, a = analyzed_family("Qwen2Moe", moe_intermediate_size=128, shared_expert_intermediate_size=256,
                                   num_experts=4, num_experts_per_tok=2)
    assert a.coverage == 1.0 and len(a.regions) == 1
    counts = a.pattern_counts(0)
    assert counts["fusegraph.moe_router"] == 1 and counts["fusegraph.moe_experts"] == 1
    assert counts["fusegraph.sigmoid_gate"] == 1 and counts["fusegraph.swiglu"] == 1  # the shared expert
    router = a.matches_of("fusegraph.moe_router")[0]
    assert router.params["normalize"] is False  # Qwen2-MoE does not renormalize the top-k weights
    assert a.regions[0].blocks[-2].kind == "moe"


def test_unsupported_activation_is_reported_not_guessed():
    """relu2 (relu then square) is not a single-op activation: with generic lowering off the MLP stays unmatched,
    with the reason; with it on (the default) the relu/square/multiply piece joins the stack region."""
    from fusegraph.matching import analyze
    from fusegraph.settings import Settings

    case, cap, a_generic = analyzed_family("Llama", hidden_act="relu2")
    a = analyze(cap.program, Settings.from_options({"generic_lowering": False}))
    assert not a.matches_of("fusegraph.swiglu")
    assert 0.9 < a.coverage < 1.0
    by_op = {u.op: u for u in a.unmatched}
    relu = by_op["aten.relu.default"]
    assert relu.count == 2 and relu.module == "model.layers.*.mlp.act_fn"
    assert "aten.pow.Tensor_Scalar is not one of the ops slot 'act' accepts" in by_op["aten.mul.Tensor"].reason
    assert len(a.regions) > 1  # the unfused MLP middle splits the stack
    assert a_generic.coverage == 1.0 and len(a_generic.regions) == 1
    assert len(a_generic.matches_of("fusegraph.generic")) == case.model.config.num_hidden_layers


def test_sliding_window_mask_is_lowered_generically():
    """Mistral's sliding-window mask (and its step-specialized position) is not the causal-mask pattern: its ops are
    no longer left over (issue 27: every op lowers) but a generic piece of step metadata (``fusegraph.generic_host``:
    it depends only on positions, so it is computed on the host before the kernel, as the causal-mask pattern's
    mask is) inside the decoder stack's region; the layers still fuse completely."""
    case, cap, a = analyzed_family("Mistral")
    assert a.coverage == 1.0
    assert not a.matches_of("fusegraph.causal_mask")
    assert a.unmatched == []
    host_ops = set()
    for m in a.matches_of("fusegraph.generic_host"):
        host_ops |= {cap.program.graph.nodes[n]["op"] for n in m.nodes}
    for op in ("aten.gt.Tensor", "aten.sub.Tensor", "aten.bitwise_and.Tensor", "aten.le.Tensor"):
        assert op in host_ops, op
    stack = [r for r in a.regions if r.kind == "decoder_stack"][0]
    mask_nodes = {n for m in a.matches_of("fusegraph.generic_host") for n in m.nodes
                  if cap.program.graph.nodes[n]["op"] == "aten.bitwise_and.Tensor"}
    assert mask_nodes and mask_nodes <= set(stack.nodes)


def test_generic_piece_ending_in_a_folded_alias():
    """Cohere's decoder (LayerNorm without bias, interleaved RoPE, parallel attention + MLP) leaves generic pieces
    whose last op is an alias that canonicalization folds: matches must name canonical nodes (this used to be a
    KeyError inside region formation, which made the whole compile fall back)."""
    case, cap, a = analyzed_family("Cohere")
    generic = a.matches_of("fusegraph.generic")
    assert generic
    for m in generic:
        assert all(n in a.view.data for n in m.outputs.values())
    assert a.regions
