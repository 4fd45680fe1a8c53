"""Complex numbers as real pairs (``fusegraph/program/complex_pairs.py``, docs/capture.md "Complex numbers").

Unit tests: each op on complex values, lowered and rewritten the way the pipeline does it (``check_complex``,
``add_graph``, which runs ``rewrite_complex_pairs``, the eager executor behind ``pair_boundary``), against PyTorch's complex
result on random inputs: bit-for-bit where the pair form is the arithmetic PyTorch's CPU kernels do, within the
stated ulps where it is not (``polar``; a complex product's scalar tail). Models: a llama-tiny whose rotary
embedding is complex (Llama 4 / DeepSeek-V2 style), tiny Llama 4 text and DeepSeek-V2, over 5 greedy steps
against eager, and with the nkisim executor where the rope ops run.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from transformers import StaticCache
from transformers.models.llama.modeling_llama import LlamaAttention, eager_attention_forward

from fusegraph.capture.checks import CaptureRefused, check_complex
from fusegraph.capture.lower import to_aten
from fusegraph.capture.session import last_session
from fusegraph.executors.eager import EagerExecutor
from fusegraph.models import build_decode, build_family_decode, greedy_decode
from fusegraph.program import CapturedGraph, InputKind, Program, ProgramInput
from fusegraph.program.build import add_graph
from fusegraph.program.complex_pairs import pair_boundary
from fusegraph.report import report_for_session
from fusegraph.settings import Settings
from fusegraph.warnings import FusegraphWarning

EPS = torch.finfo(torch.float32).eps


# ---- the rewrite, op by op ---------------------------------------------------------------------------------------
def _lowered(fn, *args):
    """``fn`` through the pipeline's steps: its program (rewritten) and the runner dynamo would call."""
    gm = to_aten(fn, list(args))
    check_complex(gm)
    program = Program()
    captured = add_graph(program, gm, 0, None)  # rewrites complex values into pairs
    return program, pair_boundary(captured, EagerExecutor().compile(program, 0, Settings(executor="eager")))


def _complex_left(program: Program) -> list[str]:
    return [n for n, d in program.graph.nodes(data=True) if "complex" in str(d.get("dtype"))]


def _run(fn, *args):
    program, run = _lowered(fn, *args)
    assert _complex_left(program) == [], "complex values left in the program"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch's "casting complex values to real discards the imaginary part"
        want = fn(*[a.clone() for a in args])
    got = run([a.clone() for a in args])
    want = list(want) if isinstance(want, (list, tuple)) else [want]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
    return program, got, want


