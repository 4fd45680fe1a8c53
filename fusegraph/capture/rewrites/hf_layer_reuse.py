"""Trace one HF decoder layer and reuse the trace for every identical layer.

Dynamo traces a 48-layer model by interpreting the same decoder-layer bytecode 48 times (~12 s of the
Qwen3-30B-A3B capture here). ``torch.compiler.nested_compile_region`` lets dynamo trace a function once and stamp
out the trace for later calls, but only when every argument is a tensor, a constant or a module: the HF cache
object each layer receives is none of these, so every call is traced again. This rewrite calls each decoder layer
through a region whose arguments are the layer module, its inputs and *that layer's cache tensors*; inside, a
stand-in cache runs transformers' own ``StaticLayer.update`` on those tensors, so the ops are the ones the real
cache would issue. fusegraph inlines the regions again before lowering to ATen (``capture.inline_regions``),
so the program is the same flat graph as without the rewrite.

It applies only where that is provably the same computation, and otherwise calls the layer unchanged:
the cache is a transformers ``Cache`` without offloading whose layer for this index is an initialized
``StaticLayer`` (static addresses: the update writes in place and rebinds nothing), the cache is passed by
keyword, and no code in the layer's modeling module (outside the ``PreTrainedModel`` classes, which run
outside the layers) touches the cache through anything but ``update``.
"""
from __future__ import annotations

import dis
import logging
import types
from functools import lru_cache
from typing import Any, Iterable

import torch
from torch.fx.experimental.symbolic_shapes import has_static_value

from .base import CaptureRewrite, fusegraph_setting, hf_modeling_classes, original_forward, register_capture_rewrite

log = logging.getLogger(__name__)

#: keyword names HF decoder layers receive the cache under (transformers 5 uses ``cache``)
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")
#: the StaticLayer fields the stand-in provides; StaticLayer.update must read nothing else of its own
_VIEW_FIELDS = ("keys", "values", "cumulative_length", "device", "is_initialized", "max_cache_len",
                "max_batch_size", "batch_size", "num_heads", "k_head_dim", "v_head_dim")
#: Cache attributes other than ``update``; a layer's code that names one may use the cache in other ways
_OTHER_CACHE_API = ("get_seq_length", "get_mask_sizes", "get_max_cache_shape", "layers", "crop", "reset",
                    "is_compileable", "is_sliding", "offloading", "prefetch", "offload", "reorder_cache",
                    "batch_repeat_interleave", "batch_select_indices", "to_legacy_cache", "key_cache",
                    "value_cache", "seen_tokens", "cumulative_length", "layer_class_to_replicate", "early_initialization",
                    # hybrid caches (linear attention / conv / SSM states: Qwen3-Next, LFM2, Falcon-H1, Granite 4...)
                    "get_conv_state", "update_conv_state", "get_recurrent_state", "update_recurrent_state",
                    "has_previous_state", "conv_states", "recurrent_states", "update_indexer", "is_linear_attention")


#: (StaticLayer, Cache.update) once checked usable, resolved eagerly by find_classes: traced code reads only these
_TARGETS: tuple[Any, Any] | None = None


@lru_cache(maxsize=1)
def _static_layer() -> type | None:
    """transformers' StaticLayer if its update reads only fields the stand-in provides (checked once, eagerly)."""
    global _TARGETS
    try:
        from transformers.cache_utils import Cache, StaticLayer
    except Exception as e:  # transformers missing or reorganized: the rewrite finds nothing
        log.debug("StaticLayer unavailable: %s", e)
        return None
    fields = set()  # instance fields: the attributes StaticLayer's own methods assign
    for fn in vars(StaticLayer).values():
        code = getattr(fn, "__code__", None)
        if code is not None:
            fields |= {ins.argval for ins in dis.get_instructions(code) if ins.opname == "STORE_ATTR"}
    read = set(StaticLayer.update.__code__.co_names) & fields
    missing = read - set(_VIEW_FIELDS)
    if missing:
        log.info("layer reuse off: StaticLayer.update reads %s, which the stand-in cache does not provide",
                 ", ".join(sorted(missing)))
        return None
    _TARGETS = (StaticLayer, Cache.update)
    return StaticLayer


