"""The tensor path of generic lowering (fusegraph.codegen.tensor): ops no pattern covers and the SBUF elementwise
path cannot place -- reductions over any dim, activation x activation matmuls, convolutions, data movement,
constants, values of any shape -- run inside the one megakernel and equal eager.

Each model case replaces llama-tiny's MLP with a module made of such ops (the rest of the decoder keeps its
patterns, so the step is still one kernel around them) and checks, over several greedy steps: one launch per step,
every op of the model in the kernel, the first call verified against eager, tokens equal to eager, logits close.
"""
from __future__ import annotations

import random

import pytest
import torch

from fusegraph.capture.session import last_session
from fusegraph.codegen.tensor import EMITTERS, TensorOp
from fusegraph.codegen.tensor.lower import _AS_VIEW as AS_VIEW  # noqa: F401 - the table test reads it
from fusegraph.codegen.tensor import view as tv
from fusegraph.matching.tensor_ops import CATEGORY
from fusegraph.models import build_decode, greedy_decode
from fusegraph.report import report_for_session


# ---- the two tables agree ----------------------------------------------------------------------------------------
def test_every_op_matching_offers_has_an_emitter_and_back():
    computed = {op for op, cat in CATEGORY.items() if cat not in ("view", "const") and op not in AS_VIEW}
    assert computed - set(EMITTERS) == set(), "ops region formation offers to the tensor path without an emitter"
    assert set(EMITTERS) - set(CATEGORY) == set(), "emitters matching never offers (add them to tensor_ops)"


# ---- views are PyTorch's own stride arithmetic -------------------------------------------------------------------
def _as(ref: tv.TRef, base: torch.Tensor) -> torch.Tensor:
    return base.reshape(-1).as_strided(ref.shape, ref.strides, ref.offset)


@pytest.mark.parametrize("seed", range(6))
def test_views_address_the_elements_eager_views_do(seed):
    rng = random.Random(seed)
    shape = tuple(rng.choice([1, 2, 3, 4, 6]) for _ in range(rng.randint(2, 4)))
    base = torch.arange(torch.Size(shape).numel(), dtype=torch.float32)
    from fusegraph.codegen import ir
    v = ir.Value("b", ir.ValueKind.TENSOR, shape, torch.float32)
    ref, t = tv.whole(v), base.reshape(shape)
    for _ in range(6):
        kind = rng.choice(["transpose", "slice", "unsqueeze", "select", "expand", "reshape", "permute"])
        rank = len(ref.shape)
        if kind == "transpose" and rank >= 2:
            a, b = rng.sample(range(rank), 2)
            ref, t = tv.transpose(ref, a, b), t.transpose(a, b)
        elif kind == "permute":
            order = list(range(rank))
            rng.shuffle(order)
            ref, t = tv.permute(ref, order), t.permute(order)
        elif kind == "slice":
            d = rng.randrange(rank)
            n = t.shape[d]
            start, step = rng.randrange(n), rng.choice([1, 2])
            ref, t = tv.slice_(ref, d, start, n, step), t[(slice(None),) * d + (slice(start, n, step),)]
        elif kind == "unsqueeze":
            d = rng.randrange(rank + 1)
            ref, t = tv.unsqueeze(ref, d), t.unsqueeze(d)
        elif kind == "select" and rank >= 2:
            d = rng.randrange(rank)
            i = rng.randrange(t.shape[d])
            ref, t = tv.select(ref, d, i), t.select(d, i)
        elif kind == "expand":
            sizes = [3 if s == 1 else s for s in t.shape]
            ref, t = tv.expand(ref, sizes), t.expand(sizes)
        elif kind == "reshape":
            new = (-1,) if rng.random() < 0.5 else (t.shape[0], -1) if rank > 1 else (-1,)
            made = tv.reshape(ref, new)
            try:
                eager = t.view(new)
            except RuntimeError:
                assert made is None, "a view PyTorch refuses (it would copy) must not be made"
                continue
            assert made is not None, f"{t.shape} {t.stride()} -> {new} is a view in PyTorch"
            ref, t = made, eager
        assert tuple(ref.shape) == tuple(t.shape)
        assert torch.equal(_as(ref, base), t), kind


def test_a_reshape_that_needs_a_copy_is_refused():
    from fusegraph.codegen import ir
    v = ir.Value("b", ir.ValueKind.TENSOR, (4, 6), torch.float32)
    tr = tv.transpose(tv.whole(v), 0, 1)
    assert tv.reshape(tr, (24,)) is None
    assert tv.reshape(tr, (6, 2, 2)) is not None  # splitting the (contiguous) inner dim is a view


