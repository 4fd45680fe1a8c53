"""``--model FAMILY`` and ``--model path/to/config.json``: a decode step of the user's own HF decoder config.

Besides the bundled names (``fusegraph models``) and ``module:function``, the CLI builds any HF decoder family
from its config class, with random weights: a ``model_type`` (``llama``, ``qwen2``, ``mistral``, ...) or the
class-name prefix the benchmarks use (``Mistral``, ``Qwen3Moe``) gives the family's default config; a
``config.json`` file (or a directory holding one) gives the user's model. ``size="tiny"`` shrinks the
dimensions to :data:`~fusegraph.models.TINY_DIMS` (2 layers, hidden 256) and the experts to 8 (top-2) while
keeping the family's structure (GQA/MQA/MHA, MoE, layer types, norms, rope, tied embeddings), so it runs with
data on CPU; ``size="full"`` keeps the config as written and builds it on the ``meta`` device (structure and
scale: capture, matching, shape-only profiles).

Why a registry entry: :func:`resolve_model` adds the resolved config to :data:`~fusegraph.models.MODELS` under
the name the user typed, so every command downstream (report, kernel, bench, the HTML report) finds it like a
bundled model.
"""
from __future__ import annotations

import json
import os
from typing import Any

SIZES = ("tiny", "full")

# per-family dimensions the tiny size shrinks besides TINY_DIMS (MoE widths and expert counts)
_TINY_MOE = {"moe_intermediate_size": 128, "shared_expert_intermediate_size": 128}
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
_DROP = ("transformers_version", "_name_or_path", "architectures", "quantization_config", "auto_map", "dtype",
         "torch_dtype")


class ModelSpecError(ValueError):
    """``--model`` names nothing fusegraph can build (its message is the one line the CLI prints)."""


def config_path(name: str) -> str | None:
    """The ``config.json`` that ``name`` points at (a file, or a directory holding one), else None."""
    if os.path.isdir(name) and os.path.isfile(os.path.join(name, "config.json")):
        return os.path.join(name, "config.json")
    if name.endswith(".json") or os.path.isfile(name):
        return name
    return None


def family_classes(name: str) -> tuple[type, type] | None:
    """``(config class, causal-LM class)`` of an HF family named by ``model_type`` (``qwen3_moe``) or by its class
    prefix (``Qwen3Moe``); None when transformers has no causal LM of that name."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for model_type in (name, name.lower()):
        cls_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        if cls_name and model_type in CONFIG_MAPPING and hasattr(transformers, cls_name):
            model_cls = getattr(transformers, cls_name)
            return model_cls.config_class, model_cls
    model_cls = getattr(transformers, f"{name}ForCausalLM", None)
    if isinstance(model_cls, type) and getattr(model_cls, "config_class", None) is not None:
        return model_cls.config_class, model_cls
    return None


def tiny_dims(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with its dimensions shrunk to tiny sizes, its structure kept: the attention kind (MHA stays MHA,
    MQA stays MQA), the experts (at most 8, top-2), layer types and MoE layer lists cut to the tiny depth, token
    ids that no longer fit the vocabulary set to 0."""
    from . import TINY_DIMS

    out = dict(config)
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    for key, value in TINY_DIMS.items():
        if key == "tie_word_embeddings":
            continue  # structure: a tied model stays tied
        if key in config or key in ("num_hidden_layers", "hidden_size", "vocab_size"):
            out[key] = value
    if kv is not None and heads:
        out["num_key_value_heads"] = (TINY_DIMS["num_attention_heads"] if kv == heads else 1 if kv == 1
                                      else TINY_DIMS["num_key_value_heads"])
    for key, value in _TINY_MOE.items():
        if config.get(key):
            out[key] = value
    experts = None
    for key in _EXPERT_COUNTS:
        if isinstance(config.get(key), int) and config[key] > 0:
            out[key] = experts = min(config[key], 8)
    if experts and isinstance(config.get("num_experts_per_tok"), int):
        out["num_experts_per_tok"] = min(config["num_experts_per_tok"], 2, experts)
    layers = out["num_hidden_layers"]
    if isinstance(config.get("layer_types"), list) and config["layer_types"]:
        out["layer_types"] = list(config["layer_types"][:layers])
    if isinstance(config.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < layers]
    for key in ("first_k_dense_replace", "max_window_layers"):
        if isinstance(config.get(key), int):
            out[key] = min(config[key], layers)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        v = out.get(key)
        if isinstance(v, int) and v >= out["vocab_size"]:
            out[key] = 0
        elif isinstance(v, list):
            out[key] = [t if t < out["vocab_size"] else 0 for t in v]
    return out


def _read_config(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ModelSpecError(f"--model {path!r}: no such config file")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelSpecError(f"--model {path!r}: not a readable JSON config ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ModelSpecError(f"--model {path!r}: a config.json needs a \"model_type\" (e.g. \"llama\")")
    text = data.get("text_config")
    if isinstance(text, dict) and "hidden_size" not in data and isinstance(text.get("model_type"), str):
        return text  # a multimodal config: its language model
    return data


def custom_spec(name: str, size: str = "tiny") -> Any:
    """The :class:`~fusegraph.models.ModelSpec` of a family name or a config.json path (raises
    :class:`ModelSpecError` naming what is wrong)."""
    from . import ModelSpec

    if size not in SIZES:
        raise ModelSpecError(f"--size {size!r}: expected one of {', '.join(SIZES)}")
    path = config_path(name)
    if path is not None:
        data = _read_config(path)
        classes = family_classes(data["model_type"])
        what = f"{path} ({data['model_type']})"
        if classes is None:
            raise ModelSpecError(f"--model {path!r}: transformers has no causal LM for model_type "
                                 f"{data['model_type']!r}")
    else:
        classes = family_classes(name)
        if classes is None:
            raise ModelSpecError(f"unknown model {name!r}: not a bundled model (`fusegraph models`), a "
                                 "module:function, an HF model_type (e.g. llama, qwen2, mistral) or a config.json path")
        data = classes[0]().to_dict()
        what = f"the {data.get('model_type', name)} family's default config"
    config_cls, model_cls = classes
    dtype = data.get("dtype") or data.get("torch_dtype")
    config = {k: v for k, v in data.items() if k not in _DROP and not k.startswith("_")}
    family = str(config.pop("model_type", name))
    if size == "tiny":
        config = tiny_dims(config)
    try:
        config_cls(**config)  # fail here, with the config's own message, rather than inside a command
    except Exception as e:  # noqa: BLE001 - any config validation error is the user's input
        raise ModelSpecError(f"--model {name!r}: {config_cls.__name__} rejects this config: "
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    full = size == "full"
    layers = config.get("num_hidden_layers")
    description = (f"{family} from {what}, {'full size on the meta device' if full else 'tiny dims'}, "
                   f"{layers} layers, hidden {config.get('hidden_size')}, random weights")
    default = (dtype if dtype in ("float32", "bfloat16", "float16") else "bfloat16") if full else "float32"
    return ModelSpec(name, family, description, config, meta=full, dtype=default, config_class=config_cls,
                     model_class=model_cls)


def is_custom_spec(name: str) -> bool:
    """Whether ``name`` looks like a config path or names an HF family (bundled names are checked first)."""
    return config_path(name) is not None or family_classes(name) is not None
