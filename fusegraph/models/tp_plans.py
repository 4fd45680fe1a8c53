"""Complete tensor-parallel plans for the transformers families whose own plan misses the decoder (issue 27).

HF's ``tp_plan="auto"`` shards what the config's ``base_model_tp_plan`` (plus the class's ``_tp_plan``) names. In
transformers 5.24 some families name almost nothing: GPT-OSS's plan is ``{"embed_tokens": "embedding_rowwise"}``
(with ``lm_head``'s ``colwise_gather_output``), LFM2's the same, LFM2-MoE's only its experts. HF then runs every
decoder layer **replicated** on every rank: correct, but no tensor parallelism (each rank holds and computes the
whole decoder) and no collective inside the layers. :func:`tp_plan` returns a complete plan for such a family, and
:func:`apply_tp_plan` puts it on a config (or a model's config, before it is built) so that
``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))`` or ``Model(config)`` + HF's own
sharding use it, the way :func:`fusegraph.replicate_kv_heads` prepares a model *before* HF shards it.

One rule per family, as a table of HF plan entries (``docs/tp.md``, "Models whose HF plan is incomplete"):

* **GPT-OSS** (``gpt_oss``): attention ``q/k/v_proj`` ``colwise`` (their biases with them), ``o_proj`` ``rowwise``
  (its bias added once, after the all-reduce: HF's rowwise), the per-head ``sinks`` ``colwise`` (``Shard(0)``: each
  rank keeps the sinks of its own heads) with ``local_params`` on ``self_attn`` (its forward reads the sinks as a
  local tensor); the router replicated (no entry); the experts sharded on the intermediate dim in GPT-OSS's own
  layout: ``gate_up_proj`` ``[E, H, 2I]`` (gate and up columns *interleaved*, ``[..., ::2]`` / ``[..., 1::2]``) and
  its bias ``[E, 2I]`` by contiguous blocks of the last dim (HF's ``rowwise`` on a non-``bias`` parameter:
  ``Shard(-1)``; a block of ``2I / tp`` interleaved columns holds the gate *and* up columns of intermediate units
  ``[r I/tp, (r+1) I/tp)``, so the local ``::2`` / ``1::2`` split stays right), ``down_proj`` ``[E, I, H]`` by rows
  (HF's ``colwise`` on a 3-D parameter: ``Shard(1)``), and the experts module
  ``fusegraph_moe_tp_experts_bias_once``: HF's ``moe_tp_experts`` (local weights, one all-reduce of the experts'
  partial sums) with the replicated ``down_proj_bias`` ``[E, H]`` counted once (rank 0 adds it, the others add
  it times 0, so the all-reduce sums it once).
* **LFM2** (``lfm2``, and the decoder of ``lfm2_moe`` next to its own expert rules): attention ``q/k/v_proj``
  ``colwise``, ``out_proj`` ``rowwise`` (``q/k_layernorm`` act per head on ``head_dim`` features: replicated); the
  dense MLP ``w1``/``w3`` ``colwise``, ``w2`` ``rowwise``; the short-convolution layer's ``in_proj`` ``[3H, H]``
  (``B``, ``C``, ``x`` stacked, split by ``chunk(3)``) ``fusegraph_packed3_colwise`` (``_StridedShard(0, 3)``:
  each rank holds its channel block of ``B``, of ``C`` and of ``x``), the depthwise ``conv`` weight ``[H, 1, L]``
  and bias ``fusegraph_channelwise`` (``Shard(0)``: the rank's channels), ``out_proj`` ``rowwise``, and the
  layer ``fusegraph_local_params_recursive`` (its forward reads ``self.conv.weight`` directly, so the child's
  sharded parameters are read as local tensors). The conv state is then per rank: ``[B, H/tp, L]``.

Why four fusegraph styles: HF 5.24 registers no style for them. ``RowwiseParallel`` hides a ``Linear``'s ``bias``
during the local matmul and adds it after the all-reduce, but GPT-OSS's expert bias is added *inside* the experts'
forward, per chosen expert and weighted by the router, before ``moe_tp_experts``' all-reduce, so with every rank
holding it the all-reduce adds it ``tp`` times; ``packed_colwise`` has ``split_factor=2`` only (LFM2 packs three)
and shards a 1-D bias contiguously; ``colwise`` shards a 3-D parameter on dim 1 (the conv weight needs dim 0);
``local_params`` localizes a module's own parameters, not a child's. The styles are registered in HF's
``ALL_PARALLEL_STYLES`` when this module is imported (``tp_plan`` / ``apply_tp_plan`` import it), on every rank,
before the model is sharded. ``base_model_tp_plan`` is not saved with the config (HF drops it), so a saved config
never names them.

Refused with a one-line ``ValueError``: a family with no complete plan (neither its own nor one here), a ``tp`` that
does not divide the query heads, the KV heads (``tp`` a multiple of them: replicate them first with
:func:`fusegraph.replicate_kv_heads`), GPT-OSS's ``intermediate_size`` or LFM2's hidden size / MLP width, and a
model already sharded (DTensor parameters).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

#: the families whose HF plan misses the decoder, and the table completing it (keys relative to the base model,
#: as in ``config.base_model_tp_plan``; HF adds ``embed_tokens`` and the class's ``lm_head`` rule itself)
_GPT_OSS = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.self_attn.sinks": "colwise",
    "layers.*.self_attn": "local_params",
    "layers.*.mlp.experts.gate_up_proj": "rowwise",
    "layers.*.mlp.experts.gate_up_proj_bias": "rowwise",
    "layers.*.mlp.experts.down_proj": "colwise",
    "layers.*.mlp.experts": "fusegraph_moe_tp_experts_bias_once",
}
_LFM2 = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.out_proj": "rowwise",
    "layers.*.conv.in_proj": "fusegraph_packed3_colwise",
    "layers.*.conv.conv": "fusegraph_channelwise",
    "layers.*.conv.out_proj": "rowwise",
    "layers.*.conv": "fusegraph_local_params_recursive",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
}
FAMILY_PLANS: dict[str, dict[str, str]] = {"gpt_oss": _GPT_OSS, "lfm2": _LFM2, "lfm2_moe": _LFM2}

#: a plan that names any of these shards the decoder layers: the family's own plan is complete enough to keep
_DECODER_KEYS = ("q_proj", "qkv_proj", "query_key_value", "o_proj", "down_proj", "experts")


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _config_of(model_or_config: Any) -> Any:
    if isinstance(model_or_config, torch.nn.Module):
        config = getattr(model_or_config, "config", None)
        if config is None:
            raise ValueError(f"{type(model_or_config).__name__} has no .config: pass its config")
        return config
    if not hasattr(model_or_config, "model_type"):
        raise ValueError(f"tp_plan takes an HF model or PretrainedConfig, not {type(model_or_config).__name__}")
    return model_or_config


def _divides(tp: int, n: Any, what: str, hint: str = "") -> None:
    if n is not None and int(n) % tp:
        raise ValueError(f"tp={tp} does not divide {what}={n}{hint}")


def _check_heads(cfg: Any, tp: int) -> None:
    q = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or q
    _divides(tp, q, "num_attention_heads", ": query heads cannot be sharded")
    if kv % tp:
        hint = (": replicate the KV heads first (fusegraph.replicate_kv_heads / replicate_kv_checkpoint)"
                if tp % kv == 0 else ": KV heads can be neither split nor replicated evenly")
        raise ValueError(f"tp={tp} does not divide num_key_value_heads={kv}{hint}")


def _lfm2_mlp_width(cfg: Any) -> int:
    """The width of LFM2's dense MLP as ``Lfm2MLP`` computes it (``block_auto_adjust_ff_dim``)."""
    inter = int(cfg.intermediate_size)
    if getattr(cfg, "block_auto_adjust_ff_dim", False):
        inter = int(2 * inter / 3)
        mult = getattr(cfg, "block_ffn_dim_multiplier", None)
        if mult is not None:
            inter = int(mult * inter)
            m = int(cfg.block_multiple_of)
            inter = m * ((inter + m - 1) // m)
    return inter


def _check(model_type: str, cfg: Any, tp: int) -> None:
    """The family's divisibility rules for ``tp`` (one-line ValueError)."""
    _check_heads(cfg, tp)
    if model_type == "gpt_oss":
        # 2I/tp interleaved gate/up columns per rank must start at a gate column and hold whole (gate, up) pairs
        _divides(tp, cfg.intermediate_size, "intermediate_size",
                 ": the experts' interleaved gate/up columns cannot be split into whole pairs")
    else:  # lfm2, lfm2_moe
        _divides(tp, cfg.hidden_size, "hidden_size", ": the short convolution's channels cannot be sharded")
        if model_type == "lfm2":
            _divides(tp, _lfm2_mlp_width(cfg), "the MLP width")
        else:
            _divides(tp, cfg.intermediate_size, "intermediate_size (the dense layers' MLP)")
            _divides(tp, cfg.moe_intermediate_size, "moe_intermediate_size")


def tp_plan(model_or_config: Any, tp: int | None = None) -> dict[str, str]:
    """The complete ``base_model_tp_plan`` of an HF model or config (keys relative to the base model, e.g.
    ``"layers.*.self_attn.q_proj"``): the family's own plan where it already shards the decoder, else the
    config's plan completed by the family's table (module docstring). With ``tp``, the sizes are checked for that
    degree (one-line ``ValueError`` for what it cannot shard). ``DistributedConfig(tp_plan=...)`` takes the same
    rules with the model's prefix (``{"model." + k: v}``); :func:`apply_tp_plan` sets them on the config."""
    register_styles()
    config = _config_of(model_or_config)
    if isinstance(model_or_config, torch.nn.Module):
        _refuse_sharded(model_or_config)
    cfg = _text_config(config)
    model_type = getattr(cfg, "model_type", None)
    own = dict(getattr(cfg, "base_model_tp_plan", None) or {})
    if tp is not None:
        tp = int(tp)
        if tp < 1:
            raise ValueError(f"tp={tp} must be positive")
    if model_type not in FAMILY_PLANS:
        if not any(k.rsplit(".", 1)[-1] in _DECODER_KEYS or ".experts" in k for k in own):
            raise ValueError(f"model_type {model_type!r}: its HF plan does not shard the decoder and fusegraph has "
                             f"no plan for it (known: {', '.join(sorted(FAMILY_PLANS))})")
        if tp is not None and tp > 1:
            _check_heads(cfg, tp)
        return own
    if tp is not None and tp > 1:
        _check(model_type, cfg, tp)
    return {**own, **FAMILY_PLANS[model_type]}


def apply_tp_plan(config_or_model: Any, tp: int | None = None) -> Any:
    """Set :func:`tp_plan`'s plan as ``base_model_tp_plan`` of the config (and of its ``text_config``), in place,
    and return the argument. Call it on every rank before the model is built: on the config passed to
    ``from_pretrained(path, config=config, distributed_config=DistributedConfig(tp_plan="auto"))`` or to
    ``Model(config)`` / ``Model._from_config(config)`` before HF's sharding (``maybe_distribute_model``). A model
    built before the call keeps the plan it was built with (HF copies the plan in ``__init__``): refused."""
    if isinstance(config_or_model, torch.nn.Module):
        raise ValueError(f"{type(config_or_model).__name__} is already built with its plan: apply_tp_plan to its "
                         "config before building or loading it (from_pretrained(path, config=config, ...))")
    plan = tp_plan(config_or_model, tp)
    # a composite config (a VLM's text_config): the text model reads its own config's plan, prefixed by HF
    _text_config(config_or_model).base_model_tp_plan = dict(plan)
    return config_or_model


def _refuse_sharded(model: torch.nn.Module) -> None:
    from torch.distributed.tensor import DTensor

    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            raise ValueError(f"{name} is already sharded (DTensor): take the plan from the config before "
                             "from_pretrained(..., tp_plan=...) shards the model")


# ---- the styles HF lacks (module docstring), registered in transformers' ALL_PARALLEL_STYLES ----------------------
_REGISTERED = False


def register_styles() -> None:
    """Register fusegraph's four parallel styles with transformers (idempotent; needs torch.distributed)."""
    global _REGISTERED
    if _REGISTERED:
        return
    import torch.distributed as dist

    if not dist.is_available():
        return
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES, _use_local_dtensor_params
    from transformers.distributed.tensor_parallel import (ColwiseParallel, MoeExpertsParallel,
                                                          TensorParallelLayer)

    def _shard(module: torch.nn.Module, param: str, mesh: Any, placement: Any) -> None:
        meta = module._parameters.get(param)
        if meta is None or isinstance(meta, DTensor):
            return
        module._parameters[param] = torch.nn.Parameter(
            distribute_tensor(meta, mesh, [placement], src_data_rank=None), requires_grad=meta.requires_grad)

    class MoeTpExpertsBiasOnce(MoeExpertsParallel):
        """``moe_tp_experts`` for experts whose forward adds a replicated output bias (GPT-OSS ``down_proj_bias``)
        per chosen expert before the all-reduce: every rank but the first adds it times 0, so it is summed once.
        The scale is a constant of each rank's program (a multiply on every rank: the ranks' graphs have the same
        ops)."""

        bias_names = ("down_proj_bias",)

        def install_forward(self, module: torch.nn.Module, mesh: Any) -> torch.nn.Module:
            # a bool, so the compiled step specializes on it (a float attribute becomes a graph input under dynamo)
            module._fusegraph_adds_bias = mesh.get_local_rank() == 0
            return super().install_forward(module, mesh)

        @contextlib.contextmanager
        def context_around_forward(self, module: torch.nn.Module, mesh: Any):
            with _use_local_dtensor_params(module):
                saved = {n: module._parameters[n] for n in self.bias_names if module._parameters.get(n) is not None}
                for n, b in saved.items():
                    module._parameters[n] = b * (1.0 if module._fusegraph_adds_bias else 0.0)
                try:
                    yield
                finally:  # restored before the local parameters are (HF re-wraps a local it does not know)
                    module._parameters.update(saved)

    class Packed3Colwise(ColwiseParallel):
        """``colwise`` for a ``Linear`` whose output stacks three equal blocks split by ``chunk(3)`` (LFM2's
        ``in_proj``: B, C, x): weight rows and bias ``_StridedShard(0, split_factor=3)``, so each rank holds its
        slice of each block and its local ``chunk(3)`` gives its slices of B, C and x."""

        def shard_param(self, module: torch.nn.Module, param: str, mesh: Any) -> None:
            _shard(module, param, mesh, _StridedShard(0, split_factor=3))

    class Channelwise(TensorParallelLayer):
        """A parameter sharded on dim 0 (per-channel tensors: a depthwise conv's weight ``[C, 1, L]`` and bias)."""

        def shard_param(self, module: torch.nn.Module, param: str, mesh: Any) -> None:
            _shard(module, param, mesh, Shard(0))

    class LocalParamsRecursive(TensorParallelLayer):
        """``local_params`` over the module's whole subtree: for a forward that reads a child's parameters directly
        (LFM2's short conv reads ``self.conv.weight``)."""

        def should_use_local_tensors(self, module: torch.nn.Module) -> bool:
            return True

        @contextlib.contextmanager
        def context_around_forward(self, module: torch.nn.Module, mesh: Any):
            with contextlib.ExitStack() as stack:
                for m in module.modules():
                    stack.enter_context(_use_local_dtensor_params(m))
                yield

    for name, style in (("fusegraph_moe_tp_experts_bias_once", MoeTpExpertsBiasOnce()),
                        ("fusegraph_packed3_colwise", Packed3Colwise()),
                        ("fusegraph_channelwise", Channelwise()),
                        ("fusegraph_local_params_recursive", LocalParamsRecursive())):
        ALL_PARALLEL_STYLES.register(name, style)
    _REGISTERED = True

