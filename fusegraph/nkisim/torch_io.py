"""The interpreter's torch-facing entry: run a generated kernel's source on torch tensors.

Tensors are handed to the interpreter as NumPy arrays that *share memory* with them (bf16 through an
ml_dtypes view), so the kernel's in-place writes of state (the KV cache) land in the caller's tensors exactly as
they would in HBM. Integer step inputs are converted to int32 (NKI has no int64).

The kernel is duck-typed (:class:`KernelLike`: its source, entry name, argument names, argument specs and
constants), so the interpreter does not import the compiler that generates it (``fusegraph.codegen`` sits above
it in the layering). This module imports torch; ``import fusegraph.nkisim`` does not (the LLM verification worker
runs the interpreter without torch), and loads it only when one of its names is first used.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence

import ml_dtypes
import numpy as np
import torch

from .modules import load_kernel_source
from .runner import run
from .storage import Abstract

_NP_VIEW = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16), torch.float16: (torch.int16, np.float16)}


class ArgSpecLike(Protocol):
    """How a model tensor becomes one kernel argument (``fusegraph.codegen.bind.ArgSpec`` is one)."""

    shape: tuple[int, ...]  # in the kernel
    dtype: torch.dtype  # in the kernel
    transform: Callable[[torch.Tensor], torch.Tensor] | None  # None: passed as is


class KernelLike(Protocol):
    """What running a kernel needs of it (``fusegraph.codegen.megakernel.GeneratedKernel`` is one)."""

    name: str  # the @nki.jit function in ``source``
    source: str
    args: Sequence[str]  # kernel parameter names in order
    specs: Mapping[str, ArgSpecLike]  # the arguments that come from model tensors
    constants: Mapping[str, torch.Tensor]  # the other arguments, supplied with the kernel
    stats: Mapping[str, Any]  # "lnc": the logical NeuronCores it was generated for (default 1)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy array sharing ``t``'s memory (``t`` must be a contiguous CPU tensor); int64 becomes an int32 copy;
    a 0-d tensor (a model's scalar parameter, Gemma 3n's per-layer projection scale) is one element: kernel
    arguments have a dim (NKI refuses 0-d arrays)."""
    if not t.is_contiguous():
        raise ValueError("kernel arguments must be contiguous")
    if t.dim() == 0:
        t = t.reshape(1)
    if t.dtype in _NP_VIEW:
        as_int, np_dtype = _NP_VIEW[t.dtype]
        return t.view(as_int).numpy().view(np_dtype)
    if t.dtype in (torch.int64,):
        return t.to(torch.int32).numpy()
    return t.numpy()


def to_torch(a: np.ndarray) -> torch.Tensor:
    """A tensor of the interpreter's result ``a`` (bf16 through an int16 view, since torch has no ml_dtypes)."""
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


class InterpretedKernel:
    """A generated kernel loaded into the interpreter; call with a mapping from argument name to tensor."""

    def __init__(self, kernel: KernelLike, target: str = "trn2", filename: str | None = None,
                 sbuf_budget: int = 0, lnc: int | None = None) -> None:
        self.kernel = kernel
        self.target = target
        self.sbuf_budget = sbuf_budget
        self.lnc = lnc or kernel.stats.get("lnc", 1)
        self.filename = filename or f"<fusegraph:{kernel.name}>"
        ns = load_kernel_source(kernel.source, self.filename, target=target)
        self._fn = ns[kernel.name]

    def prepare(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Model tensors -> kernel arguments (weight layouts applied). The executor caches this per parameter."""
        out = {}
        for name, spec in self.kernel.specs.items():
            t = tensors[name]
            out[name] = spec.transform(t) if spec.transform is not None else t
        return out

    def __call__(self, tensors: Mapping[str, torch.Tensor], shape_only: bool = False, assume: Any = None) -> list:
        """Run with kernel-ready arguments (see :meth:`prepare`); constants are supplied here."""
        args = []
        copies = []  # int64 arguments the kernel sees as int32 copies: (tensor, copy, its values before the run)
        for name in self.kernel.args:
            t = tensors[name] if name in tensors else self.kernel.constants[name]
            if shape_only:
                args.append(Abstract(tuple(t.shape) or (1,), _np_dtype(t.dtype)))
            else:
                args.append(to_numpy(t))
                if t.dtype == torch.int64:
                    copies.append((t, args[-1], args[-1].copy()))
        kwargs = {"sbuf_budget": self.sbuf_budget} if self.sbuf_budget else {}
        out = run(self._fn, *args, lnc=self.lnc, target=self.target, shape_only=shape_only, assume=assume, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        if shape_only:
            return list(outs)
        for t, arr, before in copies:  # an in-place write of integer state (a step counter's += 1) lands in t
            if not np.array_equal(arr, before):
                t.copy_(torch.from_numpy(arr).reshape(t.shape))
        return [to_torch(o) for o in outs]


def _np_dtype(dtype: torch.dtype) -> Any:
    if dtype == torch.bfloat16:
        return ml_dtypes.bfloat16
    if dtype == torch.int64:
        return np.int32
    return torch.empty((), dtype=dtype).numpy().dtype


def abstract_args(generated: KernelLike) -> list[Abstract]:
    """Shape-only stand-ins for every argument of a generated kernel (kernel shapes and dtypes), for the
    interpreter's shape-only mode (profiles of full-size kernels without data)."""
    args = []
    for name in generated.args:
        if name in generated.specs:
            spec = generated.specs[name]
            args.append(Abstract(tuple(spec.shape) or (1,), _np_dtype(spec.dtype)))
        else:
            t = generated.constants[name]
            args.append(Abstract(tuple(t.shape) or (1,), _np_dtype(t.dtype)))
    return args
