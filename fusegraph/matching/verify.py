"""Check patterns against their torch reference: every traced implementation, and every match in a real program.

A pattern's ``reference`` (its main function) defines the math; other implementations are other spellings of the
same math that HF code paths capture to. ``verify_pattern`` runs each implementation against the reference on
random inputs; ``verify_match`` recomputes a match's outputs with the reference from the values its inputs hold in
a run of the program, which is exactly what codegen relies on (inputs, outputs and params of a Match).

One generic convention links forms that differ only in how a mask is spelled: a boolean tensor where the reference
takes a float one is "allowed" -> 0 / dtype min (HF's eager mask), and a boolean output is compared with
``reference == 0``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .pattern import Pattern
from .results import Match
from .trace import _parse_dim, _symbols


@dataclass
class VerifyResult:
    variant: str
    max_abs_err: float
    ok: bool
    detail: str = ""


def tolerance(dtype: torch.dtype) -> float:
    return 3e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4


def _as_reference_input(t: Any, want_dtype: torch.dtype | None) -> Any:
    if isinstance(t, torch.Tensor) and t.dtype == torch.bool and want_dtype is not None and want_dtype.is_floating_point:
        return torch.where(t, torch.zeros((), dtype=want_dtype), torch.finfo(want_dtype).min)
    return t


def _compare(got: Any, ref: Any) -> float:
    if isinstance(got, torch.Tensor) and got.dtype == torch.bool and isinstance(ref, torch.Tensor) and ref.dtype != torch.bool:
        ref = ref == 0
    if got.dtype == torch.bool or not got.dtype.is_floating_point:
        return 0.0 if torch.equal(got.reshape(-1), ref.reshape(-1).to(got.dtype)) else math.inf
    if got.numel() != ref.numel():
        return math.inf
    return (got.float().reshape(-1) - ref.float().reshape(-1)).abs().max().item() if got.numel() else 0.0


def _scale(t: torch.Tensor) -> float:
    if not t.dtype.is_floating_point or t.numel() == 0:
        return 1.0
    return max(1.0, t.float().abs().max().item())


def verify_pattern(pattern: Pattern, dtype: str = "float32", seed: int = 0) -> list[VerifyResult]:
    """Each implementation (x case) of ``pattern`` against its reference, on random inputs."""
    results = []
    dt = getattr(torch, dtype)
    ref_inputs_spec = {i.name: i for i in pattern.inputs}
    for impl in pattern.implementations:
        if impl.dtypes is not None and dtype not in impl.dtypes:
            continue
        inputs = impl.inputs or pattern.inputs
        for case in impl.cases or pattern.cases:
            if case.get("_device", "cpu") != "cpu":
                continue
            g = torch.Generator().manual_seed(seed)
            dims = {s: (pattern.dims.get(s, 6) if isinstance(pattern.dims.get(s, 6), int) else pattern.dims[s][0])
                    for s in _symbols(inputs)}
            dims.update({k: int(v) for k, v in case.items() if k in dims})
            args: dict[str, torch.Tensor] = {}
            for i in inputs:
                shape = tuple(_parse_dim(t, dims) for t in i.dims())
                idt = getattr(torch, i.dtype or dtype)
                if idt.is_floating_point:
                    args[i.name] = torch.randn(shape, generator=g).to(idt)
                elif idt == torch.bool:
                    args[i.name] = torch.rand(shape, generator=g) > 0.3
                else:
                    args[i.name] = torch.randint(0, 2, shape, generator=g, dtype=idt)
            params = {**pattern.params, **{k: v for k, v in case.items() if k not in dims and k != "_device"}}
            slot_values = {s: next(iter(slot.options)) for s, slot in pattern.slots.items()}
            kw = {**params, **{s: pattern.slots[s].options[v] for s, v in slot_values.items()}, "dtype": dt}
            from .pattern import keyword_names

            acc = keyword_names(impl.fn)
            got = impl.fn(*[args[i.name].clone() for i in inputs],
                          **({k: v for k, v in kw.items() if acc is None or k in acc}))
            ref_args = {}
            for name, spec in ref_inputs_spec.items():
                if name in args:
                    want = getattr(torch, spec.dtype or dtype)
                    ref_args[name] = _as_reference_input(args[name].clone(), want)
                else:
                    ref_args[name] = None
            acc_ref = keyword_names(pattern.reference_fn)
            ref = pattern.reference_fn(*[ref_args[i.name] for i in pattern.inputs],
                                       **({k: v for k, v in kw.items() if acc_ref is None or k in acc_ref}))
            gots = got if isinstance(got, tuple) else (got,)
            refs = ref if isinstance(ref, tuple) else (ref,)
            err = max(_compare(a, b) / _scale(b) for a, b in zip(gots, refs))
            name = f"{impl.name}{case if case else ''}/{dtype}"
            results.append(VerifyResult(name, err, err <= tolerance(dt)))
    return results


def verify_match(match: Match, values: Mapping[str, torch.Tensor], before: Mapping[str, torch.Tensor] | None = None,
                 program: Any = None) -> VerifyResult:
    """Recompute ``match`` with its pattern's reference from program values; compare with what the program computed.

    ``values``: every program node's value from one run (e.g. the eager executor's environment); ``before``: the
    graph inputs as they were before the run (state written in place reads its old value).
    """
    p = match.pattern
    args: dict[str, Any] = {}
    for spec in p.inputs:
        node = match.inputs.get(spec.name)
        if node is None:
            args[spec.name] = None
            continue
        src = before if before is not None and node in before else values
        t = src[node].clone()
        ref_dtype = getattr(torch, spec.dtype) if spec.dtype else None
        if ref_dtype is None:
            first = next((values[n] for n in match.outputs.values() if isinstance(values.get(n), torch.Tensor)), None)
            ref_dtype = first.dtype if first is not None and first.dtype.is_floating_point else t.dtype
        args[spec.name] = _as_reference_input(t, ref_dtype)
    params = dict(match.params)
    from .pattern import keyword_names

    acc = keyword_names(p.reference_fn)
    if (acc is None or "dtype" in acc) and "dtype" not in params:
        params["dtype"] = "float32"  # a form without a dtype (a boolean mask): compared as "reference == 0"
    try:
        ref = p.call_reference(args, params)
    except RuntimeError:
        # an input read through a reshape folded into the match (o_proj reading [B, 1, heads, D]): read it as the
        # pattern declares it, rows of the last declared dim
        ref = p.call_reference(_reshape_inputs(p, args), params)
    refs = ref if isinstance(ref, tuple) else (ref,)
    errs = []
    for name, r in zip(p.outputs, refs):
        got = values[match.outputs[name]]
        errs.append(_compare(got, r) / _scale(r))
    err = max(errs)
    dt = values[match.outputs[p.outputs[0]]].dtype
    return VerifyResult(f"{p.name}[{match.variant}]@{match.module}", err, err <= tolerance(dt))


def _reshape_inputs(p: Pattern, args: dict[str, Any]) -> dict[str, Any]:
    dims: dict[str, int] = {}
    for spec in p.inputs:
        t = args.get(spec.name)
        toks = spec.dims()
        if isinstance(t, torch.Tensor) and t.dim() == len(toks):
            for tok, size in zip(toks, t.shape):
                if tok.isidentifier():
                    dims.setdefault(tok, size)
    out = dict(args)
    for spec in p.inputs:
        t = args.get(spec.name)
        toks = spec.dims()
        if isinstance(t, torch.Tensor) and t.dim() != len(toks) and toks:
            last = dims.get(toks[-1])
            if last:
                out[spec.name] = t.reshape(*([-1] + [1] * (len(toks) - 2) + [last]))
    return out
