"""Plugins reach the megakernel (issue 12): a pattern without a lowering of its own is lowered from its traced body,
a plugin with its own template passes the same conformance and template tests as the built-ins, a match codegen
cannot lower is refused at region formation, and a build failure sends only the failing match to the eager path."""
from __future__ import annotations

import pathlib
import re
import sys
import warnings

import pytest
import torch

import fusegraph
from fusegraph import FusegraphWarning
from fusegraph.codegen import ir, registry
from fusegraph.codegen.errors import CodegenError
from fusegraph.matching import REGISTRY, registered_patterns, unregister_pattern
from fusegraph.nkiapi.conformance import check_source

from fusegraph.codegen.testing import Builder, V

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "patterns.md"
PLUGINS = pathlib.Path(__file__).resolve().parents[1] / "plugins"


def _compile(fn, **options):
    torch._dynamo.reset()
    return torch.compile(fn, backend="fusegraph", dynamic=False,
                         options={"executor": "nkisim", "cache_dir": "off", **options})


def _record():
    """The execution record of the step's latest version (dynamo may recompile a step once mid-decode)."""
    (record,) = fusegraph.last_capture().program.execution.values()
    return record


def _tutorial_blocks() -> list[str]:
    section = DOC.read_text().split("## Write your own pattern", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.fixture
def tutorial():
    yield
    unregister_pattern("mypkg.layer_norm")


def test_tutorial_pattern_runs_inside_the_megakernel(tutorial):
    """docs/patterns.md as written: the plugin's non-parametric LayerNorm has no lowering of its own, so its traced
    body (native_layer_norm, fp32 inside) is lowered generically; the block is one kernel launch per step."""
    ns: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for i, code in enumerate(_tutorial_blocks()):
            exec(compile(code, f"docs/patterns.md block {i}", "exec"), ns)
    # the documented run left its record: check it here too, and the kernel's source
    record = _record()
    assert record.launches_per_call == 1
    (run,) = record.regions
    assert run.runs_kernel and run.verification == "passed"
    program = fusegraph.last_capture().program
    ln = [n for n, d in program.graph.nodes(data=True) if d.get("op") == "aten.native_layer_norm.default"]
    assert ln and set(ln) <= run.kernel_nodes
    (plan,) = record.run.plans
    assert "generic lowering of mypkg.layer_norm" in plan.generated.source
    assert any(i.pattern == "mypkg.layer_norm" for i in plan.lowered.program.instructions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tutorial_numerics_equal_eager_over_steps(tutorial, dtype):
    ns: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for i, code in enumerate(_tutorial_blocks()[:2]):  # the pattern, then the Block it is tried on
            exec(compile(code, f"docs/patterns.md block {i}", "exec"), ns)
    torch.manual_seed(0)
    block = ns["Block"](256).to(dtype).eval()
    step = _compile(block)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        for _ in range(3):
            x = (3.0 + torch.randn(2, 1, 256)).to(dtype)  # offset: a missing mean subtraction cannot pass
            got, want = step(x), block(x)
            assert got.dtype == want.dtype
            assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()
    record = _record()
    assert record.launches_per_call == 1 and [r.verification for r in record.regions] == ["passed"]


# ---- a plugin with its own template, installed by entry point -------------------------------------------------
@pytest.fixture
def normplugin(tmp_path, monkeypatch):
    dist = tmp_path / "fg_normplugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fg-normplugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[fusegraph.patterns]\nfgnorm = fg_normplugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(PLUGINS))
    REGISTRY.reload_plugins()
    REGISTRY.ensure_loaded()
    yield sys.modules["fg_normplugin"]
    monkeypatch.undo()
    for mod in [m for m in sys.modules if m.startswith("fg_normplugin")]:
        del sys.modules[mod]
    REGISTRY.reload_plugins()
    registry.unregister_lowering("fgnorm_l2norm")
    assert all(p.source == "fusegraph" for p in registered_patterns())


class NormBlock(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.fc = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.gain * (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6))
        return x + self.fc(h)


def test_plugin_template_conformance_and_reference(normplugin):
    """The plugin's template through the same harness as the built-ins (tests/codegen/test_templates.py): both NKI
    API tables, the interpreter against the instruction's own reference and against the pattern's reference."""
    torch.manual_seed(1)
    T, H = 3, 384
    b = Builder(T)
    xt = torch.randn(T, H)
    wt = 1 + 0.1 * torch.randn(H)
    x = b.act("x", xt)
    y = b.new("y", H, torch.float32)
    b.ins.append(normplugin.L2Norm(x=x, weight=b.hbm("w", wt), out=y, eps=1e-6, layer=0))
    b.store(y)
    gen, res, ref, _ = b.run()
    assert check_source(gen.source, versions=("0.3.0",)) == [] and check_source(gen.source, versions=("0.6.0",)) == []
    assert "L2 norm" in gen.source
    torch.testing.assert_close(res["out_y"], ref["y"], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(res["out_y"], normplugin.l2norm(xt, wt, eps=1e-6), atol=2e-5, rtol=2e-5)


def test_plugin_with_own_template_runs_in_the_megakernel(normplugin):
    torch.manual_seed(2)
    block = NormBlock(256).eval()
    step = _compile(block)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(1, 1, 256)
            got, want = step(x), block(x)
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    record = _record()
    assert record.launches_per_call == 1 and [r.verification for r in record.regions] == ["passed"]
    (plan,) = record.run.plans
    assert [i.opcode for i in plan.lowered.program.instructions].count("fgnorm_l2norm") == 1
    assert "L2 norm" in plan.generated.source
    # the kernel cache key follows the plugin's template directory and code
    assert normplugin.lower_l2norm.__code__.co_filename in {str(p) for p in registry.lowering_sources()}


def test_template_hash_covers_plugin_templates(tmp_path):
    from fusegraph.codegen import registry, render

    before = registry.templates_hash()
    d = tmp_path / "tpl"
    d.mkdir()
    (d / "fgtest_hash_probe.j2").write_text("# {{ x }}\n")
    try:
        render.add_template_dir(d)
        with_dir = registry.templates_hash()
        (d / "fgtest_hash_probe.j2").write_text("# changed {{ x }}\n")
        assert before != with_dir != registry.templates_hash()
        assert render.render("fgtest_hash_probe.j2", x=1) == "# changed 1\n"
    finally:
        render._PLUGIN_DIRS.remove(d.resolve())


# ---- refused at region formation, never the whole region -----------------------------------------------------
class I0Block(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(hidden, hidden)
        self.down = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.up(x)
        h = torch.i0(h) * 0.5
        return x + self.down(h)


@pytest.fixture
def i0_pattern():
    @fusegraph.register_pattern("fgtest.half_i0", inputs=[fusegraph.Input("x", "T H")], priority=40,
                                dtypes=("float32",))
    def half_i0(x):
        return torch.i0(x) * 0.5

    yield
    unregister_pattern("fgtest.half_i0")


def test_unlowerable_match_is_refused_at_region_formation(i0_pattern):
    """A pattern with no lowering whose body generic lowering cannot compute (a Bessel function, ``i0``: no generic path takes it) is refused when regions
    form, with its reason in the decision log and the report; the explain dry run shows the regions the executor
    then builds, and the rest of the block still runs as kernels."""
    rep = fusegraph.explain(I0Block(64).eval(), torch.randn(1, 1, 64))
    d = rep.to_dict()
    (refusal,) = [x for x in d["decisions"] if x["action"] == "refuse_match" and "fgtest.half_i0" in x["subject"]]
    assert "cannot be lowered" in refusal["reason"] and "i0" in refusal["reason"]
    (u,) = [u for u in d["unmatched"] if u["op"] == "aten.i0.default"]
    assert "fgtest.half_i0 matched here but cannot be lowered" in u["reason"]
    assert "fgtest.half_i0" not in d["pattern_counts"]
    explained = sorted(sorted(r.nodes) for r in rep.analysis.regions)
    assert explained

    block = I0Block(64).eval()
    step = _compile(block)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            x = torch.randn(1, 1, 64)
            got, want = step(x), block(x)
    assert not [w for w in caught if issubclass(w.category, FusegraphWarning) and "no NKI template" in str(w.message)]
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    record = _record()
    built = sorted(sorted(r.nodes) for r in record.run.analysis.regions)
    assert built == explained  # the dry run showed the regions the executor built
    assert record.launches_per_call == len(explained) and all(r.verification == "passed" for r in record.regions)
    i0 = [n for n, dd in record.run.program.graph.nodes(data=True) if dd.get("op") == "aten.i0.default"]
    assert i0 and not any(set(i0) & r.kernel_nodes for r in record.regions)  # it ran eagerly


def _decode_with_lowering(monkeypatch, lowering, lower, marker: str, steps: int, **options) -> list[str]:
    """Greedy-decode llama-tiny with ``lowering.lower`` replaced by ``lower``; tokens and logits must equal eager.
    Returns the fusegraph warnings that contain ``marker``."""
    from fusegraph.models import build_decode, greedy_decode

    monkeypatch.setattr(lowering, "lower", lower)
    case = build_decode("llama-tiny")
    ref = case.fork()
    step = _compile(case.step, **options)
    with pytest.warns(FusegraphWarning) as caught:
        toks_c, logits_c = greedy_decode(step, case.token, case.position, steps)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, steps)
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    for a, b in zip(logits_c, logits_e):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()
    return [str(w.message) for w in caught if marker in str(w.message)]


def _flaky_add(targets: dict):
    add = registry.lowering_for("residual_add")
    original = add.lower

    def flaky(L, m):  # the first residual add of layer 1 lowered (after its attention) fails, every time
        if m.pattern.name == "fusegraph.residual_add" and m.layer == 1:
            if targets.setdefault((id(L.prog), m.graphs), m) is m:
                raise CodegenError("injected failure")
        return original(L, m)
    return add, flaky


def test_build_failure_sends_the_failing_match_to_generic_lowering(monkeypatch):
    """A pattern's lowering that raises at build time (the residual add of layer 1) does not cost the kernel its
    ops: generic lowering takes them (issue 27), one warning names the match and the cause, one launch, tokens
    equal eager, and the add's ops ran in the kernel."""
    targets: dict = {}
    add, flaky = _flaky_add(targets)
    msgs = _decode_with_lowering(monkeypatch, add, flaky, "injected failure", steps=3)
    assert msgs and len(set(msgs)) == 1 and len(msgs) <= 2
    assert "fusegraph.residual_add at model.layers.1" in msgs[0] and "generic lowering" in msgs[0]
    record = _record()
    assert record.launches_per_call == 1 and all(r.verification == "passed" for r in record.regions)
    (failed,) = [m for m in targets.values() if m.graphs == (record.graph,)][-1:]
    ops = {n for n in failed.nodes if record.run.program.graph.nodes[n]["kind"] == "op"}
    assert ops and ops <= set(record.regions[0].kernel_nodes)  # its ops ran in the kernel


def test_build_failure_sends_only_the_failing_match_to_the_eager_path(monkeypatch):
    """Without generic lowering (``generic_lowering=False``), a lowering that raises at build time (the residual
    add of layer 1) costs that match only: one warning naming it and the cause, the rest of the decoder stack stays
    in kernels, tokens equal eager."""
    targets: dict = {}
    add, flaky = _flaky_add(targets)
    msgs = _decode_with_lowering(monkeypatch, add, flaky, "injected failure", steps=3, generic_lowering=False)
    # one warning per build (dynamo may compile the step twice in a long test session)
    assert msgs and len(set(msgs)) == 1 and len(msgs) <= 2
    assert "fusegraph.residual_add at model.layers.1" in msgs[0]
    assert "the rest of the region stays in the kernel" in msgs[0]
    record = _record()
    assert record.launches_per_call == 2 and all(r.verification == "passed" for r in record.regions)
    assert [r.region_id for r in record.regions] == [0, 0]  # one region, two kernels around the dropped add
    (dropped,) = [m for m in targets.values() if m.graphs == (record.graph,)][-1:]
    assert not any(set(dropped.nodes) & r.kernel_nodes for r in record.regions)  # its ops ran eagerly


@pytest.mark.parametrize("exc", [SystemExit(4), ValueError("plugin bug"), AssertionError("plugin assert")])
def test_lowering_raising_anything_costs_its_match_only(monkeypatch, exc):
    """A lowering that raises something other than CodegenError (a plugin's SystemExit(4) included) must not end
    the user's process: it is contained like a CodegenError of that match (one warning naming the exception), the
    rest of the region stays in kernels, tokens equal eager. KeyboardInterrupt still propagates (next test)."""
    add = registry.lowering_for("residual_add")
    original = add.lower

    def broken(L, m):
        if m.pattern.name == "fusegraph.residual_add" and m.layer == 1:
            raise exc
        return original(L, m)

    msgs = _decode_with_lowering(monkeypatch, add, broken, type(exc).__name__, steps=2)
    assert msgs and "fusegraph.residual_add at model.layers.1" in msgs[0]
    record = _record()
    assert record.launches_per_call >= 1 and all(r.verification == "passed" for r in record.regions)


def test_lowering_keyboard_interrupt_propagates(monkeypatch):
    from fusegraph.models import build_decode

    add = registry.lowering_for("residual_add")

    def interrupted(L, m):
        raise KeyboardInterrupt

    monkeypatch.setattr(add, "lower", interrupted)
    case = build_decode("llama-tiny")
    step = _compile(case.step)
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        step(case.token, case.position)


# ---- the registry ---------------------------------------------------------------------------------------------
def test_builtin_lowerings_and_every_instruction_is_a_registered_op():
    lows = registry.lowerings()
    assert registry.host_side_templates() == {"rope_tables", "causal_mask", "cache_position", "generic_host"}
    builtin_templates = {p.template for p in registered_patterns() if p.source == "fusegraph"}
    assert builtin_templates - {"all_reduce", "all_gather"} <= set(lows)
    for name, cls in registry.instruction_classes().items():
        if cls.__module__.startswith(("fusegraph.codegen", "fusegraph.patterns")):
            assert cls.emit is not ir.Instruction.emit and cls.reference is not ir.Instruction.reference, name
    from fusegraph.codegen.lowering import lower_region
    from fusegraph.executors.kernels import decode_tokens
    from fusegraph.matching import analyze
    from fusegraph.models import build_decode

    case = build_decode("qwen3-moe-tiny")
    cap = fusegraph.capture_step(case.step, case.token, case.position, options={"executor": "eager"})
    a = analyze(cap.program, lowerable=registry.check)
    (region,) = a.regions
    lowered = lower_region(cap.program, region, decode_tokens(cap.program, region))
    for ins in lowered.program.instructions:  # every instruction a model lowers to is a registered op's
        assert registry.instruction_class(type(ins).__name__) is type(ins), ins.opcode
    assert "experts" in {i.opcode for i in lowered.program.instructions}


def test_mish_is_one_activation_everywhere():
    """The slot matches mish, so the templates emit it and the reference computes it (one activation table)."""
    from fusegraph.codegen.emitters import act_op
    from fusegraph.matching import ACTIVATIONS
    from fusegraph.matching.activations import activation

    assert "mish" in ACTIVATIONS.names() and act_op("mish") == "nl.mish"
    torch.manual_seed(3)
    T, F = 2, 256
    b = Builder(T)
    g = b.act("g", torch.randn(T, F))
    u = b.act("u", torch.randn(T, F))
    out = b.new("o", F, torch.float32)
    b.ins.append(ir.GatedAct(gate=g, up=u, out=out, act="mish", layer=0))
    b.store(out)
    gen, res, ref, kt = b.run()
    assert check_source(gen.source) == [] and "op=nl.mish" in gen.source
    torch.testing.assert_close(res["out_o"], ref["o"], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ref["o"], activation("mish").fn(kt["in_g"]) * kt["in_u"], atol=1e-6, rtol=1e-6)
    assert V.ACT == "act"


def test_carve_leaves_convex_parts():
    """Dropping two matches of a decoder stack (layer 0's and layer 1's first residual adds) leaves three parts:
    disjoint, convex (no path leaves a part and comes back), covering the region but the dropped ops."""
    import networkx as nx

    from fusegraph.matching import analyze
    from fusegraph.matching.carve import carve
    from fusegraph.models import build_decode

    case = build_decode("qwen3-tiny")
    cap = fusegraph.capture_step(case.step, case.token, case.position, options={"executor": "eager"})
    (region,) = analyze(cap.program, lowerable=registry.check).regions
    adds = sorted((m for m in region.matches if m.pattern.name == "fusegraph.residual_add"), key=lambda m: m.order)
    drop = [next(m for m in adds if m.layer == 0), next(m for m in adds if m.layer == 1)]
    parts = carve(cap.program, region, drop)
    assert len(parts) == 3 and all(p.id == region.id for p in parts)
    G = cap.program.graph
    dropped = set().union(*(m.nodes for m in drop))
    seen: set = set()
    for p in parts:
        assert not (p.nodes & seen) and not (p.nodes & dropped)
        seen |= p.nodes
        outside = set(G) - p.nodes
        below = set().union(*(nx.descendants(G, n) for n in p.nodes)) & outside
        assert not any(nx.descendants(G, o) & p.nodes for o in below), "a part is not convex"
    assert {n for m in region.matches if all(m is not d for d in drop) for n in m.nodes} <= seen


class Relu2Block(torch.nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(hidden, inter, bias=False)
        self.down = torch.nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)) ** 2)


@pytest.fixture
def relu2_pattern():
    import torch.nn.functional as F

    @fusegraph.register_pattern(
        "fgtest.relu2_mlp", template="relu2_mlp", priority=40, dtypes=("float32",),
        inputs=[fusegraph.Input("x", "B 1 H"), fusegraph.Input("w_up", "I H", kind="weight"),
                fusegraph.Input("w_down", "H I", kind="weight")],
        dims={"B": (2, 3), "H": (16, 40), "I": (24, 48)})
    def relu2_mlp(x, w_up, w_down):
        """A squared-ReLU MLP (Primer, Nemotron): ``down(relu(up(x)) ** 2)``."""
        return F.linear(torch.relu(F.linear(x, w_up)) ** 2, w_down)

    yield relu2_mlp
    unregister_pattern("fgtest.relu2_mlp")


def test_plugin_body_with_small_matmuls_runs_without_nki(relu2_pattern):
    """A plugin MLP without a lowering: its projections (matmuls by model weights) become projections, its
    activation an elementwise piece, all in the one kernel."""
    torch.manual_seed(4)
    block = Relu2Block(256, 512).eval()
    step = _compile(block)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 1, 256)
            got, want = step(x), block(x)
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    record = _record()
    assert record.launches_per_call == 1 and [r.verification for r in record.regions] == ["passed"]
    (plan,) = record.run.plans
    ours = [i.opcode for i in plan.lowered.program.instructions if i.pattern == "fgtest.relu2_mlp"]
    assert ours == ["linear", "generic", "linear"]


