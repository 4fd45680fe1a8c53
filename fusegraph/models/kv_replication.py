"""KV heads replicated to the tensor-parallel degree, so HF's ``tp_plan="auto"`` can shard a model whose
``num_key_value_heads`` is smaller than TP.

Why: HF's plan shards ``k_proj`` / ``v_proj`` ``colwise`` by rows whatever the head count. With 2 KV heads on 4
ranks each rank gets half a head and HF's own forward fails (docs/tp.md, ``test_four_ranks_two_kv_heads``). The
standard remedy (the hand-written Qwen3 kernel at TP=8, vLLM) is to give each rank a full copy of the KV head its
query heads use. Done on the weights *before* sharding, that is the mathematically identical model with
``num_key_value_heads = tp``: each KV head repeated ``tp / num_kv_heads`` times, consecutively, so that HF's
``repeat_kv`` grouping (query head ``h`` reads KV head ``h // groups``) still pairs every query head with a copy
of the head it read before, and each rank's ``colwise`` shard is exactly one whole head.

Three entry points, one rule (:func:`kv_replication_factor`):

* :func:`replicate_kv_heads` on a single-process model (in place) or on a state dict + config;
* :func:`replicate_kv_checkpoint` on a saved checkpoint directory, one safetensors file at a time (the model is
  never built, so it works for checkpoints that do not fit one process), for ``from_pretrained(dst, tp_plan=...)``;
* :func:`replicated_kv_config` on a config alone (shape-only use: ``fusegraph.modelperf.tp``).

Refused with a one-line ``ValueError``: a TP degree that is neither a divisor nor a multiple of the KV heads, one
that does not divide the query heads, a model already sharded (DTensor weights), fused QKV projections, and KV
projection weights whose rows are not ``num_key_value_heads x head_dim``.
"""
from __future__ import annotations

import copy
import json
import logging
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

#: state-dict keys of the per-KV-head projections (rows = heads x head_dim) and of a k/v norm that may be per head
_KV_PROJ = re.compile(r"(^|\.)(k_proj|v_proj)\.(weight|bias)$")
_KV_NORM = re.compile(r"(^|\.)(k_norm)\.weight$")
#: fused projections whose KV rows are interleaved with the query rows: not rewritten (refused)
_FUSED = re.compile(r"(^|\.)(qkv_proj|W_pack|query_key_value|c_attn|Wqkv)\.weight$")


def _text_config(config: Any) -> Any:
    """The decoder's config (a multimodal config's ``text_config``; the config itself otherwise)."""
    if isinstance(config, Mapping):
        return config.get("text_config", config) if "num_key_value_heads" not in config else config
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _get(config: Any, name: str, default: Any = None) -> Any:
    return config.get(name, default) if isinstance(config, Mapping) else getattr(config, name, default)


