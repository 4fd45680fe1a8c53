"""A kernel's arguments for one call, from the step's values: weights staged once in the kernel's layouts (again
only when the model's tensor changed), state tensors passed as they are (the kernel writes them in place), per-step
inputs marshalled to the kernel's shape and dtype."""
from __future__ import annotations

import logging
from typing import Any

import torch

from .kernels import KernelPlan
from .weight_keys import weight_key

log = logging.getLogger(__name__)


def kernel_args(plan: KernelPlan, env: dict, state_override: dict | None = None) -> dict[str, torch.Tensor]:
    """Kernel argument name -> tensor for this call; ``state_override`` replaces state arguments (verification runs
    the kernel on copies of the state)."""
    out = {}
    for name, src in plan.lowered.args.items():
        if state_override and name in state_override:
            out[name] = state_override[name]
            continue
        spec = plan.generated.specs[name]
        whole = env[src.node]
        if spec.transform is not None:
            out[name] = staged_weight(plan, name, src, spec, whole)
        elif src.kind == "state":
            out[name] = src.value(whole)
        else:
            out[name] = marshal_input(src, spec.dtype, src.value(whole))
    return out


def staged_weight(plan: KernelPlan, name: str, src: Any, spec: Any, whole: torch.Tensor) -> torch.Tensor:
    """A weight in the kernel's layout, cached on the plan keyed by the model's tensor and what it holds (version,
    storage, a sample of its values): a weight changed after compile (``copy_``, ``.data =``, a swapped adapter)
    is staged again; an unchanged one is not converted again."""
    key = weight_key(whole)
    cached = plan.prepared.get(name)
    if cached is None or cached[0] != key:
        if cached is not None:
            log.info("%s: weight %s changed since it was staged; staging it again", plan.label, name)
        with torch.no_grad():
            plan.prepared[name] = (key, spec.transform(src.value(whole).detach()).contiguous())
    return plan.prepared[name][1]


def marshal_input(src: Any, dtype: torch.dtype, t: torch.Tensor) -> torch.Tensor:
    """A per-step input as the kernel reads it: padded, converted by its op (``ArgSource.convert``: a boolean mask
    to an additive one, ...), flattened to the kernel shape, indices as int32 (saturated)."""
    v = t.detach() if isinstance(t, torch.Tensor) else torch.as_tensor(t)  # a runtime Python number (SymInt)
    if getattr(src, "pad", None) is not None and v.shape[-1] < src.pad[0]:
        size, value = src.pad
        v = torch.cat((v, v.new_full((*v.shape[:-1], size - v.shape[-1]), value)), dim=-1)
    if getattr(src, "convert", None) is not None:  # the op's conversion (its lowering set it)
        v = src.convert(v)
    if v.numel() == 1 and len(src.shape) == 1 and src.shape[0] > 1:
        v = v.reshape(1).expand(src.shape[0])
    if dtype == torch.int32 and v.dtype == torch.int64:
        # saturate, not wrap: an id past int32 stays out of every vocabulary range (a vocab-parallel lookup zeroes
        # it, as DTensor's masking does) instead of wrapping into some rank's range
        v = v.clamp(torch.iinfo(torch.int32).min, torch.iinfo(torch.int32).max)
    return v.reshape(src.shape).to(dtype).contiguous()
