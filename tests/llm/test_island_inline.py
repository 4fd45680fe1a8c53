"""Accepted LLM-written kernels inside the megakernel (issue 17 item 1).

A tiny Llama whose MLP activation is a ``cumsum`` (no pattern covers it, and the tensor path's scan is taken out of
generic lowering's table for these tests, so it stands for an op nothing lowers) is compiled with the (fake) LLM
writer on: the island is written before the kernel is built, joins the decoder-stack region as an
``llm_island`` match and is inlined as a sub-function, so the step is ONE launch. A text changed after
verification, hostile text that reaches inlining, and a statically valid but numerically wrong kernel (a forged
cache entry) are all refused, and the step's results stay eager's."""
import hashlib
import warnings

import pytest
import torch

from fusegraph import FusegraphWarning
from fusegraph.capture.session import last_session
from fusegraph.codegen.errors import CodegenError
from fusegraph.codegen.api import InlineSource
from fusegraph.patterns.llm_island.lowering import recheck_source, sub_function
from fusegraph.llm.harness import parse, static_checks
from fusegraph.llm.safety import check_safety
from fusegraph.matching import tensor_ops
from fusegraph.models import build_decode, greedy_decode

from . import kernels as K
from .fake_llm import FakeLLM
from .kernels import answer

INTERMEDIATE = 256


def cumsum_kernel(n: int = INTERMEDIATE, cmp: str = "greater_equal") -> str:
    """A correct NKI cumsum over the last dim of a [1, 1, n] fp32 tensor (n a multiple of 128): one upper-triangular
    ones matrix per 128-row tile of K, accumulated in PSUM. ``cmp="greater"`` gives the exclusive scan (wrong)."""
    return f'''import nki
import nki.language as nl
import nki.isa as nisa


@nki.jit
def island_0(in0):
    out = nl.ndarray(shape=(1, 1, {n}), dtype=nl.float32, buffer=nl.shared_hbm, name="out")
    ones = nl.ndarray(shape=(128, {n}), dtype=nl.float32, buffer=nl.sbuf, name="ones")
    nisa.memset(dst=ones, value=1.0)
    ps = nl.ndarray(shape=(1, {n}), dtype=nl.float32, buffer=nl.psum, name="ps")
    for kt in range({n // 128}):
        xT = nl.ndarray(shape=(128, 1), dtype=nl.float32, buffer=nl.sbuf, name="xT")
        nisa.dma_copy(dst=xT, src=in0.ap(pattern=[[1, 128], [1, 1]], offset=kt * 128))
        upper = nl.ndarray(shape=(128, {n}), dtype=nl.float32, buffer=nl.sbuf, name="upper")
        nisa.affine_select(dst=upper, pattern=[[1, {n}]], channel_multiplier=-1, on_true_tile=ones,
                           on_false_value=0.0, cmp_op=nl.{cmp}, offset=-kt * 128)
        nisa.nc_matmul(dst=ps, stationary=xT, moving=upper, accumulate=(kt != 0))
    y = nl.ndarray(shape=(1, {n}), dtype=nl.float32, buffer=nl.sbuf, name="y")
    nisa.tensor_copy(dst=y, src=ps)
    nisa.dma_copy(dst=out.ap(pattern=[[{n}, 1], [1, {n}]], offset=0), src=y)
    return out
'''


class CumsumAct(torch.nn.Module):
    """An MLP activation only the LLM can write: a running sum over the intermediate features."""

    def forward(self, x):
        return torch.cumsum(x, dim=-1) * 0.05


def _case(layers: int = 2):
    case = build_decode("llama-tiny", num_layers=layers, config_overrides={"intermediate_size": INTERMEDIATE})
    for layer in case.model.model.layers:
        layer.mlp.act_fn = CumsumAct()
    return case


def _compile(case, url, rounds=0, **kw):
    opts = {"executor": "nkisim", "cache_dir": "off",
            "llm": {"url": url, "model": "nki-coder", "max_rounds": rounds}, **kw}
    return torch.compile(case.step, backend="fusegraph", options=opts)


def _record(session):
    """The execution record of the step's latest graph (a recompile, which dynamo may do depending on what ran
    before in the process, starts a new version of the step)."""
    return max(session.program.execution.items())[1]


def _close(logits_c, logits_e, toks_c, toks_e):
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    for a, b in zip(logits_c, logits_e):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()


@pytest.fixture(scope="module", autouse=True)
def cumsum_not_lowered():
    """The tensor path computes cumsum (``fusegraph.codegen.tensor.scan``): without it in generic lowering's table,
    the activation is an op nothing lowers, which is what these tests need."""
    mp = pytest.MonkeyPatch()
    mp.delitem(tensor_ops.CATEGORY, "aten.cumsum.default")
    yield
    mp.undo()


