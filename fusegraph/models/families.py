"""Every causal-LM family of the installed transformers, classified, and a tiny random-weight decode case of each.

What ``benchmarks/bench_families.py`` sweeps (issue 27): not a chosen list but every class of transformers'
causal-LM auto mapping (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, the classes ``AutoModelForCausalLM`` builds:
the ``*ForCausalLM`` classes and a few older names such as ``GPT2LMHeadModel``), deduplicated by class.

**Family name.** The class name without its ``ForCausalLM`` suffix (``Llama``, ``Qwen3Moe``: the names
:func:`fusegraph.models.build_family_decode` takes), or the whole class name when it has another suffix
(``GPT2LMHeadModel``, ``Gemma3ForConditionalGeneration``).

**Kind** (:func:`classify`, from the class and its config class only; the first rule that applies):

1. ``multimodal``: the causal-LM ``forward`` takes a non-text input (a parameter named like ``pixel_values``,
   ``image_*``, ``video*``, ``audio*``, ``input_features``), or the config nests a vision or audio sub-config, or
   declares audio codebooks (``num_codebooks``: its tokens are several audio codes per step, Musicgen).
2. ``cross-attention decoder``: the family's default config has ``is_encoder_decoder=True`` (the class is the
   decoder half of a seq2seq model: Bart, Marian, Whisper, ...), or ``forward`` takes encoder / cross-attention
   states (``encoder_hidden_states``, ``encoder_outputs``, ``cross_attention_states``) and the config has no
   ``add_cross_attention`` switch, so its layers cross-attend by construction (TrOCR, Mllama's text model).
   Decoders where cross-attention is an option that is off by default (GPT-2, XGLM) are not this kind.
3. ``encoder as decoder``: one of the class's model types also has a masked-LM head in transformers
   (``MODEL_FOR_MASKED_LM_MAPPING_NAMES``), or the config's ``is_decoder`` defaults to False while ``forward``
   takes ``encoder_hidden_states`` (BertGeneration): a bidirectional encoder family (BERT, RoBERTa, XLM, ...)
   that the causal-LM class runs with a causal mask (the tiny builder sets ``is_decoder`` / XLM's ``causal``).
4. ``decoder`` otherwise.

**State** (:func:`state_of`, from the class and the tiny config): ``none`` when ``forward`` takes no cache or
state at all (each step sees only its own token); ``own`` when transformers says the class cannot use its
standard caches (``_supports_default_dynamic_cache()`` is False: RWKV, xLSTM, XLNet, Reformer, MiniMax bring
their own state object); else from transformers' own per-layer cache types of the config
(``cache_utils.get_layer_types_and_kwargs``, what ``StaticCache(config)`` builds): ``kv`` when every layer is
an attention layer (full, sliding, chunked, indexed, compressed) or keeps no state, ``recurrent`` when none
is, ``hybrid`` when both kinds are present. The sweep's target population, :attr:`Family.target`, is
``kind == "decoder"`` with a KV cache (``kv`` or ``hybrid``).

**Tiny config** (:func:`tiny_config`): the family's config class defaults, every size-like field shrunk by the
data-driven :data:`FIELD_RULES` (field-name patterns, one rule each: hidden 256, 4 heads, KV heads by the
default's attention kind, head_dim 64, FFN 512, 8 experts top-2 with FFN 128, MLA ranks, SSM state 16, windows
16 (smaller than the 32-position cache), vocabulary 1000, ...), per-layer lists cut to the fewest layers that
keep one layer of every kind the default declares (:func:`_layer_pick`), and :data:`OVERRIDES`, the few
per-family values that the rules cannot derive, each with the reason beside it. A config (or model) that the
installed transformers rejects raises :class:`TinyBuildError` with its message: "cannot build tiny".
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import DecodeCase

#: tiny sizes (TINY_DIMS' values; experts, ranks, state and window sizes added)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, MOE_FFN = 256, 4, 2, 64, 512, 128
EXPERTS, TOP_K, VOCAB, POSITIONS, WINDOW = 8, 2, 1000, 512, 16
MIN_LAYERS, MAX_LAYERS = 2, 8
MAX_PARAMS = 100_000_000  # a tiny model above this is a rule that missed a size field: refused, not built

KINDS = ("decoder", "cross-attention decoder", "encoder as decoder", "multimodal")
STATES = ("kv", "hybrid", "recurrent", "own", "none")

#: ``forward`` parameters that carry a decoder's state between steps, by family convention
_STATE_ARGS = ("cache", "state", "mems", "past_buckets_states", "past_key_values")
_NON_TEXT_INPUT = re.compile(r"pixel_values.*|image_.*|video.*|audio_.*|input_features.*|input_values|"
                             r"image_patches|mm_encoder_outputs")
_CROSS_INPUTS = ("encoder_hidden_states", "encoder_outputs", "cross_attention_states")
#: transformers' per-layer cache types (cache_utils.*_LAYER_TYPE_MAPPING) that hold no per-token KV
_RECURRENT_TYPES = {"conv", "linear_attention"}
_BOTH_TYPES = {"hybrid", "hybrid_sliding"}  # a linear-attention state and a KV cache in one layer
_NO_STATE_TYPES = {"dummy"}


class TinyBuildError(ValueError):
    """The installed transformers cannot build this family tiny (the message says why, in one line)."""


# ---------------------------------------------------------------------------------------------------- discovery
@dataclass(frozen=True)
class Family:
    name: str  # class name without "ForCausalLM" (or the whole class name)
    class_name: str
    model_types: tuple[str, ...]
    kind: str  # one of KINDS
    kind_rule: str  # the rule that gave the kind (module docstring)

    @property
    def model_class(self) -> type:
        import transformers

        return getattr(transformers, self.class_name)


def family_name(class_name: str) -> str:
    return class_name[: -len("ForCausalLM")] if class_name.endswith("ForCausalLM") else class_name


def causal_lm_classes() -> dict[str, tuple[str, ...]]:
    """Class name -> its model types, for every class of transformers' causal-LM auto mapping (in mapping order)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    by_class: dict[str, list[str]] = {}
    for model_type, cls_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        by_class.setdefault(cls_name, []).append(model_type)
    return {k: tuple(v) for k, v in by_class.items()}


