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


@pytest.mark.parametrize("module_cls", [SoftmaxOverHeads, SelfMatmul, Selects, Moves], ids=lambda c: c.__name__)
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