def _c(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.complex(torch.randn(*shape, generator=g), torch.randn(*shape, generator=g))


def _r(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rope(q, freqs_cis):
    """Llama 4's apply_rotary_emb for one tensor: q [B, S, H, D], freqs_cis [B, S, D/2] complex."""
    q_ = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
    return torch.view_as_real(q_ * freqs_cis[:, :, None, :]).flatten(3).type_as(q)


def _assign(a, b, row):
    x = a.clone()
    x[:, 1:3] = b
    x[2] = row
    return x


#: (id, function, inputs): results bit-for-bit PyTorch's (complex products over inner loops of a multiple of 8
#: complex elements: PyTorch's vectorized kernel, see test_product_tail_is_within_an_ulp)
EXACT = [
    ("rope", _rope, lambda: (_r(1, 1, 4, 32), _c(1, 1, 16))),
    ("mul", lambda a, b: a * b, lambda: (_c(3, 16), _c(1, 16, seed=2))),
    ("mul_real_tensor", lambda a, r: a * r, lambda: (_c(2, 8), _r(8))),
    ("real_tensor_mul", lambda r, a: r * a, lambda: (_r(3, 1), _c(3, 8))),
    ("mul_number", lambda a: a * 0.5, lambda: (_c(4, 8),)),
    ("mul_complex_number", lambda a: a * (0.5 - 2j), lambda: (_c(4, 8),)),
    ("real_times_complex_number", lambda r: r * 1j, lambda: (_r(4, 8),)),
    ("add", lambda a, b: a + b, lambda: (_c(2, 8), _c(2, 8, seed=3))),
    ("sub_alpha", lambda a, b: torch.sub(a, b, alpha=2), lambda: (_c(2, 8), _c(1, 8, seed=3))),
    ("add_real_tensor_broadcast", lambda a, r: a + r, lambda: (_c(1, 8), _r(3, 8))),
    ("real_tensor_sub", lambda r, a: r - a, lambda: (_r(8), _c(2, 8))),
    ("add_number", lambda a: a + 1.5, lambda: (_c(2, 8),)),
    ("sub_complex_number", lambda a: a - (1 + 2j), lambda: (_c(2, 8),)),
    ("conj", lambda a, b: a.conj() * b, lambda: (_c(2, 8), _c(2, 8, seed=4))),
    ("conj_physical", lambda a: torch.conj_physical(a), lambda: (_c(2, 8),)),
    ("imag_of_conj", lambda a: a.conj().imag * 2, lambda: (_c(2, 8),)),
    ("real_imag", lambda a: a.real + 2 * a.imag, lambda: (_c(2, 8),)),
    ("abs", lambda a: a.abs(), lambda: (_c(5, 16) * torch.exp(_r(5, 16) * 3),)),
    ("neg", lambda a: -a, lambda: (_c(2, 8),)),
    ("view_as_complex_real", lambda x: torch.view_as_real(torch.view_as_complex(x)) * 3, lambda: (_r(2, 8, 2),)),
    ("views", lambda a: a.reshape(2, -1).transpose(0, 1).unsqueeze(-1).contiguous(), lambda: (_c(2, 3, 4),)),
    ("permute_slice_select", lambda a: a.permute(2, 0, 1)[1:3].select(-1, 1), lambda: (_c(2, 3, 4),)),
    ("expand_squeeze", lambda a: a.unsqueeze(0).expand(3, -1, -1).squeeze(1) * 1.0, lambda: (_c(1, 4),)),
    ("flatten_narrow", lambda a: a.flatten().narrow(-1, 2, 5), lambda: (_c(2, 4),)),
    ("cat_stack", lambda a, b: torch.stack([torch.cat([a, b], -1), torch.cat([b, a], -1)], 1),
     lambda: (_c(2, 4), _c(2, 4, seed=5))),
    ("split_unbind", lambda a: (a.split(2, dim=-1)[1], a.unbind(0)[1]), lambda: (_c(3, 4),)),
    ("flip_roll_repeat", lambda a: a.flip(-1).roll(1, 0).repeat(2, 1), lambda: (_c(3, 4),)),
    ("index_select", lambda a, i: a.index_select(-1, i), lambda: (_c(3, 4), torch.tensor([3, 0, 1]))),
    ("index_copy", lambda a, i, b: a.index_copy(1, i, b), lambda: (_c(2, 4), torch.tensor([2, 0]), _c(2, 2, seed=7))),
    ("slice_and_select_assign", _assign, lambda: (_c(3, 4), _c(3, 2, seed=7), _c(4, seed=8))),
    ("to_real", lambda a: a.to(torch.float32), lambda: (_c(2, 4),)),
    ("to_half", lambda a: a.to(torch.float16), lambda: (_c(2, 4),)),
    ("to_complex", lambda r: r.to(torch.complex64) * (1 - 1j), lambda: (_r(2, 4),)),
    ("complex_in_and_out", lambda a, b: (a * b, a), lambda: (_c(2, 8), _c(2, 8, seed=6))),
]


@pytest.mark.parametrize("fn,make", [c[1:] for c in EXACT], ids=[c[0] for c in EXACT])
def test_each_op_equals_torch_bit_for_bit(fn, make):
    _, got, want = _run(fn, *make())
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g - w).abs().max()


def test_rewritten_nodes_say_what_they_compute():
    program, _, _ = _run(_rope, _r(1, 1, 4, 32), _c(1, 1, 16))
    G = program.graph
    ops = sorted(G.nodes[n]["op"] for n in G if G.nodes[n].get("complex_op") == "aten.mul.Tensor")
    # the complex product as PyTorch's vectorized kernel: 4 parts, 4 products, c negated, 2 subtractions, stacked
    assert ops.count("aten.select.int") == 4 and ops.count("aten.mul.Tensor") == 4
    assert ops.count("aten.sub.Tensor") == 2 and ops.count("aten.neg.default") == 1
    assert ops.count("aten.stack.default") == 1 and "aten.add.Tensor" not in ops
    assert not any(str(G.nodes[n].get("op")).startswith("aten.view_as_") for n in G)  # no-ops on pairs: gone


def test_polar_is_within_an_ulp():
    """``aten.cos``/``aten.sin`` are not the functions ``torch.polar`` calls on CPU: within one ulp of it (and
    exactly the magnitude times ``aten.cos``/``aten.sin``, the ops the program runs)."""
    mag, angle = _r(64).abs() + 0.5, _r(64, seed=2) * 20
    _, (got,), (want,) = _run(lambda m, a: torch.view_as_real(torch.polar(m, a)), mag, angle)
    assert ((got - want).abs() <= EPS * mag[:, None]).all()
    assert torch.equal(got, torch.stack([mag * torch.cos(angle), mag * torch.sin(angle)], -1))


def test_product_tail_is_within_an_ulp():
    """PyTorch's CPU complex product rounds each product (vectorized) except in the scalar tail of an inner loop
    (past the last 8 complex elements on AVX2), which fuses multiply-adds: there the pair form, which rounds each
    product, may differ in the last bit."""
    a, b = _c(64, 12), _c(1, 12, seed=7)
    _, (got,), (want,) = _run(lambda x, y: torch.view_as_real(x * y), a, b)
    scale = torch.view_as_real(a).abs().amax(-1, keepdim=True) * torch.view_as_real(b).abs().amax(-1, keepdim=True)
    assert ((got - want).abs() <= 2 * EPS * scale).all()


def test_complex_state_is_written_in_place():
    """The pairs of a complex input are a view of the caller's tensor: an in-place write of it (a complex state)
    lands in the caller's tensor."""
    def step(state, w):
        state.copy_(state * w)
        return state.abs()

    state, w = _c(2, 8), _c(2, 8, seed=8)
    program, run = _lowered(step, state.clone(), w)
    assert _complex_left(program) == []
    mine = state.clone()
    (out,) = run([mine, w])
    want_state = state * w
    assert torch.equal(mine, want_state) and torch.equal(out, want_state.abs())


@pytest.mark.parametrize("fn,op", [(lambda a, b: a / b, "aten.div.Tensor"), (lambda a, b: (a * b).sum(-1), "aten.sum")])
def test_an_op_without_pair_form_is_refused_by_name(fn, op):
    gm = to_aten(fn, [_c(2, 8), _c(2, 8, seed=9)])
    with pytest.raises(CaptureRefused, match=op.replace(".", r"\.")):
        check_complex(gm)


def test_the_rewrite_refuses_before_changing_anything():
    """Without the capture check (a caller of add_graph other than the pipeline), an op without a pair form is an
    error naming it, raised before the graph is rewritten."""
    gm = to_aten(lambda a, b: a / b, [_c(2, 8), _c(2, 8, seed=9)])
    program = Program()
    with pytest.raises(ValueError, match=r"aten\.div\.Tensor has no real-pair form"):
        add_graph(program, gm, 0, None)
    assert [d["dtype"] for n, d in program.graph.nodes(data=True) if d["kind"] == "input"] == ["complex64"] * 2


def test_refused_complex_step_runs_eagerly_with_one_warning():
    def f(a, b):
        return torch.view_as_real(a / b) + 1

    a, b = _c(2, 8), _c(2, 8, seed=10)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="fusegraph", options={"executor": "eager", "cache_dir": "off"})
    with pytest.warns(FusegraphWarning) as caught:
        out = compiled(a, b)
    messages = [str(m.message) for m in caught]
    assert len(messages) == 1 and "complex aten.div.Tensor has no real-pair form" in messages[0], messages
    assert torch.equal(out, f(a, b))


