"""The matcher on small hand-made programs: params, guards, overlaps, escapes, fallback ops, debug explanations."""
import pytest
import torch

from fusegraph import capture_step
from fusegraph.matching import Input, Pattern, analyze, register_pattern, unregister_pattern
from fusegraph.settings import Settings

from fg_cases import EAGER


class Norm(torch.nn.Module):
    def __init__(self, n=32, eps=1e-5, offset=None, use_rsqrt=True):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n))
        self.eps, self.offset, self.use_rsqrt = eps, offset, use_rsqrt

    def forward(self, x):
        h = x.float()
        var = h.pow(2).mean(-1, keepdim=True) + self.eps
        h = h * torch.rsqrt(var) if self.use_rsqrt else h / torch.sqrt(var)
        if self.offset is None:
            return self.weight * h.to(x.dtype)
        return (h * (self.offset + self.weight.float())).type_as(x)


def _analyze(fn, *args, **settings):
    cap = capture_step(fn, *args, options=EAGER)
    # these tests are about the pattern matcher itself: generic lowering (which would pick up what patterns leave)
    # is off unless a test turns it on
    settings.setdefault("generic_lowering", False)
    return cap, analyze(cap.program, Settings(**settings))


def test_rmsnorm_matches_with_its_eps():
    cap, a = _analyze(Norm(eps=3e-5), torch.randn(2, 32))
    (m,) = a.matches_of("fusegraph.rmsnorm")
    assert m.params["eps"] == pytest.approx(3e-5)
    assert cap.program.graph.nodes[m.inputs["weight"]]["input_kind"].value == "weight"
    assert a.coverage_all == 1.0 and len(a.regions) == 1


def test_offset_norm_is_not_plain_rmsnorm():
    """Gemma's (1 + weight): plain RMSNorm structurally fits in fp32 but its weight is computed -> refused;
    the offset pattern matches with its param."""
    cap, a = _analyze(Norm(offset=1.0), torch.randn(2, 32))
    assert not a.matches_of("fusegraph.rmsnorm")
    (m,) = a.matches_of("fusegraph.rmsnorm_offset")
    assert m.params["offset"] == 1.0
    refusals = [d for d in a.decisions if d.action == "refuse_match" and d.subject.startswith("fusegraph.rmsnorm@")]
    assert any("must be a weight" in d.reason for d in refusals), [d.reason for d in refusals]


def test_unknown_norm_is_unmatched_with_a_reason():
    cap, a = _analyze(Norm(use_rsqrt=False), torch.randn(2, 32))
    assert not a.matches
    assert a.coverage_all == 0.0
    reasons = {u.op: u.reason for u in a.unmatched}
    assert "no registered pattern contains aten.sqrt.default" in reasons["aten.sqrt.default"]
    assert "closest: fusegraph.rmsnorm" in reasons["aten.pow.Tensor_Scalar"]


def test_interior_value_used_outside_refuses_the_match():
    norm = Norm()

    def f(x):
        h = x.float()
        var = h.pow(2).mean(-1, keepdim=True)
        r = torch.rsqrt(var + 1e-5)
        return norm.weight * (h * r), r.exp()  # the rsqrt escapes

    cap, a = _analyze(f, torch.randn(2, 32))
    assert not a.matches_of("fusegraph.rmsnorm")
    assert any("is also used by" in d.reason for d in a.decisions if d.action == "refuse_match")


def test_priority_then_size_resolves_overlaps():
    @register_pattern("testmatch.mul_add", inputs=[Input("a", "T H"), Input("b", "T H"), Input("c", "T H")],
                      priority=50, dtypes=("float32",))
    def mul_add(a, b, c):
        return a * b + c

    try:
        cap, a = _analyze(lambda x, y, z: x * y + z, torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8))
        assert [m.pattern.name for m in a.matches] == ["testmatch.mul_add"]
        lost = [d for d in a.decisions if d.action == "refuse_match" and "residual_add" in d.subject]
        assert lost and "wins on priority" in lost[0].reason
    finally:
        unregister_pattern("testmatch.mul_add")


def test_fallback_ops_and_disabled_patterns():
    cap, a = _analyze(Norm(), torch.randn(2, 32), fallback_ops=("aten.rsqrt",))
    assert not a.matches_of("fusegraph.rmsnorm")
    assert any(d.action == "fallback" for d in a.decisions)
    rs = [u for u in a.unmatched if u.op == "aten.rsqrt.default"]
    assert rs and "fallback_ops" in rs[0].reason
    cap, a = _analyze(Norm(), torch.randn(2, 32), disabled_patterns=("fusegraph.rms*",))
    assert not a.matches


def test_shape_expressions_guard_rope_halves():
    """rotate_half's slices are D/2 in the pattern: a rotation at another split point is not RoPE."""
    def bad_rope(x, cos, sin):
        x1, x2 = x[..., :16], x[..., 16:]  # D=64 split at 16
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    args = (torch.randn(1, 4, 1, 64), torch.randn(1, 1, 1, 64), torch.randn(1, 1, 1, 64))
    cap, a = _analyze(bad_rope, *args)
    assert not a.matches_of("fusegraph.rope")
    assert any("D" in d.reason for d in a.decisions if d.action == "refuse_match" and "rope" in d.subject)

    def rope(x, cos, sin):
        x1, x2 = x[..., :32], x[..., 32:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    cap, a = _analyze(rope, *args)
    assert len(a.matches_of("fusegraph.rope")) == 1


def test_mixed_dtypes_do_not_match():
    """An fp32-traced RMSNorm must not match a bf16 norm computed without the fp32 upcast."""
    norm = Norm().to(torch.bfloat16)

    def f(x):
        var = x.pow(2).mean(-1, keepdim=True)
        return norm.weight * (x * torch.rsqrt(var + 1e-5))

    cap, a = _analyze(f, torch.randn(2, 32, dtype=torch.bfloat16))
    assert not a.matches_of("fusegraph.rmsnorm")


def test_pattern_api_validates_names():
    with pytest.raises(ValueError, match="namespaced"):
        Pattern(name="nonamespace", fn=lambda x: x, inputs=[Input("x", "N")])
