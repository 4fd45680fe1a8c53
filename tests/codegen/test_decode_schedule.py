"""Where the decode kernel's time goes (issue 14 item 4): the schedule changes that cut the TP rank's critical path.

* a hidden-state norm of one token sums each partition's chunks first and needs ONE ones-matmul, not one per chunk;
* norm weights stream through their own small ring, so they do not take the big ring's slots;
* with prefetch points (after an all-reduce) static weights are issued there, not in front of the next loads;
* each layer computes what its KV writes need first (``codegen/schedule.py: kv_first``);
* small LNC=2 exchanges go on the GpSimd DMA path.

The modeled effect is measured by ``benchmarks/bench_tp.py`` / ``bench_calibration.py``, not asserted here.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from fusegraph.codegen import ir
from fusegraph.codegen.schedule import kv_first
from fusegraph.codegen.stream import Chunk, ChunkUse, CriticalEnd, PrefetchPoint, resolve
from fusegraph.nkiapi.conformance import check_source

from .harness import Builder

V = ir.ValueKind


# ---- the norm --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,dtype", [(1, torch.float32), (1, torch.bfloat16), (3, torch.bfloat16)])
def test_hidden_norm_sums_with_one_matmul_per_step(T, dtype):
    torch.manual_seed(0)
    b = Builder(T)
    xt = torch.randn(T, 2048).to(dtype)
    wt = (1 + 0.1 * torch.randn(2048)).to(dtype)
    y = b.new("y", 2048, dtype)
    b.ins.append(ir.RMSNorm(x=b.act("x", xt), weight=b.hbm("w_norm", wt), out=y, eps=1e-6, group=2048, layer=0))
    b.store(y)
    gen, res, ref, _ = b.run()
    assert check_source(gen.source) == []
    sums = re.findall(r"nisa\.nc_matmul\([^\n]*name=\"[^\"]*\.sum\"", gen.source)
    loops = re.findall(r"for ft in range\(16\):\n\s+nisa\.nc_matmul", gen.source)
    if T == 1:
        assert len(sums) == 1 and not loops  # one matmul over partitions after the free-axis reduce
        assert "reduce_res=" in gen.source
    else:
        assert loops  # several tokens keep the per-chunk accumulation (a free-axis reduce would mix tokens)
    torch.testing.assert_close(res["out_y"], ref["y"], atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-2)
    x = xt.float()
    eager = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype) * wt
    if dtype == torch.bfloat16:
        assert (res["out_y"] != eager).float().mean() < 0.002  # differs from eager only in rare rounding ties
    else:
        torch.testing.assert_close(res["out_y"], eager, atol=1e-6, rtol=1e-6)  # fp32: a different summation order


def test_layernorm_mean_of_one_token_is_one_matmul():
    torch.manual_seed(1)
    b = Builder(1)
    xt = torch.randn(1, 1024)
    y = b.new("y", 1024, torch.float32)
    b.ins.append(ir.RMSNorm(x=b.act("x", xt), weight=b.hbm("w_ln", torch.ones(1024)), out=y, eps=1e-5, group=1024,
                            layer=0, center=True, bias=b.hbm("b_ln", torch.zeros(1024))))
    b.store(y)
    gen, res, ref, _ = b.run()
    assert len(re.findall(r"name=\"[^\"]*\.msum\"", gen.source)) == 1
    torch.testing.assert_close(res["out_y"], torch.nn.functional.layer_norm(xt, (1024,), eps=1e-5),
                               atol=1e-5, rtol=1e-5)


# ---- weight streaming ------------------------------------------------------------------------------------------
def _chunk(name: str, per_partition: int) -> Chunk:
    return Chunk(shape=(128, per_partition // 2), dtype="nl.bfloat16", src=f"hbm_{name}", name=name, earliest=0,
                 nbytes_per_partition=per_partition)


def _dma_order(code: str) -> list[str]:
    """Names of the DMAs and of the marker lines ``# <tag>``, in program order."""
    return re.findall(r'nisa\.dma_copy\([^\n]*name="([^"]+)"\)|^# (\w+)$', code, flags=re.M)


def _order(code: str) -> list[str]:
    return [a or b for a, b in _dma_order(code)]


def test_norm_weights_do_not_take_slots_of_the_big_ring():
    """norm, proj, norm, proj, norm, proj with a ring of 2: the third projection's chunk is issued before the second
    projection computes (one big chunk ahead), which a shared ring (norm, proj in its two slots) would not allow."""
    pieces: list = []
    for k in range(3):
        pieces += [ChunkUse(_chunk(f"n{k}", 32), 2 * k), f"# norm{k}\n", ChunkUse(_chunk(f"p{k}", 16384), 2 * k + 1),
                   f"# proj{k}\n"]
    code, stats = resolve(pieces, ring=2)
    order = _order(code)
    assert order.index("p2") < order.index("proj1")
    assert re.search(r"nbuf\d+ = nl\.ndarray[^\n]*name=\"n0\"", code)  # the small ring's buffers
    assert re.search(r"wbuf\d+ = nl\.ndarray[^\n]*name=\"p0\"", code)
    assert stats["ring_bytes_per_partition"] == 2 * 16384 + 3 * 32