def _function_names(module: types.ModuleType) -> set[str]:
    """Every name referenced by the functions of a modeling module that can run inside a decoder layer."""
    from transformers import PreTrainedModel

    names: set[str] = set()

    def scan(code: types.CodeType) -> None:
        names.update(code.co_names)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                scan(c)

    for obj in vars(module).values():
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if isinstance(obj, types.FunctionType):
            scan(obj.__code__)
        elif isinstance(obj, type) and not issubclass(obj, PreTrainedModel):
            for attr in vars(obj).values():
                fn = getattr(attr, "__func__", attr)
                fn = getattr(fn, "__wrapped__", fn)
                if isinstance(fn, types.FunctionType):
                    scan(fn.__code__)
    return names


_seen: dict[str, list[type]] = {}


def _layer_classes(mod: types.ModuleType) -> list[type]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    classes = [obj for obj in list(vars(mod).values())
               if isinstance(obj, type) and obj.__module__ == mod.__name__
               and issubclass(obj, GradientCheckpointingLayer) and "forward" in obj.__dict__]
    other = _function_names(mod) & set(_OTHER_CACHE_API) if classes else set()
    if other:
        log.debug("layer reuse off for %s: its layer code names %s", mod.__name__, ", ".join(sorted(other)))
        return []
    return classes


def find_classes() -> Iterable[type]:
    """Decoder-layer classes (HF ``GradientCheckpointingLayer`` subclasses) of imported modeling modules whose
    layer code uses the cache only through ``update``."""
    if _static_layer() is None:
        return []
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: F401
    except Exception as e:
        log.debug("GradientCheckpointingLayer unavailable: %s", e)
        return []
    return hf_modeling_classes(_layer_classes, _seen)


def _region_variable_class() -> type | None:
    try:
        from torch._dynamo.variables.invoke_subgraph import InvokeSubgraphHigherOrderVariable
    except Exception:
        return None
    return InvokeSubgraphHigherOrderVariable if hasattr(InvokeSubgraphHigherOrderVariable,
                                                         "_ALLOW_FALLBACK_TO_EAGER") else None


def allow_region_fallback(allow: bool) -> bool:
    """Let a graph break inside a reused region fall back to an ordinary break (dynamo's default for this HOP is a
    hard error, which would surface in the user's forward). Set only while dynamo traces for fusegraph; the
    backend resets it. False: this torch has no such switch, so layer reuse must stay off."""
    cls = _region_variable_class()
    if cls is None:
        return False
    cls._ALLOW_FALLBACK_TO_EAGER = allow
    return True


@torch._dynamo.assume_constant_result
def _enabled() -> bool:
    """The ``reuse_layer_traces`` setting of the fusegraph compile in progress (constant at trace time); run
    eagerly, so the fallback switch is set before dynamo speculates the first region."""
    return bool(fusegraph_setting("reuse_layer_traces")) and allow_region_fallback(True)


def applies(module: torch.nn.Module) -> bool:
    return _enabled() and isinstance(_layer_idx(module), int) and _one_cache_layer(module)


def _one_cache_layer(module: torch.nn.Module) -> bool:
    """Every submodule that names a cache layer (``layer_idx``) names the decoder layer's own: the region hands the
    layer that one cache layer. LongCat-Flash's decoder layer holds two attentions on cache layers ``2i`` and
    ``2i + 1``: both would have updated the one stand-in layer (wrong logits, even on the eager path)."""
    idx = _layer_idx(module)
    return all(getattr(m, "layer_idx", idx) == idx for m in module.modules()
               if isinstance(getattr(m, "layer_idx", None), int))


def _layer_idx(module: torch.nn.Module) -> Any:
    idx = getattr(module, "layer_idx", None)
    if idx is None:
        idx = getattr(getattr(module, "self_attn", None), "layer_idx", None)
    return idx