class ComplexBuffer(torch.nn.Module):
    """A complex buffer read by the step, a complex input and a complex output: the calling convention."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freqs", torch.polar(torch.ones(8), torch.linspace(0, 3, 8)))
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = torch.view_as_complex(self.proj(x).reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(c * self.freqs).flatten(-2), c * z


def test_complex_inputs_and_outputs_through_dynamo():
    model = ComplexBuffer().eval()
    x, z = _r(3, 16), _c(3, 8, seed=11)
    torch._dynamo.reset()
    step = torch.compile(model, backend="fusegraph", options={"executor": "eager", "cache_dir": "off"})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", FusegraphWarning)  # captured, not refused
        got, want = step(x, z), model(x, z)
    assert got[1].dtype == torch.complex64
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    (graph,) = last_session().program.graphs
    pairs = {p.source: (p.pairs_of, p.shape, p.kind.value) for p in graph.inputs if p.pairs_of}
    assert sorted(pairs.values()) == [("complex64", (3, 8, 2), "step"), ("complex64", (8, 2), "buffer")]
    assert list(graph.output_pairs.values()) == ["complex64"]
    assert _complex_left(last_session().program) == []


def test_a_complex_value_crossing_a_graph_break():
    """The first graph returns a complex value (as complex, from its pairs), the second takes it (as pairs): linked
    pairs to pairs, results equal eager."""
    def f(x, w):
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2)) * (1 + 1j)
        torch._dynamo.graph_break()
        return torch.view_as_real(z * w).flatten(-2)

    x, w = _r(2, 16), _c(2, 8, seed=12)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="fusegraph", options={"executor": "eager", "cache_dir": "off"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusegraphWarning)
        assert torch.equal(compiled(x, w), f(x, w))
    program = last_session().program
    (link,) = [link for link in program.links if program.graph.nodes[link.dst_node].get("pairs_of")]
    assert program.graph.nodes[link.src_node]["shape"] == program.graph.nodes[link.dst_node]["shape"] == (2, 8, 2)
    assert _complex_left(program) == []


def test_a_complex_weight_keeps_one_pairs_view():
    """Weights and buffers are passed as the same pairs view at every call (the kernel executors key a staged weight
    by its identity), a new one once the parameter's storage is replaced; step inputs are viewed at each call."""
    pin = dict(module=None, shape=(8, 2), dtype="float32", pairs_of="complex64")
    graph = CapturedGraph(index=0, inputs=[ProgramInput("g0.w", 0, InputKind.WEIGHT, "w", **pin),
                                           ProgramInput("g0.z", 1, InputKind.STEP, "z", **pin)],
                          outputs=[], state_writes={}, dynamo_node_count=0, aten_node_count=0)
    seen = []
    run = pair_boundary(graph, lambda args: seen.append(list(args)) or [])
    w = torch.nn.Parameter(_c(8), requires_grad=False)
    for _ in range(2):
        run([w, _c(8, seed=2)])
    (w1, z1), (w2, z2) = seen
    assert w1 is w2 and z1 is not z2 and torch.equal(w1, torch.view_as_real(w))
    with torch.no_grad():
        w.mul_(2)  # in place: the view sees it
    assert torch.equal(w1, torch.view_as_real(w))
    w.data = _c(8, seed=3)  # new storage: a new view
    run([w, _c(8, seed=2)])
    assert seen[-1][0] is not w1 and torch.equal(seen[-1][0], torch.view_as_real(w))


