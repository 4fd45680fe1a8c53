"""Canonicalization folds implementation noise, keeps every original node accounted for, and never mutates."""
import torch

from fusegraph import capture_step
from fusegraph.matching.canonicalize import VIEW, canonicalize

from fg_cases import EAGER, captured


def _capture(fn, *args):
    return capture_step(fn, *args, options=EAGER).program


def test_noise_is_folded():
    def f(x, w):
        y = x.clone().contiguous().to(torch.float32)  # no-ops on an fp32 tensor
        y = y.view(2, 8).reshape(16).unsqueeze(0)  # a private view chain
        y = y.expand(1, 16)  # identity expand
        return (y * w).sum(dim=1)

    prog = _capture(f, torch.randn(16), torch.randn(1, 16))
    cv = canonicalize(prog)
    ops = [cv.data.nodes[n]["op"] for n in cv.op_nodes]
    assert ops.count(VIEW) == 1, ops  # view -> view -> unsqueeze collapsed into one reshape
    assert "aten.clone.default" not in ops and "aten.expand.default" not in ops
    view = next(n for n in cv.op_nodes if cv.data.nodes[n]["op"] == VIEW)
    assert len(cv.covers[view]) >= 2  # it stands for the chain's original nodes
    # sum(dim=1) on a 2-d tensor is sum(dim=-1)
    s = next(n for n in cv.op_nodes if cv.data.nodes[n]["orig_op"] == "aten.sum.dim_IntList")
    assert cv.data.nodes[s]["consts"]["a1.0"] == -1
    # every original op node maps to the canonical node carrying its value
    for n, d in prog.graph.nodes(data=True):
        assert cv.rep[n] in cv.data


def test_program_is_not_mutated_and_still_runs():
    case, cap = captured("qwen3-tiny", "eager", "batched_mm", "float32")
    G = cap.program.graph
    before = (G.number_of_nodes(), G.number_of_edges(), {n: dict(d) for n, d in G.nodes(data=True)})
    canonicalize(cap.program)
    assert (G.number_of_nodes(), G.number_of_edges()) == before[:2]
    assert {n: dict(d) for n, d in G.nodes(data=True)}.keys() == before[2].keys()
    # the eager executor still runs the (untouched) program and matches eager PyTorch
    compiled = cap.extra["compiled"]
    ref = case.fork()
    with torch.no_grad():
        out = compiled(case.token, case.position + 1)
        exp = ref.step(ref.token, ref.position + 1)
    assert torch.equal(out, exp)


def test_commutative_operands_and_scalar_positions():
    prog_a = _capture(lambda x, y: (x * y) + 1.5, torch.randn(4), torch.randn(4))
    prog_b = _capture(lambda x, y: 1.5 + (y * x), torch.randn(4), torch.randn(4))
    a, b = canonicalize(prog_a), canonicalize(prog_b)
    sig = lambda cv: sorted((cv.data.nodes[n]["op"], cv.data.nodes[n]["positions"], tuple(sorted(cv.data.nodes[n]["consts"].items())))
                            for n in cv.op_nodes)
    assert sig(a) == sig(b)


def test_cat_with_empty_operands_folds_to_the_other_operand():
    """Partial-rotary RoPE code with the rotary dim equal to the head dim (Phi-3) concatenates the rotated part
    with an empty pass-through slice: that cat is the identity."""

    def f(x):
        rot, rest = x[..., :8], x[..., 8:]  # rest is empty
        return torch.cat((torch.relu(rot), rest), dim=-1) * 2

    prog = _capture(f, torch.randn(2, 8))
    cv = canonicalize(prog)
    ops = [cv.data.nodes[n]["orig_op"] for n in cv.op_nodes]
    assert "aten.cat.default" not in ops, ops
    mul = next(n for n in cv.op_nodes if cv.data.nodes[n]["orig_op"] == "aten.mul.Tensor")
    (src,) = [p for p, _ in cv.data_pred(mul)]
    assert cv.data.nodes[src]["orig_op"] == "aten.relu.default"

    def g(x, y):  # both operands non-empty: a real cat stays
        return torch.cat((x, y), dim=-1) * 2

    cv2 = canonicalize(_capture(g, torch.randn(2, 8), torch.randn(2, 3)))
    assert "aten.cat.default" in [cv2.data.nodes[n]["orig_op"] for n in cv2.op_nodes]