class _StaticLayerView:
    """Stands in for one StaticLayer inside the region: the same fields, the region's tensors."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, cumulative_length: torch.Tensor) -> None:
        self.keys = keys
        self.values = values
        self.cumulative_length = cumulative_length
        self.device = keys.device
        self.is_initialized = True
        self.max_batch_size = self.batch_size = keys.shape[0]
        self.num_heads = keys.shape[1]
        self.max_cache_len = keys.shape[2]
        self.k_head_dim = keys.shape[-1]
        self.v_head_dim = values.shape[-1]


class _OneLayerCache:
    """Stands in for the cache object: ``update`` is ``Cache.update`` for a cache without offloading."""

    def __init__(self, layer: _StaticLayerView) -> None:
        self.layer = layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return _TARGETS[0].update(self.layer, key_states, value_states, *args, **kwargs)


_LEAF_TYPES = (torch.Tensor, bool, int, float, str, type(None))


def _flatten(args: tuple, kwargs: dict) -> tuple[str, list] | None:
    """The layer's arguments as flat leaves plus a string spec (dynamo reuses a region cheaply only when every
    argument is a tensor or a constant: no containers, no kwargs). None: a structure this does not handle."""
    spec, leaves = [], []
    for name, value in [("", a) for a in args] + list(kwargs.items()):
        if isinstance(value, tuple) and all(isinstance(v, _LEAF_TYPES) for v in value):
            spec.append(f"t{len(value)}:{name}")
            leaves.extend(value)
        elif isinstance(value, _LEAF_TYPES):
            spec.append(f"v:{name}")
            leaves.append(value)
        else:
            return None
    return "|".join(spec), leaves


def _unflatten(spec: str, leaves: tuple) -> tuple[list, dict]:
    args, kwargs, at = [], {}, 0
    for part in spec.split("|") if spec else []:
        kind, _, name = part.partition(":")
        if kind == "v":
            value = leaves[at]
            at += 1
        else:
            n = int(kind[1:])
            value = tuple(leaves[at:at + n])
            at += n
        if name:
            kwargs[name] = value
        else:
            args.append(value)
    return args, kwargs


@torch.compiler.nested_compile_region
def _layer_region(layer: torch.nn.Module, cache_kw: str, spec: str, keys: torch.Tensor, values: torch.Tensor,
                  cumulative_length: torch.Tensor, *leaves: Any) -> Any:
    args, kwargs = _unflatten(spec, leaves)
    kwargs[cache_kw] = _OneLayerCache(_StaticLayerView(keys, values, cumulative_length))
    return original_forward(type(layer))(layer, *args, **kwargs)


def _symbolic_shapes(*values: Any) -> bool:
    """Whether a region argument has a symbolic (dynamic) size. Traced by dynamo, which answers
    ``has_static_value`` at trace time (``isinstance(size, torch.SymInt)`` would not do: dynamo shows a ``SymInt``
    as an ``int``), so the answer is a constant of the trace and adds no guard."""
    for v in values:
        if isinstance(v, torch.Tensor):
            for d in v.shape:
                if not has_static_value(d):
                    return True
    return False


@torch._dynamo.assume_constant_result
def _reuse_off_for_dynamic_shapes(layer_idx: int) -> bool:
    """Log (run eagerly at trace time) that this layer is traced without reuse. Dynamo's region reuse cannot stamp
    out a trace whose inputs have symbolic sizes (torch 2.13: ``KeyError`` in ``stamp_out_subgraph`` once a size
    symbol is specialized inside the region), and reuse only saves tracing time, so the layer is traced as without
    ``reuse_layer_traces``; the checks then refuse the dynamic shapes themselves, with their own warning."""
    log.debug("layer reuse off for decoder layer %s: dynamo traces it with dynamic shapes", layer_idx)
    return True


def _static_cache_layer(layer: Any, idx: int) -> bool:
    """Whether a cache layer is exactly an initialized ``StaticLayer``, the one kind the stand-in cache replays.
    Subclasses are not: the sliding-window layer has its own ``update`` and a Python step counter, and the hybrid
    ones (``LinearAttentionAndStaticFullAttentionLayer``: Falcon-H1...) carry conv / recurrent states the layer
    reads through other cache methods (``get_conv_state``), which the stand-in does not have (dynamo broke the
    step into 3 graphs and recompiled it); a layer without ``update`` at all (``LinearAttentionLayer``) is not a
    StaticLayer either. Those layers are traced as without reuse."""
    return _replayed_layer_type(type(layer), idx) and bool(getattr(layer, "is_initialized", False))


_told_layers: set[type] = set()


@torch._dynamo.assume_constant_result
def _replayed_layer_type(kind: type, idx: int) -> bool:
    """``kind is StaticLayer``, logging each other kind once (run eagerly at trace time: a log call or a set
    update traced by dynamo would break the graph)."""
    if kind is _TARGETS[0]:
        return True
    if kind not in _told_layers:
        _told_layers.add(kind)
        log.info("layer reuse off for decoder layers with a %s cache layer (first: layer %s): only StaticLayer is "
                 "replayed by the stand-in cache", kind.__name__, idx)
    return False


def _hooks(m: torch.nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or getattr(m, "_forward_hooks_with_kwargs", None))


def _not_reusable_because(layer: torch.nn.Module) -> str | None:
    """Why dynamo's reuse of a traced layer could be wrong for ``layer``, or None.

    Dynamo decides whether a region's trace fits another call from the arguments it sees (the module's type,
    parameters and attributes), not from code attached to single instances: a submodule whose ``forward`` (or
    ``__call__``) was replaced on the instance (adapters patched in place, ``m.forward = ...``) would silently run
    layer 0's code (its trace is reused), and forward hooks (adapters written as hooks) make dynamo fail while it
    builds the region's guards. Such a layer is traced on its own, as without the rewrite."""
    from torch.nn.modules import module as nn_module

    if getattr(nn_module, "_global_forward_hooks", None) or getattr(nn_module, "_global_forward_pre_hooks", None):
        return "global module forward hooks are registered"
    for path, m in layer.named_modules():
        where = path or "the layer itself"
        if _hooks(m):
            return f"{where} has forward hooks"
        if m is not layer and ("forward" in vars(m) or "__call__" in vars(m)):
            return f"{where} has a forward of its own (set on the instance)"
    return None