def _family(cls_name: str, types: tuple[str, ...]) -> Family:
    import transformers

    cls = getattr(transformers, cls_name, None)
    if cls is None:  # listed in the mapping but not importable here (a missing optional dependency)
        return Family(family_name(cls_name), cls_name, types, "decoder", "class not importable")
    kind, rule = classify(cls, types)
    return Family(family_name(cls_name), cls_name, types, kind, rule)


@functools.lru_cache(maxsize=None)
def _discover() -> tuple[Family, ...]:
    return tuple(_family(c, t) for c, t in causal_lm_classes().items())


def discover() -> list[Family]:
    """Every class of transformers' causal-LM auto mapping (deduplicated by class), classified."""
    return list(_discover())


def find(name: str, families: list[Family] | None = None) -> Family:
    """The family named ``name``: its family name, class name or one of its model types (case-insensitive).
    Classifies only that family unless ``families`` is given."""
    key = name.lower()
    entries = ([(f.class_name, f.model_types, f) for f in families] if families is not None
               else [(c, t, None) for c, t in causal_lm_classes().items()])
    # a family name first ("Gemma3": Gemma3ForCausalLM), then a class name, then a model type ("gemma3" is
    # Gemma3ForConditionalGeneration's)
    for match in (lambda c, t: family_name(c).lower() == key, lambda c, t: c.lower() == key,
                  lambda c, t: key in (x.lower() for x in t)):
        for cls_name, types, fam in entries:
            if match(cls_name, types):
                return fam if fam is not None else _family(cls_name, types)
    raise KeyError(f"no causal-LM family {name!r} in this transformers")


def _forward_params(cls: type) -> set[str]:
    return set(inspect.signature(cls.forward).parameters)


def _default_config(config_cls: type) -> Any | None:
    try:
        return config_cls()
    except Exception:  # noqa: BLE001 - a config class whose defaults do not validate (checked again when built)
        return None


def classify(cls: type, model_types: list[str] | tuple[str, ...]) -> tuple[str, str]:
    """``(kind, rule)`` of a causal-LM class (module docstring: the rules, in order)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    params = _forward_params(cls)
    config_cls = cls.config_class
    subs = set(getattr(config_cls, "sub_configs", None) or {})
    non_text = sorted(p for p in params if _NON_TEXT_INPUT.fullmatch(p))
    if non_text:
        return "multimodal", f"forward takes {non_text[0]}"
    media = sorted(s for s in subs if "vision" in s or "audio" in s)
    if media:
        return "multimodal", f"config has {media[0]}"
    default = _default_config(config_cls)
    fields = _field_defaults(config_cls, default)
    if isinstance(fields.get("num_codebooks"), int):
        return "multimodal", "config declares num_codebooks (audio codes)"
    if fields.get("is_encoder_decoder") is True or getattr(default, "is_encoder_decoder", False):
        return "cross-attention decoder", "is_encoder_decoder"
    cross = sorted(p for p in params if p in _CROSS_INPUTS)
    if cross and "add_cross_attention" not in fields:
        return "cross-attention decoder", f"forward takes {cross[0]}, no add_cross_attention switch"
    masked = [t for t in model_types if t in MODEL_FOR_MASKED_LM_MAPPING_NAMES]
    if masked:
        return "encoder as decoder", f"{masked[0]} has a masked-LM head"
    if fields.get("is_decoder") is False and "encoder_hidden_states" in params:
        return "encoder as decoder", "is_decoder defaults to False, forward takes encoder_hidden_states"
    return "decoder", "none of the above"


def state_arg(cls: type) -> str | None:
    """The ``forward`` parameter that takes the decoder's state (None: it takes none)."""
    params = _forward_params(cls)
    return next((a for a in _STATE_ARGS if a in params), None)