@pytest.fixture
def llm_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEGRAPH_LLM_CACHE_DIR", str(tmp_path / "llm"))
    return tmp_path / "llm"


@pytest.fixture(scope="module")
def inlined_run(tmp_path_factory):
    """One compile of the 2-layer cumsum decoder with a correct answer, 3 greedy steps (shared by the checks)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("FUSEGRAPH_LLM_CACHE_DIR", str(tmp_path_factory.mktemp("llm")))
    try:
        case = _case()
        ref = case.fork()
        with FakeLLM([answer(cumsum_kernel())]) as fake, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = _compile(case, fake.url)
            toks_c, logits_c = greedy_decode(step, case.token, case.position, 3)
            requests = len(fake.requests)
        session = last_session()
        toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, 3)
    finally:
        mp.undo()
    return {"session": session, "requests": requests, "c": (toks_c, logits_c), "e": (toks_e, logits_e),
            "warnings": [str(w.message) for w in caught]}


def test_island_runs_inside_one_megakernel_and_equals_eager(inlined_run):
    assert inlined_run["warnings"] == []
    stats = _record(inlined_run["session"])
    assert stats.launches_per_call == 1  # ONE launch per step, the islands inside it
    assert list(stats.verification.values()) == ["passed"]  # first-call verification covered the islands
    assert len(stats.regions) == 1
    islands = stats.llm
    assert len(islands) == 2 and all(i.inlined and not i.runs_kernel for i in islands)
    assert all(i.executed_by == "nkisim (llm)" for i in islands)
    assert all(i.calls == 0 for i in islands)  # never run in the isolated worker
    assert inlined_run["requests"] == 1  # layer 1's island is a cache hit of layer 0's
    _close(inlined_run["c"][1], inlined_run["e"][1], inlined_run["c"][0], inlined_run["e"][0])


def test_megakernel_source_calls_the_verified_text_as_a_sub_function(inlined_run):
    run = _record(inlined_run["session"]).run
    plan = run.plans[0]
    src = plan.generated.source
    isl = run.islands[0]
    sha = isl.result.sha256
    assert sha == hashlib.sha256(isl.result.kernel_source.encode()).hexdigest()
    fn = f"llm_{sha[:12]}_island_0"
    assert src.count(f"def {fn}(") == 1  # both layers call one sub-function
    assert src.count(f"= {fn}(") == 2
    assert src.index(f"def {fn}(") < src.index("@nki.jit")  # module level, before the kernel
    assert src.count("@nki.jit") == 1  # the island's decorator is dropped: a plain helper of the kernel
    kinds = [type(i).__name__ for i in plan.lowered.program.instructions]
    assert kinds.count("LlmIsland") == 2


def test_report_shows_the_island_executed_by_the_kernel(inlined_run):
    from fusegraph.report.api import report_for_session
    from fusegraph.report.text import format_report

    rep = report_for_session(inlined_run["session"]).to_dict()
    entries = rep["llm_kernels"]
    assert [e["executed_by"] for e in entries] == ["nkisim (llm)", "nkisim (llm)"]
    name = _record(inlined_run["session"]).run.plans[0].generated.name
    assert all(e["kernel"] == name for e in entries)
    assert rep["kernel_launches_per_step"] == 1
    # the report's regions are the kernels' regions: one, with the islands in it, nothing left unmatched
    assert [(r["id"], r["executed_by"]) for r in rep["regions"]] == [(0, "nkisim")]
    assert rep["pattern_counts"]["fusegraph.llm_island"] == 2 and rep["unmatched"] == []
    assert rep["coverage"] == 1.0
    text = format_report(rep)
    assert f"executed_by: nkisim (llm) inside {name}" in text


def test_text_changed_after_verification_is_refused_at_inlining(llm_cache, monkeypatch):
    """A kernel that passed isolated verification and was then modified (the cached/in-memory text tampered
    with) is refused when it is inlined, and not run anywhere else either."""
    import fusegraph.llm.writer as writer

    real = writer.write_kernel

    def tampered(task, settings):
        res = real(task, settings)
        if res.accepted:  # statically valid, numerically wrong, but the recorded hash is the verified one's
            res.kernel_source = res.kernel_source.replace("nl.greater_equal", "nl.greater")
        return res

    monkeypatch.setattr(writer, "write_kernel", tampered)
    case = _case(layers=1)
    ref = case.fork()
    with FakeLLM([answer(cumsum_kernel())]) as fake:
        step = _compile(case, fake.url)
        with pytest.warns(FusegraphWarning, match="changed after verification .*refused at inlining"):
            toks_c, logits_c = greedy_decode(step, case.token, case.position, 2)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, 2)
    _close(logits_c, logits_e, toks_c, toks_e)
    stats = _record(last_session())
    assert not any(i.inlined for i in stats.llm)
    assert all(i.executed_by == "eager" and i.calls == 0 for i in stats.llm)
    for p in stats.run.plans:
        assert "llm_" not in p.generated.source


def test_forged_cache_entry_fails_the_megakernels_verification(llm_cache, monkeypatch):
    """The LLM cache is checked statically when loaded, not numerically: a statically valid but wrong kernel
    forged into it (an entry whose key and hash are consistent) is inlined, and the megakernel's first-call
    verification against eager catches it: one warning, the region runs eagerly, results stay eager's."""
    from fusegraph.llm import cache as llm_cache_mod

    wrong = cumsum_kernel(cmp="greater")  # exclusive scan: passes every static check, numerically wrong
    monkeypatch.setattr(llm_cache_mod.KernelCache, "load",
                        lambda self, key: llm_cache_mod.CacheEntry(key, wrong, {"task": "island_0"}))
    case = _case(layers=1)
    ref = case.fork()
    with FakeLLM([]) as fake:  # no request may be made: the forged entry is a cache hit
        step = _compile(case, fake.url)
        with pytest.warns(FusegraphWarning, match="verification against eager failed") as rec:
            toks_c, logits_c = greedy_decode(step, case.token, case.position, 2)
        assert fake.requests == []
    assert sum("verification against eager failed" in str(w.message) for w in rec) == 1
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, 2)
    _close(logits_c, logits_e, toks_c, toks_e)
    stats = _record(last_session())
    isl = stats.llm[0]
    assert isl.result.from_cache and isl.inlined and isl.executed_by == "eager"
    assert stats.launches_per_call == 0  # the region runs eagerly from the first call on
    assert list(stats.verification.values())[0].startswith("output")  # why: an output differed from eager


