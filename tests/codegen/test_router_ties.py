"""MoE routers with tied probabilities: the kernel must choose k distinct experts like torch.topk.

``max8`` returns a value that occurs twice twice, and ``nc_find_index8`` gives both copies the index of the first
occurrence, so a plain max8 + find_index8 router chooses one expert twice. The router template knocks out each
found value with ``nc_match_replace8`` instead (distinct experts, equal values lowest index first), and flags a tie
at the top-k boundary, where torch.topk's choice between the tied experts is implementation-defined: the executor
recomputes such a step eagerly.
"""
import pytest
import torch

from fusegraph.codegen import ir
from fusegraph.models import build_decode, greedy_decode

from .harness import Builder, V

DTYPES = [torch.float32, torch.bfloat16]


def _router_program(E: int, K: int, H: int, logits: torch.Tensor, dtype: torch.dtype, T: int):
    """Router + experts over x = e_0, so the router logits are exactly column 0 of the router weight."""
    torch.manual_seed(0)
    b = Builder(T)
    x = torch.zeros(T, H)
    x[:, 0] = 1.0
    xv = b.act("x", x.to(dtype))
    w = torch.zeros(E, H)
    w[:, 0] = logits
    wts = b.new("rw", K, dtype, V.ROUTING)
    ids = ir.Value("ri", V.ROUTING, (T, K), torch.int32)
    tie = ir.Value("tie", V.ROUTING, (T, 1), torch.float32)
    b.ins.append(ir.Router(x=xv, weight=b.hbm("w_router", w.to(dtype)), weights=wts, indices=ids, top_k=K,
                           normalize=True, tie=tie, tie_first=True, layer=0))
    y = b.new("y", H, dtype)
    # experts that differ a lot, so choosing a wrong (or a repeated) expert changes y far beyond rounding
    gu = b.hbm("w_gu", (torch.randn(E, 2 * 64, H) / 4).to(dtype))
    dn = b.hbm("w_dn", (torch.randn(E, H, 64) / 4).to(dtype))
    b.ins.append(ir.Experts(x=xv, weights=wts, indices=ids, gate_up=gu, down=dn, out=y, intermediate=64, layer=0))
    b.store(y)
    flag = ir.Value("out_tie", V.OUTPUT, (T, 1), torch.float32)
    b.ins.append(ir.Guard(x=tie, dst=flag, reason="test"))
    b.outputs.append(flag)
    return b


def _tied_logits(E: int, rank: int) -> torch.Tensor:
    """Distinct logits except that the experts at sorted ranks ``rank`` and ``rank + 1`` are equal; the tied pair
    is placed at scattered expert indices so index order differs from rank order."""
    values = (E - torch.arange(E, dtype=torch.float32)) / 16  # distinct, exact in bf16
    values[rank + 1] = values[rank]
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(rank))
    out = torch.empty(E)
    out[perm] = values
    return out


def _expected(logits: torch.Tensor, K: int, dtype: torch.dtype) -> tuple[set, bool]:
    probs = torch.softmax(logits.to(dtype).float(), dim=-1)
    ranked, order = torch.sort(probs, descending=True, stable=True)
    return set(order[:K].tolist()), bool(ranked[K - 1] == ranked[K])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E,K", [(16, 4), (128, 8)])
def test_ties_at_every_rank_choose_distinct_experts(dtype, E, K):
    """A tied pair at ranks (r, r+1) for every r of the top-k, and straddling the boundary (r = k-1): the kernel's
    experts output equals the reference's (distinct experts, the torch.topk set when the pair is inside), and the
    tie flag is set exactly when the pair straddles the boundary. 128 experts top-8 is Qwen3-30B-A3B's router."""
    T = 2
    for rank in range(K):
        logits = _tied_logits(E, rank)
        b = _router_program(E, K, 128, logits, dtype, T)
        gen, res, ref, _ = b.run(chunk_bytes=4096)
        assert "nisa.nc_find_index8(" not in gen.source and "nisa.nc_match_replace8(" in gen.source
        chosen, boundary = _expected(logits, K, dtype)
        assert boundary == (rank == K - 1)
        if not boundary:  # the pair is inside the top-k: torch.topk's set is the same
            top = torch.topk(torch.softmax(logits.to(dtype).float(), -1), K).indices
            assert set(top.tolist()) == chosen
        got, want = res["out_y"].float(), ref["out_y"].float()
        scale = want.abs().max().item()
        tol = 1e-4 if dtype == torch.float32 else 2 ** -6
        assert (got - want).abs().max().item() <= tol * scale, f"rank {rank}: experts output differs"
        assert res["out_tie"].flatten().tolist() == [float(boundary)] * T, f"rank {rank}: tie flag"