def test_tutorial_pattern_makes_olmo_one_megakernel(tutorial):
    """OLMo-1's non-parametric LayerNorm splits its step into 5 kernels without a pattern; with the tutorial's
    plugin pattern registered (and nothing else), the whole decoder stack is one megakernel, tokens equal eager."""
    from fusegraph.models import build_family_decode, greedy_decode

    ns: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        exec(compile(_tutorial_blocks()[0], "docs/patterns.md block 0", "exec"), ns)
    case = build_family_decode("Olmo")
    ref = case.fork()
    step = _compile(case.step)
    toks_c, logits_c = greedy_decode(step, case.token, case.position, 4)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, 4)
    record = _record()
    assert record.launches_per_call == 1 and [r.verification for r in record.regions] == ["passed"]
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    for a, b in zip(logits_c, logits_e):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()


def test_lowering_api_doc_example_and_conflicts():
    """The API example of docs/patterns.md is valid Python; a plugin cannot silently take over a built-in
    template's lowering (one warning, the built-in stays), unless it asks to."""
    section = DOC.read_text().split("## Give a pattern its lowering", 1)[1].split("\n## ", 1)[0]
    (example,) = re.findall(r"```python\n(.*?)```", section, re.S)
    compile(example, "docs/patterns.md lowering example", "exec")
    builtin = registry.lowering_for("rmsnorm")
    with pytest.warns(FusegraphWarning, match="lowering of template 'rmsnorm' .* ignored"):
        registry.register_lowering("rmsnorm")(lambda L, m: None)
    assert registry.lowering_for("rmsnorm") is builtin
    assert registry.is_host_side("causal_mask") and not registry.is_host_side("rmsnorm")