HOSTILE = {
    "torch fallback": K.TORCH_FALLBACK,
    "numpy import": K.NUMPY_FALLBACK,
    "returns its input": K.RETURNS_INPUT,
    "copy only": K.COPY_ONLY,
    "invented API": K.INVENTED_API,
    "import os": K.HEADER.replace("import nki\n", "import os\nimport nki\n") + K.GOOD.split(K.HEADER, 1)[1],
    "open()": K.GOOD.replace("    return out\n", "    open('/tmp/x', 'w')\n    return out\n"),
    "dunder walk": K.GOOD.replace("    return out\n", "    x.__class__.__bases__\n    return out\n"),
    "getattr": K.GOOD.replace("    return out\n", "    getattr(x, 'shape')\n    return out\n"),
    "class": K.GOOD + "\n\nclass Evil:\n    pass\n",
}


@pytest.mark.parametrize("what", sorted(HOSTILE))
def test_hostile_text_is_refused_at_inlining_even_with_a_matching_hash(what):
    """Second line behind the harness: whatever text reaches inlining is re-checked by the same allow-list,
    conformance and contract checks, whatever its hash says."""
    src = HOSTILE[what]
    task = K.scaled_add_task()

    def recheck(s):
        _, bad = static_checks(s, task)
        return None if bad is None else bad.reason

    spec = InlineSource(source=src, sha256=hashlib.sha256(src.encode()).hexdigest(), entry="scaled_add",
                        inputs=("a", "b"), outputs=("c",), recheck=recheck, what=what)
    with pytest.raises(CodegenError, match="static checks at inlining"):
        recheck_source(spec)


def test_good_text_passes_the_inlining_checks_and_a_changed_hash_does_not():
    task = K.scaled_add_task()

    def recheck(s):
        _, bad = static_checks(s, task)
        return None if bad is None else bad.reason

    good = hashlib.sha256(K.GOOD.encode()).hexdigest()
    recheck_source(InlineSource(K.GOOD, good, "scaled_add", ("a", "b"), ("c",), recheck))
    with pytest.raises(CodegenError, match="changed after verification"):
        recheck_source(InlineSource(K.GOOD + "\n", good, "scaled_add", ("a", "b"), ("c",), recheck))


def test_sub_function_renames_every_top_level_name_and_drops_decorators():
    src = '''import math
import nki
import nki.language as nl
import nki.isa as isa
from nki.language import ndarray

TILE = 128


def helper(t, nl_arg):
    return t * TILE


@nki.jit
def kern(x):
    y = ndarray(shape=(helper(1, 0), 4), dtype=nl.float32, buffer=nl.sbuf, name="y")
    return y
'''
    code, names = sub_function(src, "llm_abc_")
    assert set(names) == {"nl", "isa", "ndarray", "TILE", "helper", "kern"}
    assert "def llm_abc_kern(x):" in code and "def llm_abc_helper(t, nl_arg):" in code
    assert "llm_abc_TILE = 128" in code and "t * llm_abc_TILE" in code
    assert "import nki.language as llm_abc_nl" in code and "from nki.language import ndarray as llm_abc_ndarray" in code
    assert "llm_abc_nl.float32" in code and "@" not in code
    assert "import math" in code and "\nimport nki\n" in code  # same module objects as the megakernel's header
    tree, bad = parse(code)
    assert bad is None and check_safety(tree) == []  # the inlined form is still allow-listed