# ---- models ------------------------------------------------------------------------------------------------------
class ComplexRotary(torch.nn.Module):
    """Llama 4 / DeepSeek-V2's rotary embedding: a complex table, ``polar(1, pos * inv_freq) * scaling``."""

    def __init__(self, rotary: torch.nn.Module) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rotary.inv_freq.clone(), persistent=False)
        self.attention_scaling = rotary.attention_scaling

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        freqs = position_ids[..., None].float() * self.inv_freq.to(dtype=torch.float)
        return torch.polar(torch.ones_like(freqs), freqs) * self.attention_scaling


class ComplexRopeAttention(LlamaAttention):
    """Llama's attention with DeepSeek-V2's complex rotation of q and k (``view_as_complex`` of pairs, a complex
    product with the table, ``view_as_real``)."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        freqs_cis = position_embeddings.unsqueeze(1)
        q_ = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
        k_ = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
        q = torch.view_as_real(q_ * freqs_cis).flatten(3).type_as(q)
        k = torch.view_as_real(k_ * freqs_cis).flatten(3).type_as(k)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        out, weights = eager_attention_forward(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                                               **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _complex_llama():
    case = build_decode("llama-tiny")
    model = case.model.model
    model.rotary_emb = ComplexRotary(model.rotary_emb)
    for layer in model.layers:
        layer.self_attn.__class__ = ComplexRopeAttention
    case.cache = StaticCache(config=case.model.config, max_cache_len=32)  # prefilled again with this rope
    prompt = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = case.model(input_ids=prompt, cache=case.cache, use_cache=True).logits
    case.token = logits[:, -1].argmax(-1, keepdim=True)
    return case


#: tiny configs (TINY_DIMS otherwise): Llama 4 with 2 experts; DeepSeek-V2 MLA with a 16-dim rotary part (8 pairs)
FAMILIES = {
    "Llama4": dict(num_local_experts=2, intermediate_size_mlp=512),
    "DeepseekV2": dict(num_experts_per_tok=2, n_routed_experts=4, moe_intermediate_size=64, q_lora_rank=None,
                       kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                       first_k_dense_replace=1, num_key_value_heads=4),
}


def _case(name: str):
    return _complex_llama() if name == "complex-llama" else build_family_decode(name, **FAMILIES[name])


def _decode(name: str, executor: str, steps: int = 5):
    case = _case(name)
    ref = case.fork()
    torch._dynamo.reset()
    step = torch.compile(case.step, backend="fusegraph", options={"executor": executor, "cache_dir": "off"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mine = greedy_decode(step, case.token, case.position, steps)
    theirs = greedy_decode(ref.step, ref.token, ref.position, steps)
    return last_session(), mine, theirs, [str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)]


def _equal_to_eager(mine, theirs):
    (toks_c, logits_c), (toks_e, logits_e) = mine, theirs
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    for a, b in zip(logits_c, logits_e):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()


def _rope_ops(program: Program) -> set[str]:
    """The rewritten ops inside decoder layers (the rotations of q and k); the table is outside the layers."""
    G = program.graph
    return {n for n in G if G.nodes[n].get("complex_op") and G.nodes[n].get("layer") is not None}


def _table_ops(program: Program) -> set[str]:
    G = program.graph
    return {n for n in G if G.nodes[n].get("complex_op") and G.nodes[n].get("layer") is None}


@pytest.mark.parametrize("name", ["Llama4", "DeepseekV2"])
def test_family_captured_and_equal_to_eager(name):
    session, mine, theirs, warned = _decode(name, "eager")
    assert session.refusals == [] and not any("complex" in w for w in warned), warned
    program = session.program
    assert _complex_left(program) == [] and len(_rope_ops(program)) >= 4 * 11  # 2 layers x (q, k) products
    _equal_to_eager(mine, theirs)


@pytest.fixture(scope="module")
def nkisim_runs():
    """One nkisim decode of each model, shared by the tests below (each costs ~40 s of interpretation)."""
    return {}


def _nkisim(runs: dict, name: str):
    if name not in runs:
        runs[name] = _decode(name, "nkisim")
    return runs[name]


def _kernel_nodes(session) -> set[str]:
    rec = session.program.newest_execution()
    return set().union(*[set(p.lowered.kernel_nodes) for k, p in enumerate(rec.run.plans) if k in rec.run.active])


def test_complex_rope_llama_is_one_kernel(nkisim_runs):
    """llama-tiny with complex rope: one launch per step, every op covered, every rotation inside the kernel, the
    table on the host (``rope_tables_pairs`` and the table's own ops in the layers), tokens equal to eager."""
    session, mine, theirs, warned = _nkisim(nkisim_runs, "complex-llama")
    rec = session.program.newest_execution()
    assert warned == [] and rec.launches_per_call == 1 and list(rec.verification.values()) == ["passed"]
    report = report_for_session(session)
    assert report.coverage == 1.0
    assert report.to_dict()["pattern_counts"].get("fusegraph.rope_tables_pairs") == 1
    from fusegraph.matching.generic_ops import metadata_nodes

    rope = _rope_ops(session.program)
    assert len(rope) == 2 * 2 * 12 + 2  # 2 layers x (q, k) x 12, 2 unsqueezes
    # the rotations of q and k run in the kernel; the table's views and negated sin half inside the layers are
    # step metadata (GenericPiece.host), computed on the host with the table
    meta = metadata_nodes(session.program.graph)
    assert rope - meta and rope - meta <= _kernel_nodes(session)
    assert not (rope & meta & _kernel_nodes(session))
    assert not (_table_ops(session.program) & _kernel_nodes(session))
    _equal_to_eager(mine, theirs)


@pytest.mark.parametrize("name", ["Llama4", "DeepseekV2"])
def test_family_rope_is_in_the_decoder_region(nkisim_runs, name):
    """The rewritten rope ops are in the decoder region (the table is the host-side ``rope_tables_pairs``), and the
    step equals eager whatever ran where."""
    session, mine, theirs, _ = _nkisim(nkisim_runs, name)
    analysis = session.program.newest_execution().run.analysis
    (decoder,) = [r for r in analysis.regions if r.kind == "decoder_stack"]
    assert _rope_ops(session.program) <= set(decoder.nodes)
    assert [m.pattern.name for m in analysis.matches if _table_ops(session.program) & set(m.nodes)] == \
        ["fusegraph.rope_tables_pairs"]
    _equal_to_eager(mine, theirs)


@pytest.mark.parametrize("name", ["Llama4", "DeepseekV2"])
def test_family_is_one_kernel(nkisim_runs, name):
    session, _, _, _ = _nkisim(nkisim_runs, name)
    """One launch per step, and every rotation of q/k in the kernel; the table's own ops inside the layers (views of
    the pairs table, the sin half negated: step metadata, ``GenericPiece.host``) are computed on the host with the
    table."""
    from fusegraph.matching.generic_ops import metadata_nodes

    rec = session.program.newest_execution()
    meta = metadata_nodes(session.program.graph)
    rotation = {n for n in _rope_ops(session.program) if n not in meta}
    assert rec.launches_per_call == 1 and rotation and rotation <= _kernel_nodes(session)
    assert not (_rope_ops(session.program) & meta & _kernel_nodes(session))
