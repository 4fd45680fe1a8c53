"""Bundled model configs and decode-step builders (no downloads: HF models built from configs, random weights).

Tiny configs are for numerics (2 layers, run on CPU in milliseconds); full-size configs are built on the
``meta`` device, where no memory is allocated, for structure and scale (capture, matching, shape-only profiles).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

TINY_DIMS = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
                 max_position_embeddings=512)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # "llama" | "qwen3" | "qwen3_moe"
    description: str
    config: dict[str, Any]
    meta: bool = False  # full size: build on the meta device
    dtype: str = "float32"  # default dtype (full-size models default to bf16, as deployed)
    config_class: Any = None  # a user's family (fusegraph.models.custom): its config and causal-LM classes
    model_class: Any = None

    def make_config(self, **overrides: Any):
        """The config with ``overrides``; a smaller ``num_hidden_layers`` also cuts the per-layer lists
        (``layer_types``...) to the layers kept (:func:`.families.cut_layers`)."""
        cfg_cls = self.config_class or _families()[self.family][0]
        if isinstance(overrides.get("num_hidden_layers"), int):
            from .families import cut_layers

            overrides = {**cut_layers(self.config, overrides["num_hidden_layers"]), **overrides}
        return cfg_cls(**{**self.config, **overrides})

    def causal_lm_class(self) -> type:
        return self.model_class or _families()[self.family][1]


def _families() -> dict[str, tuple[type, type]]:
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    return {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }


MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec("llama-tiny", "llama", "Llama, 2 layers, hidden 256, GQA 4q/2kv heads", dict(TINY_DIMS)),
        ModelSpec("qwen3-tiny", "qwen3", "Qwen3 dense (q/k-norm), 2 layers, hidden 256", dict(TINY_DIMS)),
        ModelSpec(
            "qwen3-moe-tiny", "qwen3_moe",
            "Qwen3-MoE, 2 layers, hidden 256, 8 experts top-2 (renormalized, like Qwen3-30B-A3B)",
            dict(TINY_DIMS, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                 mlp_only_layers=[], norm_topk_prob=True),
        ),
        ModelSpec(
            "qwen3-30b-a3b", "qwen3_moe", "Qwen3-30B-A3B at full size (48 layers, 128 experts top-8), meta device",
            dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                 num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                 num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                 rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False),
            meta=True, dtype="bfloat16",
        ),
        ModelSpec(
            "llama3-8b", "llama", "Llama-3-8B dimensions (32 layers, hidden 4096, GQA 32q/8kv), meta device",
            dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                 max_position_embeddings=8192, tie_word_embeddings=False),
            meta=True, dtype="bfloat16",
        ),
    ]
}


@dataclass
class DecodeCase:
    """A model with a static KV cache after prefill, and the next decode step's inputs.

    ``step(tok, pos)`` is the decode step users compile: one token per sequence, positions as a tensor (so it
    never recompiles), the cache updated in place.
    """

    name: str
    model: torch.nn.Module
    cache: Any
    token: torch.Tensor  # [B, 1] int64
    position: torch.Tensor  # [B, 1] int64
    dtype: torch.dtype
    options: dict[str, Any]

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tok, cache=self.cache, position_ids=pos, use_cache=True).logits

    def fork(self) -> "DecodeCase":
        """Same model and inputs, an independent copy of the cache (to compare two executions side by side)."""
        return dataclasses.replace(self, cache=copy.deepcopy(self.cache))

    def cache_tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds, layer by layer (KV layers' keys and values; a linear-attention or
        convolution layer's states), so two executions' caches compare whatever the family keeps."""
        out = []
        for layer in self.cache.layers:
            out += [t for _, t in sorted(vars(layer).items()) if isinstance(t, torch.Tensor)]
        return out


