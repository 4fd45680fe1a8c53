"""Arrays across the JAX/PyTorch boundary of the JAX frontend.

JAX arrays are immutable, so a state argument (the KV cache) is copied into a tensor the program may write in
place; weights are read without copying (DLPack) and converted once per array object; results go back as new
JAX arrays with the element types StableHLO declared (``i32`` results are computed as int64).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

_BACK = {"f32": np.float32, "f16": np.float16, "f64": np.float64, "i1": np.bool_, "i8": np.int8, "i16": np.int16,
         "i32": np.int32, "i64": np.int64, "ui8": np.uint8}


def to_torch(x: Any, dtype: torch.dtype, *, copy: bool = False, transpose: bool = False,
             contract: int = 1) -> torch.Tensor:
    """A JAX (or numpy) array as a torch tensor of ``dtype`` (int32 widens to int64); ``transpose``: a weight
    ``W[K..., N...]`` (``contract`` leading dims form K) as the ``[N, K]`` matrix the program reads."""
    if isinstance(x, torch.Tensor):
        t = x
    elif isinstance(x, np.ndarray) or np.isscalar(x):
        arr = np.asarray(x)
        if arr.dtype.name == "bfloat16":
            t = torch.from_numpy(arr.view(np.uint16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.array(arr, copy=True))
    else:
        t = torch.from_dlpack(x)
    if transpose:
        k = 1
        for d in t.shape[:contract]:
            k *= d
        t = t.reshape(k, -1).t()
    if t.dtype != dtype:
        t = t.to(dtype)
    elif copy or transpose:
        t = t.clone(memory_format=torch.contiguous_format)
    return t.contiguous()


def to_jax(t: torch.Tensor, dtype: str) -> Any:
    """A torch result as a new JAX array of the StableHLO element type ``dtype``."""
    import jax.numpy as jnp

    t = t.detach()
    if dtype == "bf16":
        import ml_dtypes

        arr = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return jnp.asarray(arr)
    if dtype not in _BACK:
        raise TypeError(f"no JAX element type for {dtype}")
    return jnp.asarray(t.contiguous().numpy().astype(_BACK[dtype], copy=False))