def test_prefetch_points_take_static_weights_out_of_the_critical_loads():
    """Without prefetch points the next projections' weights are issued as soon as the ring allows, i.e. in front of
    the KV write; with them, the static chunks used after a critical instruction (attention, experts) are issued
    after its loads (at its end), and a prefetch point (after the all-reduce) issues as far ahead as the ring
    allows."""
    def pieces(point: bool) -> list:
        p = [ChunkUse(_chunk("q", 16384), 0), "# qproj\n", '    nisa.dma_copy(dst=c, src=k, name="kv_write")\n',
             "# attention\n", CriticalEnd(2), ChunkUse(_chunk("o", 16384), 3), "# oproj\n", "# allreduce\n"]
        if point:
            p.append(PrefetchPoint(4))
        return p + ["# norm\n", ChunkUse(_chunk("router", 4096), 5), "# router\n", "# experts\n", CriticalEnd(6),
                    ChunkUse(_chunk("q2", 16384), 7), "# qproj2\n", ChunkUse(_chunk("o2", 16384), 8), "# oproj2\n"]

    eager = _order(resolve(pieces(False), ring=4, indent=4)[0])
    assert eager.index("o") < eager.index("kv_write") and eager.index("router") < eager.index("kv_write")
    deferred = _order(resolve(pieces(True), ring=4, indent=4)[0])
    assert deferred.index("kv_write") < deferred.index("o") < deferred.index("oproj")  # at the attention's end
    assert deferred.index("router") < deferred.index("oproj")  # used before the next critical end: same place
    assert deferred.index("allreduce") < deferred.index("q2") < deferred.index("norm")  # at the prefetch point
    assert deferred.index("allreduce") < deferred.index("o2") < deferred.index("norm")  # as far as the ring allows


# ---- KV writes first -------------------------------------------------------------------------------------------
@dataclass
class _Op(ir.Instruction):
    opcode: ClassVar[str] = "op"
    x: ir.Value
    out: ir.Value


@dataclass
class _Write(ir.Instruction):
    opcode: ClassVar[str] = "kv_write"
    cache: ir.Value
    x: ir.Value
    output_fields: ClassVar[tuple[str, ...]] = ()


@dataclass
class _Collective(_Op):
    opcode: ClassVar[str] = "all_reduce"


def _act(name: str) -> ir.Value:
    return ir.Value(name, V.ACT, (1, 128), torch.float32)


def _layer(cache: ir.Value) -> tuple[list[ir.Instruction], dict[str, ir.Instruction]]:
    h, n, q, k, kr, a = (_act(s) for s in ("h", "n", "q", "k", "kr", "a"))
    ins = {"norm": _Op(x=h, out=n, layer=0), "q": _Op(x=n, out=q, layer=0), "k": _Op(x=n, out=k, layer=0),
           "rope": _Op(x=k, out=kr, layer=0), "write": _Write(cache=cache, x=kr, layer=0),
           "attn": _Op(x=q, out=a, layer=0)}
    return list(ins.values()), ins


def test_kv_first_moves_the_write_cone_ahead_of_the_query():
    cache = ir.Value("cache", V.STATE, (1, 1, 64, 128), torch.float32)
    run, ins = _layer(cache)
    top = _Op(x=_act("e"), out=_act("h0"))  # outside the layers: untouched
    got = kv_first([top, *run])
    assert [g for g in got] == [top, ins["norm"], ins["k"], ins["rope"], ins["write"], ins["q"], ins["attn"]]


def test_kv_first_keeps_a_layer_whose_move_would_cross_the_cache_or_a_collective():
    cache = ir.Value("cache", V.STATE, (1, 1, 64, 128), torch.float32)
    run, ins = _layer(cache)
    reader = _Op(x=cache, out=_act("peek"), layer=0)  # reads the cache before the write: must stay before it
    crossed = run[:2] + [reader] + run[2:]
    assert kv_first(crossed) == crossed
    c1 = _Collective(x=ins["q"].out, out=_act("q_sum"), layer=0)
    c2 = _Collective(x=ins["rope"].out, out=_act("kr_sum"), layer=0)
    w = _Write(cache=cache, x=c2.out, layer=0)
    order = [ins["norm"], ins["q"], c1, ins["k"], ins["rope"], c2, w]
    assert kv_first(order) == order  # c2 would move ahead of c1: the rank protocol's order is kept


# ---- a real TP rank ------------------------------------------------------------------------------------------
def test_tp_rank_kernel_schedule():
    """Rank 0 of a tiny Qwen3-MoE at TP=2 x LNC=2 (HF tp_plan, fake process group, shape-only build): per layer the
    KV writes come before q_proj, static weight DMAs follow each all-reduce, and the LNC exchange of q_proj takes
    the GpSimd DMA path."""
    from fusegraph.modelperf import tp

    cfg = tp.TPConfig("llama-tiny", "trn3", 2, 2, layers=2, cache_len=64)
    with tp.fake_rank(cfg.tp):
        step, _ = tp.capture_rank(cfg)
        kernels, refused = tp.build_rank_kernels(step, cfg.target)
    assert not refused and len(kernels) == 1
    prog = kernels[0].plan.lowered.program
    layer0 = [i for i in prog.instructions if i.layer == 0]
    ops = [i.opcode for i in layer0]
    q = next(k for k, i in enumerate(layer0) if i.opcode == "linear" and i.module.endswith("q_proj"))
    assert all(k < q for k, op in enumerate(ops) if op == "kv_write")
    src = kernels[0].plan.generated.source
    assert re.search(r'sendrecv\([^\n]*dma_engine=nisa\.dma_engine\.gpsimd_dma[^\n]*name="L0\.q_proj', src)
    after = src.split("nki.collectives.all_reduce(", 2)[2].split("\n", 1)[1]  # the text after L0's o_proj sum
    first_dma = re.search(r'nisa\.dma_copy\([^\n]*name="([^"]+)"', after).group(1)
    assert re.search(r"\.linear\.w\d+$", first_dma), first_dma  # a projection's weights stream during the sum