# ---- models ------------------------------------------------------------------------------------------------------
class SoftmaxOverHeads(torch.nn.Module):
    """Softmax over a middle dim, max and mean over other dims: reductions no pattern knows."""

    def forward(self, x):
        B, S, H = x.shape
        h = x.reshape(B, 4, H // 4)
        s = torch.softmax(h * 3.0, dim=1)
        m = h.amax(dim=-1, keepdim=True)
        mu = h.mean(dim=(0, 1), keepdim=True)
        return (s * m + mu).reshape(B, S, H)


class SelfMatmul(torch.nn.Module):
    """An activation times (the transpose of) itself: a batched matmul of two activations."""

    def forward(self, x):
        B, S, H = x.shape
        a = x.reshape(B, 16, H // 16)
        g = torch.bmm(a, a.transpose(1, 2)) * 0.05  # [B, 16, 16]
        return torch.bmm(g, a).reshape(B, S, H)


class Selects(torch.nn.Module):
    """Comparisons, where, masked_fill, a float->int->float round trip, a constant arange, a clamp."""

    def forward(self, x):
        B, S, H = x.shape
        y = torch.where(x > 0, x, 0.1 * x)
        y = y.masked_fill(x < -0.05, 0.0)
        q = (x * 40).to(torch.int32).to(x.dtype) / 40  # truncates toward zero, as eager does
        ramp = torch.arange(H, dtype=x.dtype) * 1e-3
        return y + q + ramp + torch.clamp(x, -0.01, 0.02)


class Moves(torch.nn.Module):
    """Concatenation of two halves swapped, a roll, a stack, padding: data movement."""

    def forward(self, x):
        B, S, H = x.shape
        swapped = torch.cat([x[..., H // 2:], x[..., : H // 2]], dim=-1)
        rolled = torch.roll(x, 3, dims=-1)
        st = torch.stack([x, swapped], dim=0).sum(0)
        padded = torch.nn.functional.pad(x[..., :-2], (1, 1), value=0.5)
        return swapped + rolled + st + padded


class ScalarParameter(torch.nn.Module):
    """A 0-d parameter (Gemma 3n's per-layer projection scale) scaling a bmm of the activation: a kernel argument
    of one element (NKI refuses 0-d arrays)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.37))

    def forward(self, x):
        B, S, H = x.shape
        a = x.reshape(B, 16, H // 16)
        return (torch.bmm(a, a.transpose(1, 2)).sum(-1, keepdim=True) * a * self.scale).reshape(B, S, H)


def _run(module_cls, steps=4):
    case = build_decode("llama-tiny")
    for layer in case.model.model.layers:
        layer.mlp = module_cls()
    ref = case.fork()
    step = torch.compile(case.step, backend="fusegraph", options={"executor": "nkisim", "cache_dir": "off"})
    toks_c, logits_c = greedy_decode(step, case.token, case.position, steps)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, steps)
    session = last_session()
    return session, (toks_c, logits_c), (toks_e, logits_e)


@pytest.mark.parametrize("module_cls", [SoftmaxOverHeads, SelfMatmul, Selects, Moves, ScalarParameter],
                         ids=lambda c: c.__name__)
def test_ops_of_any_shape_run_in_the_one_kernel(module_cls):
    session, (toks_c, logits_c), (toks_e, logits_e) = _run(module_cls)
    stats = session.program.newest_execution()
    assert stats.launches_per_call == 1
    assert list(stats.verification.values()) == ["passed"]
    assert report_for_session(session).coverage == 1.0
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    for a, b in zip(logits_c, logits_e):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()


def test_the_kernel_holds_tensor_ops():
    """The ops above are TensorOps in the kernel program (not computed on the host): the test can fail."""
    from fusegraph.api.kernel import build_for_target, capture_callable
    case = build_decode("llama-tiny")
    for layer in case.model.model.layers:
        layer.mlp = SelfMatmul()
    step = capture_callable("llama-tiny", case.step, (case.token, case.position), {},
                            options={"executor": "nkisim", "cache_dir": "off"})
    build = build_for_target(step, "trn2", profile=False)
    ops = [i.op for i in build.generated.program.instructions if isinstance(i, TensorOp)]
    assert ops.count("aten.bmm.default") == 2 * case.model.config.num_hidden_layers


# ---- runtime indices, selection, scans (issue 27): one op in a kernel, against eager ------------------------------
def _one_op(target, args: tuple, kwargs: dict | None = None, *, out_like=None):
    """``target(*args)`` as one TensorOp in a kernel program (tensor arguments are kernel inputs in the kernel's
    types: int64 -> int32; results copied into kernel outputs, as the lowering hands them over), run in the
    interpreter and the reference VM (whose op sees int64 indices again, as in the program). Returns (kernel
    outputs, the reference VM's outputs, the kernel's guard flag, the reference VM's guard flag); the flags are
    None for an op with no guard. ``out_like``: the results' shapes and types when eager raises."""
    from fusegraph.codegen import ir
    from fusegraph.codegen.io import Guard
    from fusegraph.codegen.tensor.instruction import GUARDS, kernel_dtype
    from fusegraph.codegen.testing import Builder, V

    kwargs = kwargs or {}
    b = Builder(1)

    def arg(a):
        if isinstance(a, torch.Tensor):
            return tv.whole(b.hbm(f"a{len(b.tensors)}", a.to(kernel_dtype(a.dtype)), V.INPUT))
        if isinstance(a, (list, tuple)):
            return type(a)(arg(x) for x in a)
        return a

    def logical(*a, **k):  # the reference: int32 kernel values back to the program's int64 / bool
        def up(x):
            if isinstance(x, torch.Tensor) and x.dtype == torch.int32:
                return x.long()
            return type(x)(up(y) for y in x) if isinstance(x, (list, tuple)) else x
        return target(*up(a), **k)
    targs = arg(args)
    results = out_like if out_like is not None else target(*args, **kwargs)
    results = tuple(results) if isinstance(results, (tuple, list)) else (results,)
    ns, base = target._schema.name.split("::")
    op = f"{ns}.{base}.{target._overloadname}"
    tmp = [ir.Value(f"t{k}", V.TENSOR, tuple(r.shape), r.dtype) for k, r in enumerate(results)]
    outs = [ir.Value(f"o{k}", V.OUTPUT, tuple(r.shape) or (1,), kernel_dtype(r.dtype)) for k, r in enumerate(results)]
    ins = TensorOp(op=op, args=targs, kwargs=dict(kwargs), outs=tuple(tv.whole(t) for t in tmp), target=logical,
                   fresh=(True,) * len(tmp))
    flag = None
    if op in GUARDS:
        flag = ir.Value("flag", V.ROUTING, (1, 1), torch.float32)
        ins.flag, ins.flag_first = flag, True
    b.ins.append(ins)
    for t, o in zip(tmp, outs):
        t = tv.TRef(t, o.shape, (1,), 0) if not t.shape else tv.whole(t)  # a 0-d result: one element
        b.ins.append(TensorOp(op="aten.copy.default", args=(tv.whole(o), t), kwargs={}, outs=(tv.whole(o),),
                              target=torch.ops.aten.copy.default, fresh=(False,)))
        b.outputs.append(o)
        b.tensors[o.name] = torch.zeros(o.shape, dtype=o.dtype)  # the reference VM's copy writes into it
    if flag is not None:
        b.outputs.append(ir.Value("out_flag", V.OUTPUT, (1, 1), torch.float32))
        b.ins.append(Guard(x=flag, dst=b.outputs[-1], reason="test"))
    _, got, env, _ = b.run()
    kflag = float(got["out_flag"].max()) if flag is not None else None
    rflag = float(env["out_flag"].max()) if flag is not None else None
    return [got[o.name] for o in outs], [env[o.name] for o in outs], kflag, rflag


def _same(got, want):
    """Exactly eager's values (indices compared as integers)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.numel() == w.numel()
        g = g.reshape(w.shape)  # a 0-d result leaves the kernel as one element
        if w.dtype.is_floating_point:
            assert torch.equal(g.to(w.dtype), w), (g, w)
        else:
            assert torch.equal(g.long(), w.long()), (g, w)


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


A = torch.ops.aten
X = torch.randn(8, 12, generator=_g(0))
INDEX_CASES = {
    "index_select_dim0_duplicates": (A.index_select.default, (X, 0, torch.tensor([3, 0, 3, 7]))),
    "index_select_dim1": (A.index_select.default, (X, 1, torch.tensor([11, 2, 5]))),
    "gather_dim1": (A.gather.default, (X, 1, torch.randint(0, 12, (8, 3), generator=_g(1)))),
    "gather_dim0": (A.gather.default, (X, 0, torch.randint(0, 8, (5, 12), generator=_g(2)))),
    "embedding": (A.embedding.default, (X, torch.tensor([[1, 7], [7, 0]]))),
    "index_two_tensors_negative": (A.index.Tensor, (X, [torch.tensor([[0], [5], [-1]]), torch.tensor([-12, 3, 11])])),
    "index_after_whole_dim": (A.index.Tensor, (X.reshape(2, 4, 12), [None, torch.tensor([3, -4]), None])),
    "index_apart_dims": (A.index.Tensor, (X.reshape(2, 4, 12), [torch.tensor([1, 0]), None, torch.tensor([5, 6])])),
    "index_put": (A.index_put.default, (X, [torch.tensor([6, -1]), torch.tensor([0, 2])], torch.tensor([9.0, -9.0]))),
    "index_copy": (A.index_copy.default, (X, 1, torch.tensor([10, 1]), torch.randn(8, 2, generator=_g(3)))),
    "index_fill_negative": (A.index_fill.int_Scalar, (X, 1, torch.tensor([-1, 4]), -2.5)),
    "scatter_src": (A.scatter.src, (X, 1, torch.tensor([[3, 1], [0, 11]]), torch.randn(2, 3, generator=_g(4)))),
    "scatter_value_dim0": (A.scatter.value, (X, 0, torch.tensor([[7, 0, 2]]), 4.0)),
    # duplicate indices add up in index order; an inf source stays in its slots (no 0 * inf = NaN elsewhere)
    "scatter_add_duplicates_inf": (A.scatter_add.default, (X[:4, :6], 1, torch.tensor([[0, 0, 5], [2, 2, 2], [1, 4, 1],
                                                                                       [5, 5, 0]]),
                                                           torch.tensor([[1.0, float("inf"), 2.0]] * 4))),
    "scatter_add_bf16_rounding": (A.scatter_add.default, (X[:2].bfloat16(), 1, torch.zeros(2, 9, dtype=torch.long),
                                                          torch.full((2, 9), 1.0 / 3).bfloat16())),
}


@pytest.mark.parametrize("case", INDEX_CASES, ids=str)
def test_index_ops_equal_eager_exactly(case):
    target, args = INDEX_CASES[case]
    got, ref, kflag, rflag = _one_op(target, args)
    want = target(*args)
    _same(got, [want])
    _same(ref, [want])
    assert kflag == rflag == 0.0


OOB_CASES = {
    "index_select_past_end": (A.index_select.default, (X, 0, torch.tensor([1, 8])), torch.zeros(2, 12)),
    "gather_negative": (A.gather.default, (X, 1, torch.tensor([[0], [-1]] * 4)), torch.zeros(8, 1)),
    "index_below_minus_size": (A.index.Tensor, (X, [torch.tensor([-9])]), torch.zeros(1, 12)),
    "embedding_past_end": (A.embedding.default, (X, torch.tensor([100])), torch.zeros(1, 12)),
    "scatter_past_end": (A.scatter.value, (X, 1, torch.tensor([[99]]), 1.0), X),
    "index_copy_negative": (A.index_copy.default, (X, 0, torch.tensor([-1]), X[:1]), X),
    "scatter_add_past_end": (A.scatter_add.default, (X, 1, torch.tensor([[12]]), X[:1, :1]), X),
}


@pytest.mark.parametrize("case", OOB_CASES, ids=str)
def test_an_index_out_of_range_raises_the_guard_and_reads_nothing_out_of_bounds(case):
    """Eager raises; the kernel runs to its end (the interpreter fails any DMA outside its tensor, oob_mode.error)
    and raises its guard flag, so the executor recomputes the step eagerly (and raises eager's error). The
    reference VM raises the same flag."""
    target, args, like = OOB_CASES[case]
    with pytest.raises((IndexError, RuntimeError)):
        target(*args)
    _, _, kflag, rflag = _one_op(target, args, out_like=like)
    assert kflag == rflag == 1.0


S = torch.randn(6, 20, generator=_g(5))
TIES = torch.tensor([[1.0, 5.0, 3.0, 5.0, 2.0, 5.0, 0.0, 1.0, 4.0, 4.0], [2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 0.0, 0.0, 3.0, 3.0]])
SELECT_CASES = {
    "topk_k3": (A.topk.default, (S, 3)),
    "topk_k10_smallest_two_rounds": (A.topk.default, (S, 10, -1, False)),
    "topk_dim0": (A.topk.default, (S, 2, 0)),
    "topk_short_row": (A.topk.default, (S[:, :5], 5)),
    "topk_bf16": (A.topk.default, (S.bfloat16(), 4)),
    "max_dim_ties_first": (A.max.dim, (TIES, 1)),
    "min_dim_keepdim_ties_first": (A.min.dim, (TIES, 1, True)),
    "argmax_ties_first": (A.argmax.default, (TIES, -1)),
    "argmin_dim0_ties_first": (A.argmin.default, (TIES.t().contiguous(), 0)),
    "argmax_all": (A.argmax.default, (torch.cat([TIES, TIES]),)),
    "sort_stable_ties_descending": (A.sort.stable, (TIES,), {"stable": True, "descending": True}),
    "sort_stable_ties_ascending": (A.sort.stable, (TIES,), {"stable": True, "dim": 1}),
    "sort_no_ties": (A.sort.default, (S, -1, True)),
}


@pytest.mark.parametrize("case", SELECT_CASES, ids=str)
def test_selection_equals_eager_exactly_ties_first_occurrence(case):
    """max/min/argmax/argmin pick the first occurrence of a tied extreme, a stable sort keeps equal values in
    order (both eager's documented behaviour, here with ties), top-k's order of distinct values: no guard."""
    target, args, *kw = SELECT_CASES[case]
    kwargs = kw[0] if kw else {}
    got, ref, kflag, rflag = _one_op(target, args, kwargs)
    want = target(*args, **kwargs)
    want = list(want) if isinstance(want, (tuple, list)) else [want]
    _same(got, want)
    _same(ref, want)
    assert kflag == rflag == 0.0


@pytest.mark.parametrize("case", ["topk_tie_inside", "topk_tie_at_boundary", "sort_unstable_ties", "argmax_nan"])
def test_ties_where_eager_orders_its_own_way_and_nan_raise_the_guard(case):
    """torch.topk's order of equal values is not by index (CPU partial sort: [5, 5, 5] at 1, 3, 5 comes out as
    1, 5, 3), so a top-k with ties among its k + 1 largest is recomputed eagerly; a tie below them is not."""
    x = TIES[:1]
    v, i = torch.topk(x, 3)
    assert i[0].tolist() != sorted(i[0].tolist()), "eager's top-k of tied values is not in index order (premise)"
    target, args = {
        "topk_tie_inside": (A.topk.default, (x, 2)),  # 5, 5
        "topk_tie_at_boundary": (A.topk.default, (torch.tensor([[3.0, 1.0, 2.0, 2.0]]), 2)),
        "sort_unstable_ties": (A.sort.default, (TIES,)),
        "argmax_nan": (A.argmax.default, (torch.tensor([[1.0, float("nan"), 2.0]]), 1)),
    }[case]
    _, _, kflag, rflag = _one_op(target, args)
    assert kflag == rflag == 1.0
    if case.startswith("topk"):  # a tie below the k + 1 largest: computed in the kernel
        _, _, kflag, rflag = _one_op(A.topk.default, (torch.tensor([[3.0, 1.0, 1.0, 2.0, 0.5]]), 1))
        assert kflag == rflag == 0.0


SCAN_CASES = {
    "cumsum_last": (A.cumsum.default, (S, -1)),
    "cumsum_dim0": (A.cumsum.default, (S, 0)),
    "cumsum_chunked": (A.cumsum.default, (torch.randn(3, 5000, generator=_g(6)), 1)),
    "cumsum_int_mask": (A.cumsum.default, ((S > 0).long(), 1)),
    "cumprod": (A.cumprod.default, (torch.sigmoid(S) + 0.5, 1)),
    "cumprod_bf16": (A.cumprod.default, ((torch.sigmoid(S) + 0.5).bfloat16(), 1)),
}


@pytest.mark.parametrize("case", SCAN_CASES, ids=str)
def test_scans_equal_eager(case):
    """fp32 accumulation (eager's fp32 scan accumulates in double: the last bits may differ), integers exact."""
    target, args = SCAN_CASES[case]
    got, ref, _, _ = _one_op(target, args)
    want = target(*args)
    g = got[0].to(want.dtype)
    if want.dtype.is_floating_point:
        tol = 1e-2 if want.dtype == torch.bfloat16 else 1e-5
        assert torch.allclose(g.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())
        assert torch.allclose(ref[0].float(), want.float())
    else:
        assert torch.equal(g, want)


def _grouped_mm_fallback():
    import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.grouped_mm_fallback)

    return torch.ops.transformers.grouped_mm_fallback.default


IDS = torch.tensor([0.0, 3.0, 3.0, 1.0, 3.0, 0.0, 2.0, 3.0])
GROUPED_CASES = {
    # 6 rows in groups of 2, 0, 3, 1 (an empty group); K = 200: two K tiles, one partial
    "grouped_mm_groups": (lambda: (_grouped_mm_fallback(), (torch.randn(6, 200, generator=_g(7)),
                                                          torch.randn(4, 200, 40, generator=_g(8)),
                                                          torch.tensor([2, 2, 5, 6], dtype=torch.int32)))),
    # rows 4 and 5 past the last offset: zero, as the fallback op leaves them; N = 600: two N tiles
    "grouped_mm_rows_past_the_end": (lambda: (_grouped_mm_fallback(), (torch.randn(6, 64, generator=_g(9)),
                                                                     torch.randn(3, 64, 600, generator=_g(10)),
                                                                     torch.tensor([1, 4, 4], dtype=torch.int32)))),
    "histc_expert_ids": (lambda: (A.histc.default, (IDS, 4, 0, 3))),
    "histc_out_of_range_and_max": (lambda: (A.histc.default, (torch.tensor([-1.0, 0.0, 0.49, 0.5, 2.0, 2.5, 9.0]),
                                                              5, 0.0, 2.5))),
    "histc_bins_over_128": (lambda: (A.histc.default, (torch.arange(300.0).remainder(150), 150, 0, 149))),
    "floor_divide_by_3": (lambda: (A.floor_divide.default, (torch.arange(-10, 11), 3))),
    "floor_divide_by_minus_4": (lambda: (A.floor_divide.default, (torch.arange(-10, 11), -4))),
    "floor_divide_top_k": (lambda: (A.floor_divide.default, (torch.arange(64), 8))),
}


def test_log_sigmoid_forward_and_its_buffer():
    """F.logsigmoid (Inkling's router gate): both outputs, the second eager's CPU buffer exp(-|x|)."""
    x = torch.randn(5, 40, generator=_g(14)) * 8
    got, ref, _, _ = _one_op(A.log_sigmoid_forward.default, (x,))
    out, buf = A.log_sigmoid_forward.default(x)
    assert torch.allclose(got[0], out, atol=2e-6) and torch.allclose(got[1], buf, atol=1e-6)
    assert torch.equal(ref[0], out)


@pytest.mark.parametrize("dims,correction,keepdim", [([-1], 1, True), ([1, 2], 0, False), (None, 1, False)],
                         ids=["last_unbiased_keepdim", "two_dims_biased", "all"])
def test_var_correction(dims, correction, keepdim):
    """``x.var(dims, correction=c)`` (xLSTM's multi-head norm): the mean, then squared deviations, over inputs
    offset far from 0 (mean 50), where ``E[x^2] - E[x]^2`` would lose the variance to cancellation."""
    x = torch.randn(3, 4, 16, generator=_g(16)) + 50
    got, ref, _, _ = _one_op(A.var.correction, (x, dims), {"correction": correction, "keepdim": keepdim})
    want = A.var.correction(x, dims, correction=correction, keepdim=keepdim)
    assert got[0].numel() == want.numel()  # (a 0-d result comes back as one element)
    assert torch.allclose(got[0].reshape(want.shape), want, rtol=1e-4, atol=1e-6)
    assert torch.allclose(ref[0].reshape(want.shape), want)


@pytest.mark.parametrize("dims,keepdim", [([-1], True), ([0, 2], False), (None, False)],
                         ids=["last_keepdim", "two_dims", "all"])
def test_linalg_vector_norm(dims, keepdim):
    """The L2 norm (Inkling-2's q/k norms): squares summed in fp32 over the dims, then the square root; over a
    row longer than one tile too (3000 > 2048 elements per partition: chunks into one accumulator)."""
    for shape in ((3, 4, 16), (2, 3000)):
        x = torch.randn(*shape, generator=_g(17))
        d = dims if len(shape) == 3 else [-1]
        got, ref, _, _ = _one_op(A.linalg_vector_norm.default, (x, 2, d, keepdim))
        want = A.linalg_vector_norm.default(x, 2, d, keepdim)
        assert torch.allclose(got[0].reshape(want.shape), want, rtol=1e-5, atol=1e-6)
        assert torch.allclose(ref[0].reshape(want.shape), want)


@pytest.mark.parametrize("dims", [[-1], [0, 2], [1]], ids=["last", "two_dims", "middle"])
def test_flip(dims):
    """``flip`` (Inkling-2's short-convolution window): exact, over one dim or two."""
    x = torch.randn(6, 4, 3, generator=_g(18))
    got, ref, _, _ = _one_op(A.flip.default, (x, dims))
    want = A.flip.default(x, dims)
    assert torch.equal(got[0].reshape(want.shape), want) and torch.equal(ref[0].reshape(want.shape), want)


@pytest.mark.parametrize("target", [A.expm1.default, A.log1p.default], ids=["expm1", "log1p"])
def test_expm1_and_log1p(target):
    """expm1 (Apertus' xIELU activation) and log1p: exp(x) - 1 and log(1 + x) on the Scalar engine, within fp32's
    absolute rounding of the 1 (relative precision near 0 is eager's alone)."""
    x = torch.randn(5, 300, generator=_g(15)) * 3
    if target is A.log1p.default:
        x = x.abs() - 0.9  # > -1
    got, ref, _, _ = _one_op(target, (x,))
    want = target(x)
    assert torch.allclose(got[0], want, rtol=1e-5, atol=1e-6)
    assert torch.equal(ref[0], want)


@pytest.mark.parametrize("case", GROUPED_CASES, ids=str)
def test_grouped_moe_ops_equal_eager(case):
    """HF's grouped-MoE path (issue 27): each row against its own expert's weights (read by indirect DMA),
    tokens per expert, ``perm // top_k``. Matmuls within fp32 accumulation order; counts and quotients exact."""
    target, args = GROUPED_CASES[case]()
    got, ref, _, _ = _one_op(target, args)
    want = target(*args)
    if case.startswith("grouped_mm"):
        assert torch.allclose(got[0], want, rtol=1e-5, atol=1e-4), (got[0] - want).abs().max()
        assert torch.allclose(ref[0], want)
    else:
        _same(got, [want])
        _same(ref, [want])


@pytest.mark.parametrize("beta,alpha", [(1.0, 0.125), (0.5, 1.0), (2.0, -0.5), (0.0, 1.0)])
def test_baddbmm_with_alpha_and_beta(beta, alpha):
    """Bloom's ALiBi scores: ``baddbmm(alibi, q, k^T, beta=1, alpha=1/sqrt(d))``; beta=0 ignores the input (its
    inf too, as PyTorch does)."""
    bias = torch.randn(2, 3, 5, generator=_g(11))
    if beta == 0.0:
        bias[0, 0, 0] = float("inf")
    args = (bias, torch.randn(2, 3, 40, generator=_g(12)), torch.randn(2, 40, 5, generator=_g(13)))
    got, ref, _, _ = _one_op(A.baddbmm.default, args, {"beta": beta, "alpha": alpha})
    want = A.baddbmm.default(*args, beta=beta, alpha=alpha)
    assert torch.allclose(got[0], want, rtol=1e-5, atol=1e-5), (got[0] - want).abs().max()
    assert torch.allclose(ref[0], want)


def test_histc_of_integer_ids_counts_like_the_float_ids():
    """HF histograms int ids on accelerators (CPU PyTorch has no integer histc): the kernel and the reference VM
    count them as the float ids are counted, in the ids' type."""
    got, ref, _, _ = _one_op(A.histc.default, (IDS.int(), 4, 0, 3), out_like=torch.zeros(4, dtype=torch.int32))
    want = torch.histc(IDS, 4, 0, 3)
    assert torch.equal(got[0].float(), want) and torch.equal(ref[0].float(), want)


# ---- runtime indices, selection, scans in a decoder step (issue 27) ----------------------------------------------
E_ROUTER = 16


class Router(torch.nn.Module):
    """A router: top-k of a linear's logits, softmax over the top-k, the full softmax's probabilities gathered by
    the top-k ids, a scatter into a dense [T, E] tensor, a weight's rows selected by the ids."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(256, E_ROUTER, bias=False)
        self.rows = torch.nn.Parameter(torch.randn(E_ROUTER, 256, generator=_g(1)) * 0.1)

    def forward(self, x):
        B, S, H = x.shape
        logits = self.gate(x).reshape(B * S, E_ROUTER)
        v, ids = torch.topk(logits, 4, dim=-1)
        w = torch.softmax(v, dim=-1)
        probs = torch.softmax(logits, dim=-1).gather(1, ids)
        dense = torch.zeros(B * S, E_ROUTER, dtype=x.dtype).scatter(1, ids, w)
        rows = torch.index_select(self.rows, 0, ids.reshape(-1)).reshape(B * S, 4, H)
        y = (rows * (w + probs).unsqueeze(-1)).sum(1) + dense.sum(-1, keepdim=True) * 0.01 + dense[:, :1] * 0.1
        return y.reshape(B, S, H)


class ArgmaxTies(torch.nn.Module):
    """max.dim / min.dim / argmax / argmin over rows whose extremes occur twice (a row and its copy concatenated,
    coarsely quantized), and over a row longer than one tile: eager returns the first occurrence, and so must the
    kernel (no guard)."""

    def forward(self, x):
        B, S, H = x.shape
        h = x.reshape(B * S, 16, 16)
        q = (h * 8).to(torch.int32).to(x.dtype) / 8
        d = torch.cat([q, q], dim=-1)
        mx, imx = d.max(dim=-1)
        mn, imn = d.min(dim=-1, keepdim=True)
        am = torch.argmax(d, dim=-1)
        an = torch.argmin(d.transpose(1, 2), dim=1)
        far = torch.argmax(torch.cat([q.reshape(-1)] * 12))  # 3072 values: two chunks, the maximum in both
        pos = (imx + 3 * am + 5 * an + imn.squeeze(-1) + far).to(x.dtype)
        y = h + 0.01 * (mx + mn.squeeze(-1) + 0.01 * pos).unsqueeze(-1)
        return y.reshape(B, S, H)


class Scans(torch.nn.Module):
    """cumsum along the last and a middle dim, cumprod of bounded values, an integer cumsum of a mask."""

    def forward(self, x):
        B, S, H = x.shape
        h = x.reshape(B * S, 16, 16)
        a = torch.cumsum(h, dim=-1)
        b = torch.cumsum(h, dim=1)
        c = torch.cumprod(torch.sigmoid(h) + 0.5, dim=-1)
        n = (h > 0).to(torch.int64).cumsum(-1)
        return (0.1 * a + 0.1 * b + 0.01 * c + 0.001 * n.to(x.dtype)).reshape(B, S, H)


class AdvancedIndex(torch.nn.Module):
    """Advanced indexing: three index tensors broadcast together (one of runtime rows, one of negative columns
    counted from the end), and one index after a whole dim."""

    def forward(self, x):
        B, S, H = x.shape
        h = x.reshape(B * S, 16, 16)
        ids = torch.argmax(h[:, 0, :], dim=-1)
        rows = (torch.arange(4) * 3 + ids[:, None]).clamp(max=15)
        cols = torch.arange(4) - 4
        sel = h[torch.arange(B * S)[:, None], rows, cols]
        pick = h[:, :, rows[0]]
        y = h + 0.1 * sel.sum(-1)[:, None, None] + 0.1 * pick.mean(-1, keepdim=True)
        return y.reshape(B, S, H)


class Scatters(torch.nn.Module):
    """index_put, index_copy, index_fill, a scatter of a value, scatter_add with duplicate indices, gather along
    dim 0, by runtime indices."""

    def forward(self, x):
        B, S, H = x.shape
        h = x.reshape(B * S * 16, 16)
        ids = torch.argmax(h[:, :4], dim=-1)  # in 0..3: many duplicates
        a = h.index_put((ids[:2] + 8,), torch.full((2, 16), 0.5, dtype=x.dtype))
        b = torch.index_copy(h, 0, torch.arange(4) * 2, h[:4] * 2)
        c = torch.index_fill(h, 1, ids[:3], -1.0)
        d = torch.scatter(h, 1, ids[:, None], 2.0)
        e = torch.scatter_add(torch.zeros(B * S * 16, 4, dtype=x.dtype), 1, torch.stack([ids, ids, 3 - ids], 1),
                              h[:, :3])
        g = torch.gather(h, 0, ids[:, None].expand(-1, 16) + 4)
        y = 0.1 * (a + b + c + d + g) + 0.1 * e.sum(-1, keepdim=True)
        return y.reshape(B, S, H)


class Sorts(torch.nn.Module):
    """topk with k > 8 (two rounds of max8) of the smallest, a stable sort of rows with ties (a defined order:
    computed in the kernel, no guard)."""

    def forward(self, x):
        B, S, H = x.shape
        h = x.reshape(B * S * 16, 16)
        v, i = torch.topk(h, 10, dim=-1, largest=False)
        q = (h * 2).to(torch.int32).to(x.dtype) / 2
        sv, si = torch.sort(q, dim=-1, descending=True, stable=True)
        y = h + 0.01 * (v.sum(-1, keepdim=True) + i.to(x.dtype).sum(-1, keepdim=True) * 0.1
                        + (sv * si.to(x.dtype)).sum(-1, keepdim=True) * 0.1)
        return y.reshape(B, S, H)


@pytest.mark.parametrize("module_cls", [Router, ArgmaxTies, Scans, AdvancedIndex, Scatters, Sorts],
                         ids=lambda c: c.__name__)
def test_index_select_and_scan_ops_run_in_the_one_kernel(module_cls):
    session, (toks_c, logits_c), (toks_e, logits_e) = _run(module_cls, steps=3)
    stats = session.program.newest_execution()
    assert stats.launches_per_call == 1
    assert list(stats.verification.values()) == ["passed"]
    assert stats.guard_reruns == {}, "no step needed eager (no index out of range, no ties where eager's own)"
    assert report_for_session(session).coverage == 1.0
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    for a, b in zip(logits_c, logits_e):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()


class TopkTies(torch.nn.Module):
    """topk over coarsely quantized rows: ties among the k + 1 largest in every step."""

    def forward(self, x):
        B, S, H = x.shape
        h = x.reshape(B * S * 16, 16)
        v, i = torch.topk((h * 2).to(torch.int32).to(x.dtype) / 2, 3, dim=-1)
        return (h + 0.01 * (v.sum(-1, keepdim=True) + i.to(x.dtype).sum(-1, keepdim=True))).reshape(B, S, H)


def test_topk_ties_recompute_the_step_eagerly():
    """Eager's order of tied values is its own: every step with ties is recomputed eagerly (the guard), so the
    tokens and logits are eager's exactly."""
    session, (toks_c, logits_c), (toks_e, logits_e) = _run(TopkTies, steps=2)
    stats = session.program.newest_execution()
    assert stats.launches_per_call == 1
    assert sum(stats.guard_reruns.values()) == 2
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    assert all(torch.equal(a, b) for a, b in zip(logits_c, logits_e))


class OutOfRange(torch.nn.Module):
    """index_select by a runtime index (argmax over 16 values, plus 3) into 16 rows: out of range on the steps
    where the argmax is 13 or more (the fourth step of llama-tiny's greedy decode), where eager raises."""

    def __init__(self):
        super().__init__()
        self.rows = torch.nn.Parameter(torch.randn(16, 256, generator=_g(3)) * 0.1)

    def forward(self, x):
        B, S, H = x.shape
        i = torch.argmax(x.reshape(B * S, H)[:, :16], dim=-1) + 3
        return x * 0.5 + 1e-3 * torch.index_select(self.rows, 0, i).reshape(B, S, H)


def _until_error(step, token, position, n):
    out = []
    with torch.no_grad():
        for _ in range(n):
            try:
                logits = step(token, position)
            except IndexError as e:
                return out, e
            out.append(logits.clone())
            token, position = logits[:, -1].argmax(-1, keepdim=True), position + 1
    return out, None


def test_an_index_out_of_range_in_a_step_raises_eagers_error():
    """The kernel computes the steps in range; the step out of range raises the guard (the kernel reads nothing
    out of bounds: no failed call) and is recomputed eagerly, which raises eager's IndexError."""
    case = build_decode("llama-tiny")
    for layer in case.model.model.layers:
        layer.mlp = OutOfRange()
    ref = case.fork()
    eager, eager_err = _until_error(ref.step, ref.token, ref.position, 6)
    assert eager_err is not None and len(eager) >= 2, "the premise: eager raises after a few steps in range"
    step = torch.compile(case.step, backend="fusegraph", options={"executor": "nkisim", "cache_dir": "off"})
    got, err = _until_error(step, case.token, case.position, 6)
    assert type(err) is type(eager_err) and str(err) == str(eager_err)
    assert len(got) == len(eager) and all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(got, eager))
    stats = last_session().program.newest_execution()
    assert stats.launches_per_call == 1 and list(stats.verification.values()) == ["passed"]
    assert sum(stats.guard_reruns.values()) == 1
    assert all(r.failed_calls == 0 for r in stats.regions)


class SlotState(torch.nn.Module):
    """A non-KV state written at a runtime row every step (an SSM-like state per slot): ``state[slot] = ...``
    (index_put_ into a buffer: a state input written in place), then read back."""

    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.zeros(4, 256))

    def forward(self, x):
        B, S, H = x.shape
        slot = torch.argmax(x.reshape(B * S, H)[:, :4], dim=-1)
        self.state[slot] = x.reshape(B * S, H) * 0.5 + self.state.index_select(0, slot)
        return x + 0.1 * self.state.mean(0).reshape(1, 1, H)


def test_a_state_written_at_runtime_rows_in_place():
    """The write is an in-place TensorOp into the state input (not a copy of the whole state), and after several
    steps the state and the tokens equal eager's (an eager model of its own: buffers are shared by fork)."""
    case, ref = build_decode("llama-tiny"), build_decode("llama-tiny")
    for c in (case, ref):
        for layer in c.model.model.layers:
            layer.mlp = SlotState()
    step = torch.compile(case.step, backend="fusegraph", options={"executor": "nkisim", "cache_dir": "off"})
    toks_c, logits_c = greedy_decode(step, case.token, case.position, 3)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, 3)
    stats = last_session().program.newest_execution()
    assert stats.launches_per_call == 1 and list(stats.verification.values()) == ["passed"]
    assert report_for_session(last_session()).coverage == 1.0
    ops = [i.op for p in stats.run.plans for i in p.lowered.program.instructions if isinstance(i, TensorOp)]
    assert ops.count("aten.index_put_.default") == 2
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e))
    for lc, le in zip(case.model.model.layers, ref.model.model.layers):
        assert torch.allclose(lc.mlp.state, le.mlp.state, rtol=1e-5, atol=1e-5)
        assert lc.mlp.state.abs().sum() > 0


LONG = torch.randn(3, 5000, generator=_g(7))
LONG[:, 4321] = 9.0
LONG[:, 2500] = 9.0  # the same maximum in two chunks (of 2048): the first occurrence is in the second chunk
LONG_CASES = {
    "argmax_long_row_ties_across_chunks": (A.argmax.default, (LONG, 1)),
    "max_dim_long_row": (A.max.dim, (LONG, -1)),
    "argmin_long_row": (A.argmin.default, (LONG, 1)),
    "topk_long_row": (A.topk.default, (torch.randn(3, 4099, generator=_g(8)), 5)),
    "topk_long_row_k12_smallest": (A.topk.default, (LONG, 12, 1, False)),
    "argmax_int": (A.argmax.default, (torch.tensor([[3, 9, 9, -2], [0, 0, -5, 0]]), 1)),
    "topk_int": (A.topk.default, (torch.tensor([[3, 9, 7, -2, 11, 0, 1, 2, 8]]), 3)),
}


@pytest.mark.parametrize("case", LONG_CASES, ids=str)
def test_selection_over_rows_longer_than_a_tile_and_integers(case):
    """A row of 5000 values is three chunks whose top values are candidates; argmax's first occurrence holds
    across chunks. Integer values below 2^24 compare exactly in fp32."""
    target, args = LONG_CASES[case]
    got, ref, kflag, rflag = _one_op(target, args)
    want = target(*args)
    want = list(want) if isinstance(want, (tuple, list)) else [want]
    _same(got, want)
    _same(ref, want)
    assert kflag == rflag == 0.0


def test_integers_beyond_fp32_and_pads_in_long_rows_raise_the_guard():
    big = torch.tensor([[1 << 24, (1 << 24) + 1, 3]])
    assert _one_op(A.argmax.default, (big, 1))[2:] == (1.0, 1.0)
    allneg = torch.full((2, 3000), float("-inf"))  # every candidate at or below -FLT_MAX: a chunk's pad could win
    assert _one_op(A.max.dim, (allneg, 1))[2:] == (1.0, 1.0)


@pytest.mark.parametrize("rows", [[2, 0], [1, 7]], ids=["in_range", "one_out_of_range"])
def test_index_copy_in_place_into_state(rows):
    """``state.index_copy_(0, rows, src)`` written in place into a state input (what the lowering makes of a
    state written at runtime rows): the rows in range are written, a row out of range is dropped (never written
    at a clamped row: the executor then restores the state and recomputes the step eagerly) and raises the flag."""
    from fusegraph.codegen import ir
    from fusegraph.codegen.io import Guard
    from fusegraph.codegen.testing import Builder, V

    state0 = torch.randn(4, 6, generator=_g(9))
    src = torch.randn(2, 6, generator=_g(10))
    b = Builder(1)
    st = b.hbm("state", state0.clone(), V.STATE)
    idx = b.hbm("rows", torch.tensor(rows, dtype=torch.int32), V.INPUT)
    sv = b.hbm("src", src, V.INPUT)
    flag = ir.Value("flag", V.ROUTING, (1, 1), torch.float32)
    ins = TensorOp(op="aten.index_copy_.default", args=(tv.whole(st), 0, tv.whole(idx), tv.whole(sv)), kwargs={},
                   outs=(tv.whole(st),), target=lambda s, d, i, v: s.index_copy_(d, i.long(), v), fresh=(False,),
                   flag=flag, flag_first=True)
    b.ins.append(ins)
    b.outputs.append(ir.Value("out_flag", V.OUTPUT, (1, 1), torch.float32))
    b.ins.append(Guard(x=flag, dst=b.outputs[-1], reason="test"))
    _, got, env, _ = b.run()
    want = state0.clone()
    ok = [(r, k) for k, r in enumerate(rows) if 0 <= r < 4]
    for r, k in ok:
        want[r] = src[k]
    assert torch.equal(got["state"], want)
    assert float(got["out_flag"].max()) == float(env["out_flag"].max()) == float(len(ok) < len(rows))
