"""The whole decode step as one NKI megakernel in the interpreter, through torch.compile(backend="fusegraph"),
against eager HF code: logits, greedy tokens, KV cache, launches per step, and the profile's structure."""
import pytest
import torch

from fusegraph import FusegraphWarning, nkisim
from fusegraph.capture.session import last_session
from fusegraph.models import build_decode, greedy_decode

MODELS = ["llama-tiny", "qwen3-tiny", "qwen3-moe-tiny"]


def _compile(case, **options):
    opts = {"executor": "nkisim", "cache_dir": "off", **options}
    return torch.compile(case.step, backend="fusegraph", dynamic=False, options=opts)


def _execution():
    prog = last_session().program
    return prog.newest_execution()


@pytest.mark.parametrize("name", MODELS)
def test_fp32_megakernel_matches_eager(name):
    case = build_decode(name)
    ref = case.fork()
    step = _compile(case)
    toks_c, logits_c = greedy_decode(step, case.token, case.position, 16)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, 16)
    stats = _execution()
    assert stats.launches_per_call == 1
    assert list(stats.executed_by.values()) == ["nkisim"] and list(stats.verification.values()) == ["passed"]
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e)), "greedy tokens differ"
    for a, b in zip(logits_c, logits_e):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()
    for a, b in zip(case.cache_tensors(), ref.cache_tensors()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_bf16_megakernel_within_bf16_tolerance(name, attn):
    case = build_decode(name, dtype="bfloat16", attn=attn)
    ref = case.fork()
    step = _compile(case)
    toks_c, logits_c = greedy_decode(step, case.token, case.position, 8)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, 8)
    assert _execution().launches_per_call == 1
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e)), "greedy tokens differ"
    # documented bf16 tolerance (docs/codegen.md): typically <= 2 bf16 steps of the logit scale; a step whose
    # MoE router sits on a bf16 near-tie may pick the other expert (observed up to ~10% of the scale)
    rel = sorted((a.float() - b.float()).abs().max().item() / b.float().abs().max().item()
                 for a, b in zip(logits_c, logits_e))
    assert rel[len(rel) // 2] <= 2 ** -6 and rel[-1] <= 0.125
    for a, b in zip(case.cache_tensors(), ref.cache_tensors()):
        assert (a.float() - b.float()).abs().max().item() <= 2 ** -5 * b.float().abs().max().item()


@pytest.mark.parametrize("name", MODELS)
def test_fp16_megakernel(name):
    """fp16 models (Trainium computes fp16 too): patterns are traced for fp16 as well, so the step is one kernel;
    fp16 has 3 more mantissa bits than bf16, so the documented bf16 bounds hold with room."""
    case = build_decode(name, dtype="float16")
    ref = case.fork()
    step = _compile(case)
    toks_c, logits_c = greedy_decode(step, case.token, case.position, 8)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, 8)
    stats = _execution()
    assert stats.launches_per_call == 1 and list(stats.verification.values()) == ["passed"]
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e)), "greedy tokens differ"
    rel = [(a.float() - b.float()).abs().max().item() / b.float().abs().max().item() for a, b in zip(logits_c, logits_e)]
    assert max(rel) <= 2 ** -6


def test_moe_profile_proves_the_structure():
    case = build_decode("qwen3-moe-tiny")
    cfg = case.model.config
    step = _compile(case)
    with torch.no_grad():
        step(case.token, case.position)  # verified call
        step(case.token, case.position + 1)  # trusted call: the interpreter's last profile is the megakernel's
    prof = nkisim.last_profile().to_dict()
    T, H, D, KV, L = 1, cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, 32
    layers = cfg.num_hidden_layers
    # HBM writes: the logits, this step's K/V rows and the routers' tie flag (one fp32 per token) only -- no
    # activation ever goes back to HBM
    kv_rows = layers * 2 * KV * D * 4
    assert prof["hbm_write_bytes"] == cfg.vocab_size * 4 + kv_rows + 4
    # HBM reads: weights actually used (top-k experts only) + the KV cache + small per-step inputs
    params = dict(case.model.named_parameters())
    used = 0
    for n, p in params.items():
        if "experts" in n:
            used += p[0].numel() * 4 * cfg.num_experts_per_tok
        elif "embed_tokens" in n:
            used += H * 4
        else:
            used += p.numel() * 4
    kv_read = layers * 2 * KV * L * D * 4
    assert prof["hbm_read_bytes"] <= 1.05 * (used + kv_read)
    assert prof["hbm_read_bytes"] >= used  # and it did read them
    expert_bytes = sum(p.numel() * 4 for n, p in params.items() if "experts" in n)
    assert prof["hbm_read_bytes"] < used + kv_read + expert_bytes / 4  # not all experts


