"""MoE experts over a batch, grouped by expert: an expert several tokens chose is read from HBM once per step, an
expert no token chose is not read at all (its slot's guarded DMAs are skipped at run time), and the result equals
the reference VM. Counted in the interpreter's profile (HBM bytes read per kernel argument) against the per-token
path, which reads each (token, choice) pair's expert separately."""
import pytest
import torch

from fusegraph import nkisim
from fusegraph.codegen import ir
from fusegraph.codegen.testing import Builder, V

H, E, I, K = 256, 8, 64, 2
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _run(x, router, gu, dn, **gen_kw):
    """Router + experts kernel over the rows of ``x``: (kernel output, reference VM output, HBM bytes read per
    argument)."""
    T, dtype = x.shape[0], x.dtype
    b = Builder(T)
    xv = b.act("x", x)
    wts = b.new("rw", K, dtype, V.ROUTING)
    ids = ir.Value("ri", V.ROUTING, (T, K), torch.int32)
    b.ins.append(ir.Router(x=xv, weight=b.hbm("w_router", router), weights=wts, indices=ids, top_k=K,
                           normalize=True, layer=0))
    y = b.new("y", H, dtype)
    b.ins.append(ir.Experts(x=xv, weights=wts, indices=ids, gate_up=b.hbm("w_gu", gu), down=b.hbm("w_dn", dn),
                            out=y, intermediate=I, layer=0))
    b.store(y)
    gen, res, ref, _ = b.run(**gen_kw)
    reads = {k: t.read_bytes for k, t in nkisim.last_profile().hbm_by_tensor.items()}
    return gen, res["out_y"], ref["y"], reads


def _case(dtype, choices):
    """Inputs whose router picks exactly ``choices[t]`` (first, second) for token t: the router weight is the
    identity on the first E features and token t carries +3 / +2 there."""
    torch.manual_seed(0)
    T = len(choices)
    x = torch.randn(T, H) * 0.05
    for t, (a, b) in enumerate(choices):
        x[t, a] += 3.0
        x[t, b] += 2.0
    router = torch.zeros(E, H)
    router[torch.arange(E), torch.arange(E)] = 1.0
    gu = torch.randn(E, 2 * I, H) / 16
    dn = torch.randn(E, H, I) / 8
    chosen = sorted({e for c in choices for e in c})
    for e in set(range(E)) - set(chosen):  # nobody chose these: reading and using them would poison the output
        gu[e] = float("nan")
        dn[e] = float("nan")
    return x.to(dtype), router.to(dtype), gu.to(dtype), dn.to(dtype), chosen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lnc", [1, 2])
def test_expert_chosen_by_several_tokens_is_read_once(dtype, lnc):
    choices = [(1, 5), (1, 5), (5, 3)]  # experts 1 and 5 chosen twice each, 3 once; 0, 2, 4, 6, 7 by nobody
    x, router, gu, dn, chosen = _case(dtype, choices)
    gen, got, exp, reads = _run(x, router, gu, dn, lnc=lnc)
    assert "grouped by expert" in gen.source and "nl.dynamic_range" in gen.source
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), exp.float(), **TOL[dtype])
    per_expert_gu, per_expert_dn = gu[0].numel() * gu.element_size(), dn[0].numel() * dn.element_size()
    # grouped: each chosen expert exactly once, the five experts nobody chose never
    assert reads["w_gu"] == len(chosen) * per_expert_gu
    assert reads["w_dn"] == len(chosen) * per_expert_dn

    # the per-token path (one token per kernel) reads an expert for every (token, choice): 6 experts, not 3
    per_token = 0
    for t in range(len(choices)):
        _, got_t, exp_t, reads_t = _run(x[t:t + 1], router, gu, dn, lnc=lnc)
        torch.testing.assert_close(got_t.float(), exp_t.float(), **TOL[dtype])
        per_token += reads_t["w_gu"]
    assert per_token == len(choices) * K * per_expert_gu
    assert reads["w_gu"] * 2 == per_token


def test_every_token_choosing_the_same_experts_reads_two():
    """Eight tokens, all on experts 2 and 6: two experts' weights per step (the per-token path: sixteen)."""
    x, router, gu, dn, chosen = _case(torch.float32, [(2, 6)] * 8)
    gen, got, exp, reads = _run(x, router, gu, dn)
    torch.testing.assert_close(got, exp, **TOL[torch.float32])
    assert reads["w_gu"] == 2 * gu[0].numel() * 4 and reads["w_dn"] == 2 * dn[0].numel() * 4