def build_decode(name: str, *, dtype: str | torch.dtype | None = None, attn: str = "eager",
                 experts: str = "batched_mm", batch: int = 1, prompt_len: int = 8, max_cache_len: int = 32,
                 num_layers: int | None = None, device: str | None = None, seed: int = 0,
                 config_overrides: dict[str, Any] | None = None) -> DecodeCase:
    """Build a bundled model and its decode step. Tiny models are prefilled eagerly on CPU; meta models are not."""
    from transformers import StaticCache

    spec = MODELS[name] if name in MODELS else resolve_model(name)
    dtype = dtype or spec.dtype
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    overrides = dict(config_overrides or {})
    if num_layers is not None:
        overrides["num_hidden_layers"] = num_layers
    cfg = spec.make_config(**overrides)
    model_cls = spec.causal_lm_class()
    kwargs: dict[str, Any] = {"attn_implementation": attn}
    if spec.family == "qwen3_moe":
        kwargs["experts_implementation"] = experts
    device = device or ("meta" if spec.meta else "cpu")
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls._from_config(cfg, dtype=torch_dtype, **kwargs).eval()
    if device != "meta":
        _spread_router_weights(model)
    if spec.model_class is not None:  # a user's family: its classes were just imported (see build_family_decode)
        from ..capture.rewrites import install_rewrites

        install_rewrites()
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    if device == "meta":
        if spec.config_class is not None:  # another family: its cache layers' shapes are its own (MLA's latent and
            # rotary parts, linear-attention states): a prefill on the meta device initializes them as HF does
            with torch.no_grad():
                model(input_ids=torch.zeros(batch, prompt_len, dtype=torch.long, device="meta"), cache=cache,
                      use_cache=True)
        else:
            kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            cache.early_initialization(batch, kv_heads, head_dim, torch_dtype, torch.device("meta"))
        token = torch.zeros(batch, 1, dtype=torch.long, device="meta")
        position = torch.full((batch, 1), prompt_len, dtype=torch.long, device="meta")
    else:
        prompt = torch.randint(0, cfg.vocab_size, (batch, prompt_len))
        with torch.no_grad():
            logits = model(input_ids=prompt, cache=cache, use_cache=True).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        position = torch.full((batch, 1), prompt_len, dtype=torch.long)
    return DecodeCase(name=name, model=model, cache=cache, token=token, position=position, dtype=torch_dtype,
                      options={"attn": attn, "experts": experts, "batch": batch, "max_cache_len": max_cache_len})


def resolve_model(name: str, size: str = "tiny") -> ModelSpec:
    """The spec of ``name``: a bundled model, or an HF family name / config.json path
    (:mod:`fusegraph.models.custom`, ``size`` "tiny" or "full"), which is then registered in :data:`MODELS` under
    ``name`` so that every command finds it. Raises ``KeyError`` (unknown name) or ``ValueError`` (a config
    that cannot be built), each with a one-line message."""
    from .custom import ModelSpecError, custom_spec

    if name in MODELS and MODELS[name].model_class is None:
        return MODELS[name]
    try:
        spec = custom_spec(name, size)
    except ModelSpecError as e:
        if name in MODELS:
            return MODELS[name]
        if str(e).startswith("unknown model"):
            raise KeyError(str(e)) from None
        raise
    MODELS[name] = spec
    return spec


def build_family_decode(family: str, *, attn: str = "eager", dtype: str = "float32", prompt_len: int = 8,
                        max_cache_len: int = 32, seed: int = 0, **config: Any) -> DecodeCase:
    """A tiny decode step of any HF decoder family (``transformers.<family>ForCausalLM`` and its config class,
    e.g. ``"Mistral"``, ``"Phi3"``, ``"Gemma3"``), with :data:`TINY_DIMS` overridden by ``config``, prefilled
    eagerly: how fusegraph is tried on decoders beyond the bundled ones."""
    import transformers
    from transformers import StaticCache

    model_cls = getattr(transformers, family + "ForCausalLM")
    config_cls = model_cls.config_class  # e.g. Gemma3ForCausalLM: the text-only Gemma3TextConfig
    cfg = config_cls(**{**TINY_DIMS, **config})
    if isinstance(getattr(cfg, "pad_token_id", None), int) and cfg.pad_token_id >= cfg.vocab_size:
        # the family's default pad id (e.g. Phi-3's 32000) does not fit the tiny vocabulary
        cfg = config_cls(**{**TINY_DIMS, "pad_token_id": 0, **config})
    torch.manual_seed(seed)
    model = model_cls._from_config(cfg, dtype=getattr(torch, dtype), attn_implementation=attn).eval()
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len))
    with torch.no_grad():
        logits = model(input_ids=prompt, cache=cache, use_cache=True).logits
    token = logits[:, -1].argmax(-1, keepdim=True)
    # install capture rewrites for classes this family just imported *before* dynamo traces (patching a class
    # while dynamo compiles a frame that uses it trips a dynamo guard error)
    from ..capture.rewrites import install_rewrites

    install_rewrites()
    return DecodeCase(name=family, model=model, cache=cache, token=token, position=torch.full((1, 1), prompt_len),
                      dtype=getattr(torch, dtype), options={"attn": attn, "max_cache_len": max_cache_len})


def _spread_router_weights(model: torch.nn.Module) -> None:
    """Redraw MoE router weights with a larger spread: tiny random routers otherwise tie, which makes top-k
    (and so every comparison of two executions) ill-conditioned."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight") and p.dim() == 2 and p.shape[0] < p.shape[1]:
                p.normal_(0.0, 0.5)


def greedy_decode(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], token: torch.Tensor,
                  position: torch.Tensor, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run ``steps`` greedy decode steps; return (tokens fed, logits per step)."""
    tokens, logits = [], []
    tok, pos = token.clone(), position.clone()
    with torch.no_grad():
        for _ in range(steps):
            out = step(tok, pos)
            tokens.append(tok.clone())
            logits.append(out.detach().clone())
            tok = out[:, -1].argmax(-1, keepdim=True)
            pos = pos + 1
    return tokens, logits
