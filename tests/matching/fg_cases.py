"""Captured decode steps shared by the matching tests (captured once per process: dynamo takes seconds)."""
from __future__ import annotations

import functools
import types

import torch

from fusegraph import capture_step
from fusegraph.matching import analyze
from fusegraph.models import DecodeCase, build_decode, build_family_decode

EAGER = {"executor": "eager"}  # matching is independent of the executor; eager keeps captures fast

# pairwise cover of the supported configurations: every attention / experts / dtype value per model
DEFAULT = [
    ("llama-tiny", "eager", "batched_mm", "float32"),
    ("llama-tiny", "sdpa", "batched_mm", "bfloat16"),
    ("qwen3-tiny", "eager", "batched_mm", "bfloat16"),
    ("qwen3-tiny", "sdpa", "batched_mm", "float32"),
    ("qwen3-moe-tiny", "eager", "batched_mm", "float32"),
    ("qwen3-moe-tiny", "sdpa", "grouped_mm", "bfloat16"),
    ("qwen3-moe-tiny", "eager", "grouped_mm", "float32"),
    ("qwen3-moe-tiny", "sdpa", "batched_mm", "bfloat16"),
    ("qwen3-moe-tiny", "eager", "eager", "bfloat16"),
]
FULL = [(m, a, e, d) for m in ("llama-tiny", "qwen3-tiny", "qwen3-moe-tiny") for a in ("eager", "sdpa")
        for e in (("batched_mm", "grouped_mm", "eager") if "moe" in m else ("batched_mm",))
        for d in ("float32", "bfloat16")]


def config_id(cfg) -> str:
    name, attn, experts, dtype = cfg
    return "-".join([name, attn] + ([experts] if "moe" in name else []) + [dtype])


@functools.lru_cache(maxsize=None)
def captured(name: str, attn: str, experts: str, dtype: str, batch: int = 1):
    case = build_decode(name, attn=attn, experts=experts, dtype=dtype, batch=batch)
    cap = capture_step(case.step, case.token, case.position, options=EAGER)
    return case, cap


@functools.lru_cache(maxsize=None)
def analyzed(name: str, attn: str, experts: str, dtype: str, batch: int = 1):
    case, cap = captured(name, attn, experts, dtype, batch)
    return case, cap, analyze(cap.program)


def hf_case(family: str, attn: str = "eager", dtype: str = "float32", **config) -> DecodeCase:
    """A tiny decode step of any HF decoder family (``transformers.<family>ForCausalLM``), prefilled eagerly."""
    return build_family_decode(family, attn=attn, dtype=dtype, **config)


def decodes_in_one_kernel(case: DecodeCase, dtype: str = "float32", steps: int = 5):
    """Compile ``case.step`` for the interpreter and greedy-decode ``steps`` steps beside eager: one launch per step,
    verification passed, tokens equal, logits within 1e-4 (fp32) / 2^-6 (bf16, docs/codegen.md "Numerics") of
    their scale. Returns the latest version's execution record (Mistral: after dynamo's recompile that made the
    cache's step counter symbolic)."""
    import torch

    from fusegraph.capture.session import last_session
    from fusegraph.models import greedy_decode

    ref = case.fork()
    step = torch.compile(case.step, backend="fusegraph", options={"executor": "nkisim", "cache_dir": "off"})
    toks_c, logits_c = greedy_decode(step, case.token, case.position, steps)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, steps)
    (stats,) = last_session().program.execution.values()
    assert stats.launches_per_call == 1, stats.executed_by
    assert list(stats.verification.values()) == ["passed"]
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    tol = 1e-4 if dtype == "float32" else 2 ** -6
    for a, b in zip(logits_c, logits_e):
        assert (a - b).abs().max().item() <= tol * b.abs().max().item()
    return stats


def decode_beside_eager(case: DecodeCase, steps: int) -> tuple[list, list, list, list, list[str]]:
    """Compile ``case.step`` for the interpreter and greedy-decode ``steps`` steps beside an eager copy: (compiled
    tokens, compiled logits, eager tokens, eager logits, the fusegraph warnings the compiled run gave)."""
    import warnings

    import torch

    from fusegraph import FusegraphWarning
    from fusegraph.models import greedy_decode

    ref = case.fork()
    step = torch.compile(case.step, backend="fusegraph", options={"executor": "nkisim", "cache_dir": "off"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        toks_c, logits_c = greedy_decode(step, case.token, case.position, steps)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, steps)
    msgs = [str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)]
    return toks_c, logits_c, toks_e, logits_e, msgs


@functools.lru_cache(maxsize=None)
def analyzed_family(family: str, attn: str = "eager", dtype: str = "float32", **config):
    case = hf_case(family, attn, dtype, **config)
    cap = capture_step(case.step, case.token, case.position, options=EAGER)
    return case, cap, analyze(cap.program)


def break_inside_mlp(case: DecodeCase, glue=None) -> None:
    """Put a dynamo graph break inside layer 0's MLP (optionally with Python glue computing on the tensor)."""
    mlp = case.model.model.layers[0].mlp

    def forward(self, x):
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        torch._dynamo.graph_break()
        if glue is not None:
            glue(h)
        return self.down_proj(h)

    mlp.forward = types.MethodType(forward, mlp)


def program_values(program, seed: int = 0) -> tuple[dict, dict]:
    """Run a one-graph program on random inputs with the eager executor's plan: (every node's value, the inputs
    as they were before the step wrote state in place)."""
    from fusegraph.executors.eager import build_plan, run_plan

    assert len(program.graphs) == 1
    g = torch.Generator().manual_seed(seed)
    env: dict = {}
    for pin in program.graphs[0].inputs:
        dt = getattr(torch, pin.dtype)
        if dt.is_floating_point:
            env[pin.node] = (torch.randn(pin.shape, generator=g) * 0.5).to(dt)
        elif pin.shape == ():
            env[pin.node] = torch.tensor(5, dtype=dt)  # cache lengths: a few tokens already cached
        else:
            env[pin.node] = torch.zeros(pin.shape, dtype=dt)
    before = {k: v.clone() for k, v in env.items()}
    run_plan(build_plan(program, program.topo_order(0)), env)
    return env, before


class BrokenMLP(torch.nn.Module):
    """A gated MLP with a dynamo graph break between its halves (optionally with Python glue on the crossing tensor)."""

    def __init__(self, hidden: int = 64, inter: int = 128, glue=None):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)
        self.glue = glue

    def forward(self, x):
        h = torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)
        torch._dynamo.graph_break()
        if self.glue is not None:
            self.glue(h)
        return x + self.down_proj(h)
