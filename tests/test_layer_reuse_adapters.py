"""Adapters (LoRA) on the decoder layers that layer reuse traces once: wrapped the way PEFT wraps modules (a
``LoraLayer`` around the ``nn.Linear`` with ``lora_A``/``lora_B`` children and a scaling), before compile or swapped
in after it, patched onto one layer's instance, or written as forward hooks. Each must capture, give eager's
tokens and logits, and never run another layer's stale trace.

peft itself is not a dependency: :class:`LoraLinear` mirrors what ``peft.tuners.lora.Linear.forward`` computes
(base output plus ``lora_B(lora_A(dropout(x))) * scaling`` per active adapter, the adapters in ``ModuleDict``s).
"""
import warnings

import pytest
import torch

from fusegraph.capture.session import last_session
from fusegraph.capture.summary import summarize
from fusegraph.models import build_decode, greedy_decode

STEPS = 4


class LoraLinear(torch.nn.Module):
    """A PEFT-style LoRA wrapper around an ``nn.Linear`` (``base_layer``), one adapter ``default``."""

    def __init__(self, base: torch.nn.Linear, r: int = 4, alpha: float = 8.0, seed: int = 3) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.base_layer = base
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(r, base.out_features, bias=False)})
        self.lora_dropout = torch.nn.ModuleDict({"default": torch.nn.Identity()})
        with torch.no_grad():
            self.lora_A["default"].weight.copy_(torch.randn(r, base.in_features, generator=gen) * 0.1)
            self.lora_B["default"].weight.copy_(torch.randn(base.out_features, r, generator=gen) * 0.1)
        self.scaling = {"default": alpha / r}
        self.active_adapters = ["default"]

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)
        for name in self.active_adapters:
            if name not in self.lora_A.keys():
                continue
            a, b, drop = self.lora_A[name], self.lora_B[name], self.lora_dropout[name]
            result = result + b(a(drop(x.to(a.weight.dtype)))) * self.scaling[name]
        return result


def _wrap(model, layers=None, targets=("q_proj", "v_proj")) -> None:
    for i, layer in enumerate(model.model.layers):
        if layers is None or i in layers:
            for name in targets:
                setattr(layer.self_attn, name, LoraLinear(getattr(layer.self_attn, name), seed=10 * i + len(name)))


def _factors(base: torch.nn.Linear, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(4, base.in_features, generator=gen) * 0.1, torch.randn(base.out_features, 4, generator=gen) * 0.1


def _lora_forward(orig, a: torch.Tensor, b: torch.Tensor):
    return lambda x: orig(x) + x @ a.t() @ b.t()


def _lora_hook(a: torch.Tensor, b: torch.Tensor):
    return lambda m, inputs, out: out + inputs[0] @ a.t() @ b.t()


def _patch_forward(model, layers=(1,)) -> None:
    """Adapters patched onto the instances (``m.forward = ...``) of some layers' projections: the classes are
    unchanged."""
    for i in layers:
        for name in ("q_proj", "v_proj"):
            base = getattr(model.model.layers[i].self_attn, name)
            base.forward = _lora_forward(base.forward, *_factors(base, 7 + i))


def _hook(model, layers=(0, 1)) -> None:
    """Adapters written as forward hooks on the projections."""
    for i in layers:
        base = model.model.layers[i].self_attn.q_proj
        base.register_forward_hook(_lora_hook(*_factors(base, 8 + i)))


def _decode(case, ref, executor: str, steps: int = STEPS, between=None):
    """Greedy decode with the compiled step and eagerly; ``between(model)`` runs after the first two steps (a
    change made after compile). Returns the compiled and eager (tokens, logits) and the fusegraph warnings."""
    compiled = torch.compile(case.step, backend="fusegraph", options={"executor": executor, "cache_dir": "off"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = 2 if between is not None else steps
        got = greedy_decode(compiled, case.token, case.position, first)
        want = greedy_decode(ref.step, ref.token, ref.position, first)
        if between is not None:
            between(case.model)  # ref shares the model: eager sees the change too
            pos = case.position + first
            more = greedy_decode(compiled, got[1][-1][:, -1].argmax(-1, keepdim=True), pos, steps - first)
            more_e = greedy_decode(ref.step, want[1][-1][:, -1].argmax(-1, keepdim=True), pos, steps - first)
            got = (got[0] + more[0], got[1] + more[1])
            want = (want[0] + more_e[0], want[1] + more_e[1])
    msgs = [str(w.message) for w in caught if "fusegraph" in str(w.message)]
    return got, want, msgs


def _assert_equal_to_eager(got, want, rel: float = 1e-5) -> None:
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0])), "tokens differ from eager"
    for a, b in zip(got[1], want[1]):
        err = (a - b).abs().max().item()
        assert err <= rel * b.abs().max().item(), f"logits differ from eager by {err}"


def _reuse():
    return summarize(last_session())["layer_calls_reusing_traces"]


@pytest.mark.parametrize("executor", ["eager", "nkisim"])
def test_peft_style_lora_before_compile_captures_reuses_and_fuses(executor):
    case = build_decode("llama-tiny")
    _wrap(case.model)
    ref = case.fork()
    got, want, msgs = _decode(case, ref, executor)
    assert not msgs, msgs
    _assert_equal_to_eager(got, want, rel=1e-5 if executor == "eager" else 1e-4)
    layers = case.model.config.num_hidden_layers
    assert _reuse() == {"calls": layers, "traced": 1}
    session = last_session()
    assert len(session.program.graphs) == 1 and not session.refusals
    if executor == "nkisim":
        (record,) = session.program.execution.values()
        assert record.launches_per_call == 1, "the LoRA step is not one megakernel"


def test_lora_swapped_in_after_compile_recompiles():
    case = build_decode("llama-tiny")
    ref = case.fork()
    got, want, msgs = _decode(case, ref, "eager", between=_wrap)
    assert not msgs, msgs
    _assert_equal_to_eager(got, want)
    assert summarize(last_session())["recompiles"] >= 1


def test_adapter_on_one_layer_only():
    case = build_decode("llama-tiny")
    _wrap(case.model, layers={1})
    ref = case.fork()
    got, want, msgs = _decode(case, ref, "eager")
    assert not msgs, msgs
    _assert_equal_to_eager(got, want)


@pytest.mark.parametrize("change", [_patch_forward, _hook], ids=["instance_forward", "forward_hook"])
def test_instance_level_adapter_is_not_a_stale_reused_trace(change):
    """Adapters on instances: a ``forward`` patched on layer 1's projections only (layer 0's reused trace silently
    dropped it: logits off by 5e-2 before), forward hooks on every layer's projection (dynamo failed building the
    region's guards: an ``InternalTorchDynamoError`` in the user's forward). Such layers are traced on their own."""
    case = build_decode("llama-tiny")
    change(case.model)
    ref = case.fork()
    got, want, msgs = _decode(case, ref, "eager")
    assert not msgs, msgs
    _assert_equal_to_eager(got, want)
    assert _reuse()["calls"] < case.model.config.num_hidden_layers


@pytest.mark.xfail(strict=True, reason="an instance forward set after compile is not seen: the reusability check "
                   "is traced (assume_constant_result broke models of 9+ layers), docs/capture.md 'Adapters'")
def test_forward_patched_on_one_layer_after_compile_recompiles():
    case = build_decode("llama-tiny")
    ref = case.fork()
    got, want, msgs = _decode(case, ref, "eager", between=_patch_forward)
    assert not msgs, msgs
    _assert_equal_to_eager(got, want)
    assert summarize(last_session())["recompiles"] >= 1