def _heads(config: Any) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of a config (a dict or an HF ``PretrainedConfig``)."""
    cfg = _text_config(config)
    q = _get(cfg, "num_attention_heads")
    if q is None:
        raise ValueError("the config has no num_attention_heads: not a decoder config this helper knows")
    kv = _get(cfg, "num_key_value_heads")
    kv = q if kv is None else kv
    if not isinstance(kv, int):
        raise ValueError(f"num_key_value_heads={kv!r} (per-layer KV head counts) is not supported")
    hd = _get(cfg, "head_dim") or int(_get(cfg, "hidden_size")) // int(q)
    return int(q), int(kv), int(hd)


def kv_replication_factor(num_kv_heads: int, tp: int, num_heads: int | None = None) -> int:
    """How many copies of each KV head TP=``tp`` needs: 1 when ``tp`` divides the KV heads (HF's plan shards them
    as they are), ``tp // num_kv_heads`` when it is a multiple of them (one full copy per rank). Anything else
    cannot give every rank whole heads and raises ``ValueError`` (one line)."""
    tp, kv = int(tp), int(num_kv_heads)
    if tp < 1 or kv < 1:
        raise ValueError(f"tp={tp} and num_key_value_heads={kv} must be positive")
    if num_heads is not None and int(num_heads) % tp:
        raise ValueError(f"tp={tp} does not divide num_attention_heads={num_heads}: query heads cannot be sharded")
    if kv % tp == 0:
        return 1
    if tp % kv:
        raise ValueError(f"tp={tp} is neither a divisor nor a multiple of num_key_value_heads={kv}: "
                         "KV heads can be neither split nor replicated evenly")
    return tp // kv


def replicated_kv_config(config: Any, tp: int) -> tuple[Any, int]:
    """A copy of ``config`` (dict or ``PretrainedConfig``) with ``num_key_value_heads`` replicated to ``tp`` where
    needed, and the factor (1: unchanged copy)."""
    q, kv, _ = _heads(config)
    factor = kv_replication_factor(kv, tp, q)
    out = copy.deepcopy(config)
    if factor > 1:
        cfg = _text_config(out)
        if isinstance(cfg, dict):
            cfg["num_key_value_heads"] = kv * factor
        else:
            cfg.num_key_value_heads = kv * factor
    return out, factor


def repeat_heads(t: torch.Tensor, num_kv_heads: int, factor: int) -> torch.Tensor:
    """``t`` (dim 0 = ``num_kv_heads`` heads of equal size) with each head repeated ``factor`` times
    consecutively: new head ``j`` is old head ``j // factor``, the order HF's ``repeat_kv`` expands heads in (so
    query head ``h`` still reads a copy of old KV head ``h // groups``)."""
    if t.shape[0] % num_kv_heads:
        raise ValueError(f"dim 0 of a KV tensor ({t.shape[0]}) is not a multiple of num_key_value_heads={num_kv_heads}")
    heads = t.reshape(num_kv_heads, t.shape[0] // num_kv_heads, *t.shape[1:])
    return heads.repeat_interleave(factor, dim=0).reshape(t.shape[0] * factor, *t.shape[1:]).contiguous()


def _rewrite(key: str, t: torch.Tensor, kv: int, hd: int, factor: int) -> torch.Tensor | None:
    """The replicated tensor of state-dict entry ``key``, or None when it is not per KV head."""
    if _FUSED.search(key):
        raise ValueError(f"{key}: fused QKV projections are not supported (split them into q/k/v_proj first)")
    if _KV_PROJ.search(key):
        if t.shape[0] != kv * hd:
            raise ValueError(f"{key}: {t.shape[0]} rows, expected num_key_value_heads x head_dim = {kv} x {hd}")
        return repeat_heads(t, kv, factor)
    if _KV_NORM.search(key) and t.dim() == 1 and t.shape[0] == kv * hd and kv > 1:
        # a norm over all KV features (one weight per head and feature): the same weights per copy; a norm of
        # head_dim weights (Qwen3's k_norm) is shared by every head and stays as it is
        return repeat_heads(t, kv, factor)
    return None


def replicate_kv_state_dict(state_dict: Mapping[str, torch.Tensor], config: Any,
                            tp: int) -> tuple[dict[str, torch.Tensor], Any]:
    """``(state dict, config)`` of the replicated model: k_proj / v_proj weights and biases (and a per-head k/v
    norm) repeated per head, ``num_key_value_heads`` of the config copy set to the replicated count. Tensors
    that are not per KV head are the input's own (not copied)."""
    _, kv, hd = _heads(config)
    new_config, factor = replicated_kv_config(config, tp)
    out: dict[str, torch.Tensor] = {}
    for key, t in state_dict.items():
        _refuse_sharded(key, t)
        new = _rewrite(key, t, kv, hd, factor) if factor > 1 else None
        out[key] = t if new is None else new
    return out, new_config


def _refuse_sharded(name: str, t: Any) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        raise ValueError(f"{name} is already sharded (DTensor): replicate the KV heads before "
                         "from_pretrained(..., tp_plan=...) shards the model")


def _replicate_module(model: torch.nn.Module, tp: int) -> torch.nn.Module:
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config: pass a state dict and its config instead")
    q, kv, hd = _heads(config)
    factor = kv_replication_factor(kv, tp, q)
    for name, p in model.named_parameters():
        _refuse_sharded(name, p)
    if factor == 1:
        log.info("tp=%d divides num_key_value_heads=%d: model left unchanged", tp, kv)
        return model
    rewritten = 0
    for mod_name, mod in model.named_modules():
        for pname, p in list(mod.named_parameters(recurse=False)):
            key = f"{mod_name}.{pname}" if mod_name else pname
            new = _rewrite(key, p.data, kv, hd, factor)
            if new is None:
                continue
            setattr(mod, pname, torch.nn.Parameter(new, requires_grad=p.requires_grad))
            rewritten += 1
            if isinstance(mod, torch.nn.Linear):
                mod.out_features = new.shape[0]
            elif hasattr(mod, "normalized_shape"):
                mod.normalized_shape = (new.shape[0],)
        if hasattr(mod, "k_proj"):  # HF attention modules keep the head counts they were built with
            if isinstance(getattr(mod, "num_key_value_groups", None), int):
                mod.num_key_value_groups = q // (kv * factor)
            if isinstance(getattr(mod, "num_key_value_heads", None), int):
                mod.num_key_value_heads = kv * factor
    if rewritten == 0:
        raise ValueError(f"{type(model).__name__}: no k_proj/v_proj weights found to replicate")
    cfg = _text_config(config)
    cfg.num_key_value_heads = kv * factor
    log.info("KV heads replicated %dx (%d -> %d) in %d tensors", factor, kv, kv * factor, rewritten)
    return model


def replicate_kv_heads(model_or_state: Any, tp: int, *, config: Any = None) -> Any:
    """Rewrite a model so TP=``tp`` gives every rank whole KV heads: each KV head repeated ``tp / num_kv_heads``
    times (unchanged when ``tp`` divides the KV heads).

    * an ``nn.Module`` with a ``.config`` (an HF model, single process, before any sharding): rewritten **in
      place** and returned; save it with ``save_pretrained`` and load that with ``tp_plan="auto"``;
    * a state dict with ``config=`` (a dict or ``PretrainedConfig``): returns ``(state_dict, config)``.

    For a checkpoint too large to load in one process use :func:`replicate_kv_checkpoint`."""
    if isinstance(model_or_state, torch.nn.Module):
        if config is not None:
            raise ValueError("config= is for a state dict; a model's own .config is used")
        return _replicate_module(model_or_state, tp)
    if isinstance(model_or_state, Mapping):
        if config is None:
            raise ValueError("a state dict needs its config= (num_attention_heads, num_key_value_heads, head_dim)")
        return replicate_kv_state_dict(model_or_state, config, tp)
    raise ValueError(f"replicate_kv_heads takes an nn.Module or a state dict, not {type(model_or_state).__name__}")


def replicate_kv_checkpoint(src: str | Path, dst: str | Path, tp: int) -> Path:
    """Write the replicated copy of HF checkpoint directory ``src`` (``config.json`` + ``*.safetensors``) to
    ``dst``, one weight file at a time (peak memory: one file and its KV copies), other files copied as they are;
    then ``from_pretrained(dst, distributed_config=DistributedConfig(tp_plan="auto"))`` on every rank."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file():
        raise ValueError(f"{src}: no config.json (not an HF checkpoint directory)")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src}: no *.safetensors weight files (save with safe_serialization=True)")
    if src.resolve() == dst.resolve():
        raise ValueError(f"{dst}: write the replicated checkpoint to a new directory, not over the original")
    config = json.loads((src / "config.json").read_text())
    _, kv, hd = _heads(config)
    new_config, factor = replicated_kv_config(config, tp)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, dst / f.name)  # tokenizer, generation config, the weight index (keys unchanged)
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        if factor > 1:
            for k, t in tensors.items():
                new = _rewrite(k, t, kv, hd, factor)
                if new is not None:
                    tensors[k] = new
        save_file(tensors, str(dst / f.name), metadata={**meta, "format": meta.get("format", "pt")})
    (dst / "config.json").write_text(json.dumps(new_config, indent=2, sort_keys=True) + "\n")
    log.info("%s -> %s: KV heads replicated %dx (%d -> %d)", src, dst, factor, kv, kv * factor)
    return dst