def test_broken_template_fails_verification_and_falls_back(monkeypatch):
    from fusegraph.codegen import render as render_mod

    original = render_mod.render

    def broken(template, indent=0, **ctx):
        text = original(template, indent=indent, **ctx)
        return text.replace("op=nl.add", "op=nl.subtract") if template == "add.j2" else text

    monkeypatch.setattr(render_mod, "render", broken)
    monkeypatch.setattr("fusegraph.codegen.emitters.render", broken)
    case = build_decode("llama-tiny")
    ref = case.fork()
    step = _compile(case)
    with pytest.warns(FusegraphWarning, match=r"region \d+ \(decoder_stack.*verification against eager failed"):
        toks_c, logits_c = greedy_decode(step, case.token, case.position, 3)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, 3)
    assert all(torch.equal(a, b) for a, b in zip(logits_c, logits_e))  # eager fallback: exact
    assert list(_execution().executed_by.values()) == ["eager"]


def test_dump_dir_and_disk_cache(tmp_path):
    case = build_decode("qwen3-tiny")
    step = _compile(case, dump_dir=str(tmp_path / "dump"), cache_dir=str(tmp_path / "cache"))
    with torch.no_grad():
        step(case.token, case.position)
    dumped = list((tmp_path / "dump").glob("region*_decoder_stack.py"))
    assert len(dumped) == 1 and "@nki.jit" in dumped[0].read_text()
    cached = list((tmp_path / "cache").glob("*.py"))
    # an entry is a MAC line (docs/codegen.md "Kernel cache"), a manifest line (hash, kernel name, signature), then
    # the source exactly as dumped
    assert len(cached) == 1 and cached[0].read_text().split("\n", 2)[2] == dumped[0].read_text()
    torch._dynamo.reset()
    case2 = build_decode("qwen3-tiny")
    step2 = _compile(case2, cache_dir=str(tmp_path / "cache"))
    with torch.no_grad():
        step2(case2.token, case2.position)
    plans = _execution().run.plans
    assert plans and plans[0].cache_hit


def test_bisection_names_the_first_divergent_op(monkeypatch):
    from fusegraph.codegen import render as render_mod
    from fusegraph.executors.bisect import bisect_graph

    case = build_decode("qwen3-tiny")
    step = _compile(case, verify=False)
    original = render_mod.render

    def broken(template, indent=0, **ctx):  # a sign error in RoPE: rotate_half(x) * -sin
        text = original(template, indent=indent, **ctx)
        return text.replace("op=nl.add, name", "op=nl.subtract, name") if template == "rope.j2" else text

    monkeypatch.setattr("fusegraph.codegen.emitters.render", broken)
    with torch.no_grad():
        step(case.token, case.position)
    found = bisect_graph(last_session().program, 0)
    assert len(found) == 1
    d = found[0]
    assert d.opcode == "rope" and d.layer == 0 and d.reference_ok
    assert "model.layers.0.self_attn" in (d.module or "")
    assert "aten.mul.Tensor" in d.aten_ops


def test_lnc2_megakernel_matches_eager():
    case = build_decode("qwen3-moe-tiny")
    ref = case.fork()
    step = _compile(case, lnc=2)
    toks_c, logits_c = greedy_decode(step, case.token, case.position, 6)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, 6)
    stats = _execution()
    assert stats.launches_per_call == 1 and list(stats.verification.values()) == ["passed"]
    assert nkisim.last_profile().lnc == 2
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    for a, b in zip(logits_c, logits_e):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()


def test_cache_key_follows_patterns_templates_and_target(monkeypatch):
    """The disk-cache key changes with a pattern's code, a template, the target and the streaming settings."""
    from dataclasses import dataclass

    from fusegraph.codegen import ir
    from fusegraph.executors.kernels import cache_key
    from fusegraph.settings import Settings

    @dataclass
    class Pat:
        name: str
        fn: object

    @dataclass
    class M:
        pattern: Pat

    @dataclass
    class R:
        matches: list

    x = ir.Value("x", ir.ValueKind.ACT, (1, 8), torch.float32)
    y = ir.Value("y", ir.ValueKind.ACT, (1, 8), torch.float32)
    prog = ir.KernelProgram("k", 1, [ir.Add(a=x, b=x, out=y)], inputs=[], outputs=[])
    s = Settings()
    base = cache_key(prog, "trn2", s, R([M(Pat("p.a", lambda v: v + 1))]))
    assert cache_key(prog, "trn2", s, R([M(Pat("p.a", lambda v: v + 1))])) == base
    assert cache_key(prog, "trn2", s, R([M(Pat("p.a", lambda v: v * 2))])) != base  # plugin code changed
    assert cache_key(prog, "trn3", s, R([M(Pat("p.a", lambda v: v + 1))])) != base
    assert cache_key(prog, "trn2", s.replace(weight_buffers=6), R([M(Pat("p.a", lambda v: v + 1))])) != base
    monkeypatch.setattr("fusegraph.codegen.registry.templates_hash", lambda: "changed")
    assert cache_key(prog, "trn2", s, R([M(Pat("p.a", lambda v: v + 1))])) != base