def state_of(cls: type, config: Any) -> str:
    """``kv`` | ``hybrid`` | ``recurrent`` | ``own`` | ``none`` (module docstring)."""
    if state_arg(cls) is None:
        return "none"
    if not cls._supports_default_dynamic_cache():
        return "own"
    kinds = set(layer_types(config))
    attention = {t for t in kinds if t not in _RECURRENT_TYPES | _NO_STATE_TYPES}
    recurrent = kinds & (_RECURRENT_TYPES | _BOTH_TYPES)
    if recurrent and attention:
        return "hybrid"
    return "recurrent" if recurrent or (kinds and not attention) else "kv"  # no layer list known: kv


def layer_types(config: Any) -> list[str]:
    """transformers' per-layer cache types of ``config`` (the layers ``StaticCache(config)`` builds)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    try:
        types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    except Exception:  # noqa: BLE001 - a config transformers cannot list layers of (BLT's nested stacks)
        return []
    return list(types)


# ------------------------------------------------------------------------------------------------- tiny configs
def _keep_min(cap: int) -> Callable[[Any, dict], Any]:
    return lambda v, ctx: min(v, cap) if _is_int(v) and v > 0 else v


def _set_if_int(value: int) -> Callable[[Any, dict], Any]:
    return lambda v, ctx: value if _is_int(v) and v > 0 else v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _kv_heads(v: Any, ctx: dict) -> Any:
    """Keep the attention kind: MHA stays MHA (kv == heads, or None: what every family derives None to), MQA
    stays MQA (1), GQA gets 2 KV heads."""
    heads = ctx.get("_heads")
    if v is None and _is_int(heads):
        return HEADS
    if not _is_int(v) or v <= 0:
        return v
    return HEADS if v == heads else 1 if v == 1 else KV_HEADS


def _head_dim(v: Any, ctx: dict) -> Any:
    """64; None (derived: hidden / heads, which is 64 too) is set explicitly, except with MLA ranks (there the
    family derives its head dim from them)."""
    if v is None and _is_int(ctx.get("_heads")) and not ctx.get("_mla"):
        return HEAD_DIM
    if ctx.get("_mla") and _is_int(v) and v == ctx.get("_rope_dim"):
        return 32  # MLA families whose head_dim is the rope dim (LongCat): keep them equal
    return HEAD_DIM if _is_int(v) and v > 0 else v


def _layers(v: Any, ctx: dict) -> Any:
    return ctx["_layers"] if _is_int(v) and v > 0 else v


def _offset(v: Any, ctx: dict) -> Any:
    return min(v, 1) if _is_int(v) and v > 0 else v


def _topk_group(v: Any, ctx: dict) -> Any:
    groups = ctx.get("_n_group")
    return min(v, groups) if _is_int(v) and _is_int(groups) and v > 0 else v


#: (field-name pattern, rule, why): applied to every field of the config (and of its sub-configs) whose name
#: fully matches; a rule gets the default value and returns the tiny one (ints only; None, "auto" and the like
#: stay, the family derives them)
FIELD_RULES: list[tuple[str, Callable[[Any, dict], Any], str]] = [
    (r"hidden_size|d_model|n_embd|embed_dim|emb_dim|model_dim|hidden_dim|lru_width", _set_if_int(HIDDEN), "width"),
    (r"num_hidden_layers|n_layers?|num_layers|decoder_layers|encoder_layers|num_(de|en)coder_layers", _layers,
     "depth: the fewest layers holding one of every layer kind (_layer_pick)"),
    (r"num_attention_heads|n_heads?|num_heads|(de|en)coder_attention_heads|attention_heads|"
     r"num_(de|en)coder_attention_heads|swa_num_attention_heads", _set_if_int(HEADS), "query heads"),
    (r"num_key_value_heads|num_kv_heads|n_head_kv|kv_n_heads|multi_query_group_num|swa_num_key_value_heads|"
     r"n_kv_heads", _kv_heads, "KV heads: MHA/MQA/GQA as the default"),
    (r"head_dim|attention_head_dim|swa_head_dim|d_head|kv_channels|attention_head_size|head_size",
     _head_dim, "head dim"),
    (r"intermediate_size|ffn_dim|(de|en)coder_ffn_dim|n_inner|d_inner|ffn_hidden_size|intermediate_size_mlp|"
     r"dense_intermediate_size|feed_forward_size|mlp_dim|output_embedding_size", _set_if_int(FFN), "dense FFN"),
    (r"moe_intermediate_size|shared_experts?_intermediate_size|moe_shared_expert_intermediate_size|"
     r"expert_ffn_hidden_size|shared_intermediate_size|expert_intermediate_size", _set_if_int(MOE_FFN),
     "expert FFN (0: no shared expert, kept)"),
    (r"num_experts|num_local_experts|n_routed_experts|moe_num_experts", _set_if_int(EXPERTS), "routed experts"),
    (r"num_experts_per_tok|moe_top_k|moe_topk|moe_k|top_k_experts|num_selected_experts", _keep_min(TOP_K),
     "experts per token"),
    (r"n_shared_experts|num_shared_experts|moe_num_shared_experts", _keep_min(1), "shared experts"),
    (r"n_group", _keep_min(2), "expert groups: 8 experts in at most 2 groups of 4 (top-2 within a group)"),
    (r"topk_group", _topk_group, "groups kept per token <= groups"),
    (r"zero_expert_num", _keep_min(EXPERTS), "identity experts"),
    (r"vocab_size", _set_if_int(VOCAB), "vocabulary"),
    (r"(?!type_).*vocab_size.*|.*_vocab", _keep_min(VOCAB),
     "other vocabularies (per-layer, audio, pronunciation, BLT's hash groups...)"),
    (r"max_position_embeddings|n_positions|n_ctx|max_seq_len|max_target_positions|max_source_positions|"
     r"context_length|original_max_position_embeddings", _keep_min(POSITIONS), "positions"),
    (r"sliding_window|sliding_window_size|attention_window_size|attention_chunk_size|local_attention|window_size",
     _keep_min(WINDOW), "windows smaller than the 32-position cache"),
    (r"q_lora_rank|kv_lora_rank", _set_if_int(64), "MLA ranks"),
    (r"qk_rope_head_dim|qk_nope_head_dim", _set_if_int(32), "MLA rope / no-rope head dims"),
    (r"v_head_dim|index_head_dim", _set_if_int(HEAD_DIM), "MLA value / indexer head dims"),
    (r"index_n_heads", _set_if_int(HEADS), "indexer heads"),
    (r"index_topk", _keep_min(WINDOW), "indexed attention: top-k tokens smaller than the cache"),
    (r"state_size|ssm_state_size|mamba_d_state", _set_if_int(16), "SSM state"),
    (r"mamba_n_heads|mamba_num_heads", _set_if_int(8), "SSM heads (8 x 64 = expand x hidden)"),
    (r"mamba_head_dim", _set_if_int(64), "SSM head dim"),
    (r"mamba_d_ssm", _set_if_int(512), "SSM width (expand x hidden)"),
    (r"n_groups|mamba_n_groups|mamba_ngroups", _keep_min(1), "SSM groups"),
    (r"mamba_chunk_size|chunk_size", _keep_min(64), "SSM scan chunk"),
    (r"linear_num_key_heads|linear_num_heads", _set_if_int(2), "linear-attention key heads"),
    (r"linear_num_value_heads", _set_if_int(4), "linear-attention value heads"),
    (r"linear_key_head_dim|linear_value_head_dim|linear_head_dim", _set_if_int(HEAD_DIM),
     "linear-attention head dims"),
    (r"first_k_dense_replace|num_dense_layers", _keep_min(1), "one dense layer before the MoE ones, if any"),
    (r".*_period|decoder_sparse_step|interleave_moe_layer_step|moe_layer_freq|sliding_window_pattern|"
     r"no_rope_layer_interval|global_attn_every_n_layers|n_layers_per_attn_res_block", _keep_min(2),
     "layer-kind periods: both kinds within 2 layers"),
    (r".*_offset", _offset, "period offsets"),
]
_COMPILED_RULES = [(re.compile(p), f, why) for p, f, why in FIELD_RULES]

#: family -> (config values the rules cannot derive, why); found by trying (each config/model __init__'s asserts)
OVERRIDES: dict[str, tuple[dict[str, Any], str]] = {
    "Bamba": (dict(attn_layer_indices=[1]),
              "the default declares Mamba layers only (attn_layer_indices None); Bamba is a hybrid, and "
              "transformers' own cache cannot prefill an all-Mamba config (get_seq_length)"),
    "GraniteMoeHybrid": (dict(layer_types=["mamba", "attention"]),
                         "the default declares Mamba layers only; the hybrid needs its attention layer (as Bamba)"),
    "Mamba2": (dict(num_heads=8), "its num_heads are SSM heads: heads x head_dim must equal expand x hidden (512)"),
    "GPTNeo": (dict(attention_types=[[["global", "local"], 1]]),
               "the per-layer attention list is generated from this (pattern, repeats) spec, one pair = 2 layers"),
    "Gemma4Assistant": (dict(text_config=dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)),
                        "its text config's per-layer-input defaults fail the assistant's validator (must be 0)"),
    "Xmod": (dict(default_language="en_XX"), "forward needs a language adapter (the default is None)"),
    "DeepseekV2": (dict(num_experts_per_tok=2), "the default is None, which the router's topk cannot take"),
    "Dots1": (dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1),
              "the defaults are None, but the model always builds routed and shared experts and a top-k router"),
    "Lfm2Moe": (dict(layer_types=["conv", "full_attention"]),
                "the default is None, which the model indexes per layer (LFM2 interleaves conv and attention)"),
    "Qwen4Exp": (dict(indexer_budget=16, indexer_compress_ratio=4, indexer_n_heads=4, indexer_kv_heads=1,
                      indexer_head_dim=64),
                 "the indexer's sizes default to None, which its validator rejects (budget a multiple of the ratio)"),
    "Dots3Note": (dict(swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=64,
                       swa_kv_lora_rank=64, swa_head_dim=64, swa_qk_nope_head_dim=32, swa_v_head_dim=64),
                  "its sliding layers' sizes are swa_* keyword aliases, not fields the rules see"),
    "Gemma3nForConditionalGeneration": (
        dict(text_config=dict(num_hidden_layers=4, num_kv_shared_layers=2, intermediate_size=FFN,
                              layer_types=["sliding_attention", "full_attention"] * 2,
                              activation_sparsity_pattern=None)), "as Gemma3n (its text config)"),
    "Gemma3n": (dict(num_hidden_layers=4, num_kv_shared_layers=2, intermediate_size=FFN,
                     layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=None),
                "the last num_kv_shared_layers layers reuse an earlier layer's KV of their type, so every type "
                "needs a producer before them: 2 producers + 2 consumers"),
}


def _field_defaults(config_cls: type, instance: Any | None = None) -> dict[str, Any]:
    """The config class's fields with their defaults (an instance's values where it could be made: these
    include what ``__post_init__`` derives, such as per-layer type lists)."""
    out: dict[str, Any] = {}
    serialized = instance.to_dict() if instance is not None else {}
    if dataclasses.is_dataclass(config_cls):
        for f in dataclasses.fields(config_cls):
            try:  # the attribute, not to_dict(): some families serialize differently from what __init__ takes
                out[f.name] = getattr(instance, f.name)
                continue
            except Exception:  # noqa: BLE001 - no instance, or a per-layer attribute of a heterogeneous config
                pass
            if f.name in serialized:
                out[f.name] = serialized[f.name]
            elif f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                out[f.name] = f.default_factory()  # type: ignore[misc]
    else:
        out.update(serialized)
    return out


_SKIP = {"transformers_version", "architectures", "id2label", "label2id", "dtype", "torch_dtype", "model_type",
         "rope_parameters", "rope_scaling", "quantization_config", "auto_map", "_name_or_path"}


def _layer_count_field(d: dict[str, Any]) -> tuple[str | None, int | None]:
    for k in ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_decoder_layers"):
        if _is_int(d.get(k)) and d[k] > 0:
            return k, d[k]
    return None, None


def _layer_pick(d: dict[str, Any], n: int) -> tuple[list[int], list[str], list[str]]:
    """Which of the default's ``n`` layers to keep: the first layer of every distinct per-layer signature (the
    values of every per-layer list field at that layer, and its membership in every layer-index list field),
    at least :data:`MIN_LAYERS`. Returns (kept indices, per-layer list fields, layer-index list fields)."""
    def index_list(k: str, v: Any) -> bool:  # layer numbers (moe_layers, full_attn_idxs, mlp_only_layers, ...)
        return (isinstance(v, (list, tuple)) and bool(v) and all(_is_int(x) and 0 <= x < n for x in v)
                and bool(re.search(r"layers$|idx|index|_ids$", k))
                and not (len(v) == n and set(v) <= {0, 1} and n > 2))  # 0/1 per-layer flags (no_rope_layers)

    index_lists = sorted(k for k, v in d.items() if k not in _SKIP and index_list(k, v))
    per_layer = sorted(k for k, v in d.items() if isinstance(v, (list, tuple)) and len(v) == n and n > 1
                       and k not in _SKIP and k not in index_lists
                       and all(isinstance(x, (str, int, bool, float, type(None))) for x in v))
    seen, keep = set(), []
    for i in range(n):
        sig = tuple(str(d[k][i]) for k in per_layer) + tuple(i in d[k] for k in index_lists)
        if sig not in seen:
            seen.add(sig)
            keep.append(i)
    for i in range(n):
        if len(keep) >= MIN_LAYERS:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep), per_layer, index_lists


def cut_layers(d: dict[str, Any], layers: int) -> dict[str, Any]:
    """The overrides that keep ``layers`` of config dict ``d``'s layers: its layer count and every per-layer list
    (``layer_types``, ...) and layer-index list (``mlp_only_layers``, ...) cut to the kept layers, which are the
    first layer of every distinct layer kind first, then the next ones in order (a 2-layer cut of a hybrid model
    keeps one layer of each kind, where a plain ``num_hidden_layers=2`` would fail the config's own validation or
    keep only the first kind). Empty when ``d`` has no more than ``layers`` layers."""
    key, n = _layer_count_field(d)
    if not n or layers >= n:
        return {}
    keep, per_layer, index_lists = _layer_pick(d, n)
    if len(keep) >= layers:
        keep = keep[:layers]
    else:
        keep = sorted(keep + [i for i in range(n) if i not in keep][: layers - len(keep)])
    out: dict[str, Any] = {key: layers}
    for k in per_layer:
        picked = [d[k][i] for i in keep]
        out[k] = type(d[k])(picked) if isinstance(d[k], tuple) else picked
    for k in index_lists:
        picked = [j for j, i in enumerate(keep) if i in d[k]]
        out[k] = type(d[k])(picked) if isinstance(d[k], tuple) else picked
    return out


def _shrink(d: dict[str, Any], layers: int | None = None) -> dict[str, Any]:
    """The tiny values of config dict ``d`` (only the fields a rule changes, plus per-layer lists cut)."""
    out: dict[str, Any] = {}
    count_key, n = _layer_count_field(d)
    keep, per_layer, index_lists = _layer_pick(d, n) if n else ([], [], [])
    ctx = {"_heads": d.get("num_attention_heads", d.get("n_head", d.get("num_heads"))),
           "_layers": layers if layers is not None else max(len(keep), MIN_LAYERS),
           "_n_group": min(d["n_group"], 2) if _is_int(d.get("n_group")) else None,
           "_mla": "kv_lora_rank" in d, "_rope_dim": d.get("qk_rope_head_dim")}
    if n and ctx["_layers"] > len(keep):  # more layers asked for (a derived layer kind was missing): the next ones
        extra = [i for i in range(n) if i not in keep]
        keep = sorted(keep + extra[: ctx["_layers"] - len(keep)])
    for key, value in d.items():
        if key in _SKIP or key.startswith("_"):
            continue
        if key in per_layer:
            picked = [value[i] for i in keep] if len(keep) <= len(value) else list(value)
            while len(picked) < ctx["_layers"]:
                picked.append(picked[len(picked) % len(keep)])
            out[key] = type(value)(picked) if isinstance(value, tuple) else picked
            continue
        if key in index_lists:
            picked = [j for j, i in enumerate(keep) if i in value]
            out[key] = type(value)(picked) if isinstance(value, tuple) else picked
            continue
        if key == "is_decoder" or (key == "causal" and value is False):
            out[key] = True  # a causal LM: encoder families run with a causal mask
            continue
        for pattern, rule, _ in _COMPILED_RULES:
            if pattern.fullmatch(key):
                new = rule(value, ctx)
                if new is not value and new != value:
                    out[key] = new
                break
    return out


def _special_ids(d: dict[str, Any], vocab: int) -> dict[str, Any]:
    """Token ids the tiny vocabulary no longer holds, moved to distinct ids at its top."""
    out: dict[str, Any] = {}
    nxt = vocab - 1
    for key in sorted(d):
        if not (key.endswith("_token_id") or key.endswith("_token_index") or key in ("unk_index", "mask_index")):
            continue
        v = d[key]
        if _is_int(v) and v >= vocab:
            out[key], nxt = nxt, nxt - 1
        elif isinstance(v, list) and any(_is_int(t) and t >= vocab for t in v):
            new = []
            for t in v:
                if _is_int(t) and t >= vocab:
                    t, nxt = nxt, nxt - 1
                new.append(t)
            out[key] = new
    return out


def tiny_kwargs(family: Family, layers: int | None = None) -> dict[str, Any]:
    """The config keyword arguments that make ``family`` tiny (rules, sub-configs, overrides)."""
    config_cls = family.model_class.config_class
    default = _default_config(config_cls)
    d = _field_defaults(config_cls, default)
    kwargs = _shrink(d, layers)
    vocab = kwargs.get("vocab_size", d.get("vocab_size"))
    if _is_int(vocab):
        kwargs.update(_special_ids({**d, **kwargs}, vocab))
    for key, declared in (getattr(config_cls, "sub_configs", None) or {}).items():
        # the default's sub-config tells the concrete class where the declaration is AutoConfig
        sub_default = getattr(default, key, None) if default is not None else None
        sub_cls = type(sub_default) if sub_default is not None and hasattr(sub_default, "to_dict") else declared
        spec = (getattr(config_cls, "sub_configs_defaults", None) or {}).get(key)
        if getattr(sub_cls, "__name__", "") == "AutoConfig" and getattr(spec, "model_type", None):
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            sub_cls = CONFIG_MAPPING[spec.model_type]
        if not isinstance(sub_cls, type) or sub_cls.__name__ == "AutoConfig":
            continue
        sub_d = _field_defaults(sub_cls, sub_default if type(sub_default) is sub_cls else _default_config(sub_cls))
        sub_kwargs = _shrink(sub_d, layers if key in ("text_config", "decoder_config") else None)
        sub_vocab = sub_kwargs.get("vocab_size", sub_d.get("vocab_size"))
        if _is_int(sub_vocab):
            sub_kwargs.update(_special_ids({**sub_d, **sub_kwargs}, sub_vocab))
        sub_kwargs.update(copy.deepcopy(OVERRIDES.get(family.name, ({}, ""))[0].get(key, {})))
        try:  # a whole dict (with model_type): AutoConfig-declared sub-configs need one
            kwargs[key] = sub_cls(**sub_kwargs).to_dict()
        except Exception as e:  # noqa: BLE001
            raise TinyBuildError(f"{sub_cls.__name__} ({key}): {_one_line(e)}") from None
    if family.name in OVERRIDES:  # (a sub-config's overrides were merged into its dict above)
        kwargs.update({k: copy.deepcopy(v) for k, v in OVERRIDES[family.name][0].items() if not isinstance(
            kwargs.get(k), dict)})
    return kwargs


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:240]}"


def tiny_config(family: Family | str, *, tie_word_embeddings: bool | None = None, **extra: Any) -> Any:
    """The family's tiny config (module docstring). Raises :class:`TinyBuildError` when the config class rejects
    it. The depth grows (up to :data:`MAX_LAYERS`) while a layer kind of the default config is missing."""
    fam = find(family) if isinstance(family, str) else family
    config_cls = fam.model_class.config_class
    default = _default_config(config_cls)
    want = set(layer_types(default)) if default is not None else set()
    last: Exception | None = None
    layers = None
    for _ in range(MAX_LAYERS):
        kwargs = tiny_kwargs(fam, layers)
        if tie_word_embeddings is not None:
            kwargs["tie_word_embeddings"] = tie_word_embeddings
        kwargs.update(extra)
        try:
            cfg = config_cls(**kwargs)
        except Exception as e:  # noqa: BLE001 - the config's own validation is the reason it cannot be built
            raise TinyBuildError(f"{config_cls.__name__}: {_one_line(e)}") from None
        try:
            have = set(layer_types(cfg))
        except Exception as e:  # noqa: BLE001
            last = e
            have = want
        n = _layer_count_field(cfg.to_dict())[1] or 0
        if want <= have or n >= MAX_LAYERS:
            if tie_word_embeddings is not None and hasattr(cfg, "tie_word_embeddings"):
                cfg.tie_word_embeddings = tie_word_embeddings
            return cfg
        layers = n + 1
    raise TinyBuildError(f"{config_cls.__name__}: layer kinds {sorted(want)} need more than {MAX_LAYERS} layers"
                         + (f" ({_one_line(last)})" if last else ""))


# ------------------------------------------------------------------------------------------------- decode cases
@dataclass
class FamilyCase(DecodeCase):
    """A :class:`~fusegraph.models.DecodeCase` of any family: the state goes in through the family's own
    ``forward`` parameter (``cache``, ``state``, ``mems``, ...; none for a family without one), positions only
    where ``forward`` takes them, and a state object the family returns anew each step replaces the old one."""

    family: Family | None = None
    state: str = "kv"  # state_of(): kv | hybrid | recurrent | own | none
    cache_kind: str = ""  # which cache the case uses, and why (the sweep's "cache" column)
    state_arg: str | None = "cache"
    takes_positions: bool = True
    config: Any = None

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, Any] = {"input_ids": tok}
        if self.takes_positions:
            kwargs["position_ids"] = pos
        if self.state_arg is not None:
            kwargs[self.state_arg] = self.cache
            kwargs["use_cache"] = True
        out = self.model(**kwargs)
        if self.state_arg is not None and self.state == "own":
            new = getattr(out, self.state_arg, None)
            if new is not None:
                self.cache = new
        return out.logits

    def fork(self) -> "FamilyCase":
        """An independent copy to decode beside this one: the cache and the model too, because some families keep
        recurrent state in their modules (RecurrentGemma's recurrent and convolution states live in its layers,
        not in the cache): a fork sharing the model would carry the other run's state (its eager reference
        diverged from step 2, with fusegraph not involved at all)."""
        return dataclasses.replace(self, model=copy.deepcopy(self.model), cache=copy.deepcopy(self.cache))

    def cache_tensors(self) -> list[torch.Tensor]:
        layers = getattr(self.cache, "layers", None)
        if layers is None:
            return []
        out = []
        for layer in layers:
            out += [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                    if isinstance(t, torch.Tensor)]
        return out


def spread_router_weights(model: torch.nn.Module, experts: int) -> int:
    """Redraw MoE router weights with a larger spread (tiny random routers otherwise tie, which makes top-k, and
    so every comparison of two executions, ill-conditioned; :func:`fusegraph.models._spread_router_weights` for
    any family): every 2-D ``*gate*`` / ``*router*`` weight with one row per expert. Returns how many."""
    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 2)
            if (p.dim() == 2 and p.shape[0] == experts and p.shape[1] > experts
                    and re.search(r"gate|router", ".".join(leaf[-2:]), re.I)
                    and not re.search(r"gate_proj|gate_up|up_gate", name)):
                p.normal_(0.0, 0.5)
                n += 1
    return n


def build_case(family: Family | str, *, tied: bool = False, dtype: str = "float32", attn: str = "eager",
               prompt_len: int = 8, max_cache_len: int = 32, seed: int = 0) -> FamilyCase:
    """A tiny decode case of ``family``: random weights (seed ``seed``), MoE routers spread, the prompt
    prefilled eagerly, and one eager decode step taken on a copy (a case eager cannot decode is not built).

    The cache: a ``StaticCache`` of the text config (what ``generate(cache_implementation="static")`` builds),
    prefilled eagerly like :func:`fusegraph.models.build_family_decode`; if the family's prefill rejects it,
    the family's own default cache (the one its forward makes when given none, as ``generate`` without a cache
    implementation); for a family that brings its own state object (:func:`state_of` ``own``), that object.
    :attr:`FamilyCase.cache_kind` records which. Raises :class:`TinyBuildError` with the reason."""
    fam = find(family) if isinstance(family, str) else family
    cls = fam.model_class
    cfg = tiny_config(fam, tie_word_embeddings=tied)
    torch_dtype = getattr(torch, dtype)
    try:
        with torch.device("meta"):  # size first: a config the rules left large must not fill the machine's memory
            meta = cls._from_config(cfg, dtype=torch_dtype, attn_implementation=attn)
    except Exception as e:  # noqa: BLE001
        raise TinyBuildError(f"model: {_one_line(e)}{_default_also_fails(cls, e)}") from None
    if param_count(meta) > MAX_PARAMS:
        big = max(meta.named_parameters(), key=lambda kv: kv[1].numel())
        raise TinyBuildError(f"still {param_count(meta) / 1e6:.0f}M parameters after shrinking (largest: {big[0]} "
                             f"{tuple(big[1].shape)})")
    del meta
    torch.manual_seed(seed)
    try:
        model = cls._from_config(cfg, dtype=torch_dtype, attn_implementation=attn).eval()
    except Exception as e:  # noqa: BLE001
        raise TinyBuildError(f"model: {_one_line(e)}") from None
    spread_router_weights(model, EXPERTS)
    from ..capture.rewrites import install_rewrites

    install_rewrites()  # before dynamo traces (build_family_decode says why)
    state = state_of(cls, model.config)
    arg = state_arg(cls)
    takes_pos = "position_ids" in _forward_params(cls)
    vocab = model.config.get_text_config(decoder=True).vocab_size if hasattr(model.config, "get_text_config") \
        else getattr(model.config, "vocab_size", VOCAB)
    prompt = torch.randint(0, max(2, min(vocab, VOCAB) - 32), (1, prompt_len))
    case = FamilyCase(name=fam.name, model=model, cache=None, token=prompt[:, -1:], dtype=torch_dtype,
                      position=torch.full((1, 1), prompt_len), options={"attn": attn, "max_cache_len": max_cache_len},
                      family=fam, state=state, state_arg=arg, takes_positions=takes_pos, config=cfg)
    cache, how = _prefill(case, prompt, max_cache_len)
    case.cache, case.cache_kind = cache, how
    probe = case.fork()
    try:
        with torch.no_grad():
            probe.step(case.token, case.position)
    except Exception as e:  # noqa: BLE001
        raise TinyBuildError(f"eager decode step ({how}): {_one_line(e)}") from None
    return case


def _default_also_fails(cls: type, error: BaseException) -> str:
    """" (the default config fails too)" when the family's own default config cannot build its model either, with
    the same error type (on the meta device: no memory)."""
    try:
        with torch.device("meta"):
            cls._from_config(cls.config_class())
    except Exception as e:  # noqa: BLE001
        if type(e) is type(error):
            return " (the family's default config fails the same way)"
    return ""


def _prefill(case: FamilyCase, prompt: torch.Tensor, max_cache_len: int) -> tuple[Any, str]:
    from transformers import DynamicCache, StaticCache

    model, arg = case.model, case.state_arg
    kwargs: dict[str, Any] = {"input_ids": prompt}

    def run(cache: Any) -> Any:
        kw = dict(kwargs)
        if arg is not None:
            kw["use_cache"] = True
            if cache is not None:
                kw[arg] = cache
        with torch.no_grad():
            out = model(**kw)
        case.token = out.logits[:, -1].argmax(-1, keepdim=True)
        return out

    if arg is None:
        try:
            run(None)
        except Exception as e:  # noqa: BLE001
            raise TinyBuildError(f"eager prefill: {_one_line(e)}") from None
        return None, "none (forward takes no cache: each step sees only its token)"
    if case.state == "own":
        try:
            out = run(None)
        except Exception as e:  # noqa: BLE001
            raise TinyBuildError(f"eager prefill: {_one_line(e)}") from None
        state = getattr(out, arg, None)
        return state, f"own ({type(state).__name__})"
    text = model.config.get_text_config(decoder=True)
    try:
        cache = StaticCache(config=text, max_cache_len=max_cache_len)
        run(cache)
        return cache, "static"
    except Exception as e:  # noqa: BLE001
        why = _one_line(e)
    try:
        out = run(None)
        cache = getattr(out, arg, None)
        if cache is None:
            cache = DynamicCache(config=text)
            run(cache)
        return cache, f"{type(cache).__name__} (static: {why[:120]})"
    except Exception as e:  # noqa: BLE001
        raise TinyBuildError(f"eager prefill: static: {why[:120]}; own: {_one_line(e)}") from None


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
