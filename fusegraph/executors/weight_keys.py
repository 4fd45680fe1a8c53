"""When is a weight the kernel staged in its own layout stale?

The executor converts each weight to the kernel's layout once (a transpose, a tiling) and reuses the converted copy.
Serving changes weights after compile: ``load_state_dict`` (``copy_`` under ``no_grad``, which bumps the version
counter), ``p.data = t`` (new storage, same parameter object), ``p.data.copy_(t)`` or ``p.data += delta`` (a PEFT
LoRA merge: neither the version counter nor the storage changes, since ``.data`` has a version counter of its own),
and inference tensors (``torch.inference_mode``) have no version counter at all.

So a staged copy is keyed by the tensor's identity, version (when it has one), storage and a strided sample of
its values: 64 elements spread over the tensor, which any dense update (a LoRA merge, a new checkpoint, an
adapter swap) changes. Checking it costs one small gather per weight and call, nothing like re-reading the weight.
What it cannot see is an in-place change through ``.data`` that leaves all sampled elements unchanged (editing
a few rows); ``docs/codegen.md`` says how to make such a change visible (``copy_`` under ``torch.no_grad()``).
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch

SAMPLES = 64


def weight_key(t: torch.Tensor) -> tuple[Any, ...]:
    """A key that changes when ``t``'s contents are replaced or (densely) rewritten."""
    version = None if t.is_inference() else t._version
    storage = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
    return id(t), version, storage, _sample(t)


def _sample(t: torch.Tensor) -> bytes:
    if t.device.type == "meta" or t.numel() == 0:
        return b""
    picked = t.detach()[_sample_index(tuple(t.shape))] if t.dim() else t.detach().reshape(1)
    return picked.contiguous().view(torch.uint8).numpy().tobytes()


@functools.lru_cache(maxsize=1024)
def _sample_index(shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """The sampled positions of a tensor of ``shape`` (computed once per shape: the check runs at every call).
    A stride coprime with typical row lengths, so the sample visits many rows and columns; unravelled, so any
    strides work without a copy of the tensor."""
    n = math.prod(shape)
    k = min(n, SAMPLES)
    flat = (torch.arange(k, dtype=torch.long) * max(n // SAMPLES, 1) + torch.arange(k, dtype=torch.long) * 7919) % n
    return torch.unravel_index(flat, shape)