def test_bisect_runs_through_a_kernel_holding_islands(inlined_run):
    from fusegraph.executors.bisect import bisect_graph

    session = inlined_run["session"]
    assert bisect_graph(session.program, _record(session).graph) == []


def test_reference_vm_runs_the_islands_own_aten_ops(inlined_run):
    """The reference hook (what bisection compares a kernel with) is the island's ATen ops on logical values."""
    from fusegraph.codegen.reference import run as reference_run

    plan = _record(inlined_run["session"]).run.plans[0]
    ins = next(i for i in plan.lowered.program.instructions if type(i).__name__ == "LlmIsland")
    x = torch.randn(1, INTERMEDIATE)
    env = {ins.args[0].name: x}
    prog = type(plan.lowered.program)(name="t", tokens=1, instructions=[ins], inputs=[], outputs=[])
    reference_run(prog, env)
    torch.testing.assert_close(env[ins.outs[0].name], torch.cumsum(x, -1))


def test_failure_to_place_the_islands_leaves_them_in_the_isolated_worker(llm_cache, monkeypatch):
    """Inlining is an optimization: if the islands cannot join the regions, one warning, and the accepted kernels
    run where they did before (the isolated worker), with the step's results eager's."""
    import fusegraph.executors.llm_fallback as lf

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(lf, "with_island_matches", broken)
    case = _case(layers=1)
    ref = case.fork()
    with FakeLLM([answer(cumsum_kernel())]) as fake:
        step = _compile(case, fake.url)
        with pytest.warns(FusegraphWarning, match="could not join the regions .*boom.*isolated worker"):
            toks_c, logits_c = greedy_decode(step, case.token, case.position, 2)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, 2)
    _close(logits_c, logits_e, toks_c, toks_e)
    (isl,) = _record(last_session()).llm
    assert not isl.inlined and isl.executed_by == "llm worker" and isl.calls == 2


def test_hostile_answers_for_the_island_are_all_rejected_and_nothing_is_inlined(llm_cache):
    """Through the whole compile: three hostile answers (a torch fallback, an `os` import around a correct kernel,
    the input handed back) use up the repair rounds, each rejected by the harness; nothing is inlined, the
    decoder keeps its eager cumsum between kernels and its results."""
    hostile = [
        "import torch\nimport nki\n\n\n@nki.jit\ndef island_0(in0):\n    return torch.cumsum(torch.as_tensor(in0), -1)\n",
        cumsum_kernel().replace("import nki\n", "import os\nimport nki\n", 1),
        "import nki\nimport nki.language as nl\n\n\n@nki.jit\ndef island_0(in0):\n    return in0\n",
    ]
    case = _case(layers=1)
    ref = case.fork()
    with FakeLLM([answer(h) for h in hostile]) as fake:
        step = _compile(case, fake.url, rounds=2)
        with pytest.warns(FusegraphWarning, match="LLM kernel for aten.cumsum.default not used"):
            toks_c, logits_c = greedy_decode(step, case.token, case.position, 2)
        assert len(fake.requests) == 3
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, 2)
    _close(logits_c, logits_e, toks_c, toks_e)
    stats = _record(last_session())
    (isl,) = stats.llm
    assert [a.stage for a in isl.result.attempts] == ["safety", "safety", "contract"]
    assert not isl.result.accepted and not isl.inlined and isl.executed_by == "eager"
    assert stats.launches_per_call == 2  # the eager cumsum splits the layer's kernel in two
    assert all("llm_" not in p.generated.source for p in stats.run.plans)


@pytest.mark.slow
def test_second_compile_reuses_both_caches(llm_cache, tmp_path):
    """The LLM cache serves the island (no request) and the megakernel cache serves the kernel holding it (its key
    covers the island's exact text and a stable reference repr); the lowering still re-checks the text."""
    kernels = tmp_path / "kernels"
    for k in range(2):
        torch._dynamo.reset()
        case = _case(layers=1)
        ref = case.fork()
        with FakeLLM([answer(cumsum_kernel())]) as fake:
            step = _compile(case, fake.url, cache_dir=str(kernels))
            toks_c, logits_c = greedy_decode(step, case.token, case.position, 2)
            assert len(fake.requests) == (1 if k == 0 else 0)
        toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, 2)
        _close(logits_c, logits_e, toks_c, toks_e)
        stats = _record(last_session())
        assert stats.launches_per_call == 1 and [p.cache_hit for p in stats.run.plans] == [k == 1]
        assert stats.llm[0].executed_by == "nkisim (llm)"