_told: set[tuple[str, str]] = set()


def _reusable(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` may go through the reused region (traced by dynamo: it guards the hooks and attributes it
    reads). Not ``assume_constant_result``: a module argument of such a function makes every layer's region call
    a new reuse entry, and past dynamo's 8 entries the capture of any model of 9 or more layers raised
    InternalTorchDynamoError. So an instance ``forward`` set on one layer *after* the compile is not seen
    (docs/capture.md, "Layer reuse")."""
    why = _not_reusable_because(layer)
    if why is None:
        return True
    return _told_not_reusable(type(layer).__name__, _layer_idx(layer), why)


@torch._dynamo.assume_constant_result
def _told_not_reusable(kind: str, idx: int, why: str) -> bool:
    """False, logging why once per layer class and cause (run eagerly at trace time, with constant arguments only:
    a log call traced by dynamo breaks the graph)."""
    if (kind, why) not in _told:
        _told.add((kind, why))
        log.info("layer reuse off for decoder layer %s (%s): %s; traced as without reuse_layer_traces", idx, kind, why)
    return False


def forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The layer's own forward, through the reusable region when the cache allows it."""
    original = original_forward(type(module))
    cache_kw = next((k for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
    if cache_kw is None:
        return original(module, *args, **kwargs)
    cache = kwargs[cache_kw]
    idx = _layer_idx(module)
    layers = getattr(cache, "layers", None)
    if (_TARGETS is None or getattr(cache, "offloading", True) or not isinstance(layers, list)
            or idx >= len(layers) or not _static_cache_layer(layers[idx], idx)
            or getattr(type(cache), "update", None) is not _TARGETS[1]):
        return original(module, *args, **kwargs)
    flat = _flatten(args, {k: v for k, v in kwargs.items() if k != cache_kw})
    if flat is None or not _reusable(module):
        return original(module, *args, **kwargs)
    spec, leaves = flat
    layer = layers[idx]
    if _symbolic_shapes(layer.keys, layer.values, *leaves) and _reuse_off_for_dynamic_shapes(idx):
        return original(module, *args, **kwargs)
    return _layer_region(module, cache_kw, spec, layer.keys, layer.values, layer.cumulative_length, *leaves)


register_capture_rewrite(
    CaptureRewrite(
        name="fusegraph.hf_layer_reuse",
        description="HF decoder layers with a static cache -> one dynamo trace reused for every identical layer "
        "(nested compile region over the layer's own cache tensors; inlined again before lowering).",
        find_classes=find_classes,
        applies=applies,
        forward=forward,
    )
)