def test_reference_without_distinct_experts_would_differ():
    """The test above can fail: choosing the first occurrence twice (what find_index8 does) changes the output."""
    E, K, T, dtype = 16, 4, 1, torch.float32
    logits = _tied_logits(E, 1)
    b = _router_program(E, K, 128, logits, dtype, T)
    _, res, _, _ = b.run(chunk_bytes=4096)
    probs = torch.softmax(logits, -1)
    top = torch.sort(probs, descending=True, stable=True)
    first = [int((probs == v).nonzero()[0]) for v in top.values[:K]]  # find_index8's answer
    assert len(set(first)) < K
    x = torch.zeros(1, 128)
    x[0, 0] = 1
    gu, dn = b.tensors["w_gu"], b.tensors["w_dn"]
    w = top.values[:K] / top.values[:K].sum()

    def expert(e):
        g, u = torch.nn.functional.linear(x, gu[e]).chunk(2, -1)
        return torch.nn.functional.linear(torch.nn.functional.silu(g) * u, dn[e])

    dup = sum(w[k] * expert(first[k]) for k in range(K))
    assert (dup - res["out_y"]).abs().max() > 1e-2 * res["out_y"].abs().max()


def test_qwen3_30b_router_shape_only_within_budget():
    """Qwen3-30B-A3B's router (hidden 2048, 128 experts, top-8, with the boundary check's second max8) builds and
    runs shape-only on trn2 within the SBUF budget."""
    from fusegraph import nkisim
    from fusegraph.nkisim.torch_io import InterpretedKernel
    from fusegraph.codegen.megakernel import generate

    E, K, H, T = 128, 8, 2048, 4
    b = _router_program(E, K, H, torch.zeros(E), torch.bfloat16, T)
    gen = generate(b.program(), target="trn2")
    assert gen.budget.sbuf_peak <= gen.budget.sbuf_budget
    kernel = InterpretedKernel(gen, target="trn2")
    kernel(kernel.prepare(b.tensors), shape_only=True)
    ops = [r.opcode for r in nkisim.last_profile().records if ".router." in r.name]  # the experts' grouping has its own
    assert ops.count("max8") == 2 and "nc_match_replace8" in ops and "nc_find_index8" not in ops


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tied_router_rows_in_a_model_match_eager(dtype):
    """Qwen3-MoE tiny with two router rows equal in every layer (so two experts tie on every token, inside the
    top-2, at its boundary or below it): greedy tokens, logits and KV caches equal eager over 16 steps."""
    case = build_decode("qwen3-moe-tiny", dtype=dtype)
    with torch.no_grad():
        for layer in case.model.model.layers:
            w = layer.mlp.gate.weight
            w[3] = w[5]
            w[6] = w[1]
    ref = case.fork()
    step = torch.compile(case.step, backend="fusegraph", dynamic=False,
                         options={"executor": "nkisim", "cache_dir": "off"})
    toks_c, logits_c = greedy_decode(step, case.token, case.position, 16)
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, 16)
    from fusegraph.capture.session import last_session

    stats = last_session().program.newest_execution()
    assert stats.launches_per_call == 1 and list(stats.executed_by.values()) == ["nkisim"]
    assert all(torch.equal(a, b) for a, b in zip(toks_c, toks_e)), "greedy tokens differ"
    tol = 1e-4 if dtype == "float32" else 2 ** -5
    for a, b in zip(logits_c, logits_e):
        assert (a.float() - b.float()).abs().max().item() <= tol * b.float().abs().max().item()
    for a, b in zip(case.cache_tensors(), ref.cache_tensors()):
        assert (a.float() - b.float()).abs().max().item() <= tol * max(b.float().abs().max().item(), 1e-6)
    # some steps ran in the kernel (not all were recomputed)
    assert sum(stats.guard_reruns.values()) < 15
