"""Speed benchmarks of fusegraph's NKI interpreter (fusegraph.nkisim).

Targets (issue #3):
  * dispatch overhead per small instruction              <= 50 us
  * 128x2048 @ 2048x2048 tiled matmul kernel (fp32, bf16) <= 2 s
  * shape-only run of a synthetic 48-layer decode megakernel (Qwen3-30B-A3B-like: ~600 kernel arguments,
    ~60 GB of abstract weights, >100k instructions)         <= 60 s

Usage: python benchmarks/bench_nkisim.py [--out bench-results/nkisim.json] [--layers 48] [--quick]
Prints a table and writes the results as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time

import ml_dtypes
import numpy as np

from fusegraph import nkisim
from fusegraph.nkisim import Abstract, load_kernel_source

HDR = "import nki\nimport nki.language as nl\nimport nki.isa as nisa\n"

DISPATCH_SRC = HDR + """
@nki.jit
def many_small(x, n):
    out = nl.ndarray(shape=(128, 8), dtype=nl.float32, buffer=nl.shared_hbm)
    a = nl.ndarray(shape=(128, 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=a, src=x)
    b = nl.ndarray(shape=(128, 8), dtype=nl.float32, buffer=nl.sbuf)
    for i in range(n):
        nisa.tensor_tensor(dst=b, data1=a, data2=a, op=nl.add)
        nisa.tensor_scalar(dst=a, data=b, op0=nl.multiply, operand0=0.5)
    nisa.dma_copy(dst=out, src=a)
    return out
"""

MATMUL_SRC = HDR + """
@nki.jit
def matmul(xT, w):
    K, M = xT.shape
    _, N = w.shape
    out = nl.ndarray(shape=(M, N), dtype=nl.float32, buffer=nl.shared_hbm)
    x_tiles = []
    for k in range(K // 128):
        xt = nl.ndarray(shape=(128, 128), dtype=xT.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt, src=xT[k * 128 : (k + 1) * 128, 0:128])
        x_tiles.append(xt)
    for n in range(N // 512):
        acc = nl.ndarray(shape=(128, 512), dtype=nl.float32, buffer=nl.psum)
        for k in range(K // 128):
            wt = nl.ndarray(shape=(128, 512), dtype=w.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=wt, src=w[k * 128 : (k + 1) * 128, n * 512 : (n + 1) * 512])
            nisa.nc_matmul(dst=acc, stationary=x_tiles[k], moving=wt, accumulate=(k > 0))
        res = nl.ndarray(shape=(128, 512), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res, src=acc)
        nisa.dma_copy(dst=out[:, n * 512 : (n + 1) * 512], src=res)
    return out
"""


def megakernel_source(layers: int) -> tuple[str, list[tuple[str, tuple[int, ...], str]]]:
    """A synthetic single-rank Qwen3-30B-A3B-like decode megakernel (T=1 token, hidden on partitions).

    Per layer: RMSNorm, QKV projection (16 x 10 matmul tiles), RoPE, KV-cache writes at a runtime position,
    attention over a 4096-position cache (4 KV heads), O projection, residual, RMSNorm, router (128 experts)
    with top-8, and 8 selected experts fetched by runtime expert id (gate/up + down projections)."""
    H, QKV, O_IN, E, I, S = 2048, 5120, 4096, 128, 768, 4096
    args: list[tuple[str, tuple[int, ...], str]] = [("hidden", (128, 16), "bfloat16"), ("position", (1, 1), "int32")]
    for l in range(layers):
        args += [
            (f"ln1_{l}", (128, 16), "bfloat16"),
            (f"w_qkv_{l}", (H, QKV), "bfloat16"),
            (f"k_cache_{l}", (4, S, 128), "bfloat16"),
            (f"v_cache_{l}", (4, S, 128), "bfloat16"),
            (f"w_o_{l}", (O_IN, H), "bfloat16"),
            (f"ln2_{l}", (128, 16), "bfloat16"),
            (f"w_router_{l}", (H, E), "bfloat16"),
            (f"w_gate_up_{l}", (E, H, 2 * I), "bfloat16"),
            (f"w_down_{l}", (E, I, H), "bfloat16"),
            (f"cos_{l}", (64, 1), "float32"),
            (f"sin_{l}", (64, 1), "float32"),
            (f"q_norm_{l}", (128, 1), "float32"),
        ]
    params = ", ".join(a[0] for a in args)
    lines = [HDR, "", "@nki.jit", f"def megakernel({params}):"]
    w = lines.append
    w("    out = nl.ndarray(shape=(128, 16), dtype=nl.bfloat16, buffer=nl.shared_hbm)")
    w("    h = nl.ndarray(shape=(128, 16), dtype=nl.float32, buffer=nl.sbuf, name='residual')")
    w("    nisa.dma_copy(dst=h, src=hidden)")
    w("    pos = nl.ndarray(shape=(1, 1), dtype=nl.int32, buffer=nl.sbuf, name='position')")
    w("    nisa.dma_copy(dst=pos, src=position)")
    w("    ones = nl.ndarray(shape=(128, 128), dtype=nl.float32, buffer=nl.sbuf)")
    w("    nisa.memset(dst=ones, value=1.0)")
    w("    for layer in range(%d):" % layers)
    w("        L = layer")
    body = """
ln1 = LN1[L]; wqkv = WQKV[L]; kc = KC[L]; vc = VC[L]; wo = WO[L]; ln2 = LN2[L]; wr = WR[L]; wgu = WGU[L]; wd = WD[L]
xn = rmsnorm(h, ln1, ones)
# QKV projection: hidden [128(H0), 16(H1)] is the stationary (T=1), weights stream as moving
qkv = nl.ndarray(shape=(1, 5120), dtype=nl.float32, buffer=nl.sbuf)
for n in range(10):
    ps = nl.ndarray(shape=(1, 512), dtype=nl.float32, buffer=nl.psum)
    for k in range(16):
        wt = nl.ndarray(shape=(128, 512), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=wt, src=wqkv[k * 128:(k + 1) * 128, n * 512:(n + 1) * 512])
        nisa.nc_matmul(dst=ps, stationary=xn[:, k:k + 1], moving=wt, accumulate=(k > 0))
    nisa.tensor_copy(dst=qkv[:, n * 512:(n + 1) * 512], src=ps)
# q/k heads to [128(d), heads] layout via TensorE transposes
qT = nl.ndarray(shape=(128, 40), dtype=nl.bfloat16, buffer=nl.sbuf)
for hd in range(40):
    tp = nl.ndarray(shape=(128, 1), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=tp, data=qkv[:, hd * 128:(hd + 1) * 128])
    nisa.tensor_copy(dst=qT[:, hd:hd + 1], src=tp)
# RoPE (half split) on q and k heads
rot = nl.ndarray(shape=(64, 36), dtype=nl.float32, buffer=nl.sbuf)
nisa.tensor_copy(dst=rot, src=qT[64:128, 0:36])
nisa.tensor_scalar(dst=rot, data=rot, op0=nl.multiply, operand0=-1.0)
nisa.tensor_tensor(dst=qT[0:64, 0:36], data1=qT[0:64, 0:36], data2=rot, op=nl.add)
# KV-cache writes at the runtime position
for kvh in range(4):
    row = nl.ndarray(shape=(1, 128), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(dst=row, src=qkv[:, (32 + kvh) * 128:(33 + kvh) * 128])
    nisa.dma_copy(dst=kc.ap(pattern=[[128, 1], [1, 128]], offset=kvh * 4096 * 128, scalar_offset=pos, indirect_dim=1), src=row)
    nisa.dma_copy(dst=vc.ap(pattern=[[128, 1], [1, 128]], offset=kvh * 4096 * 128, scalar_offset=pos, indirect_dim=1), src=row)
# attention: 4 KV heads x 8 query heads, 32 cache tiles of 128 positions
attn = nl.ndarray(shape=(128, 32), dtype=nl.bfloat16, buffer=nl.sbuf)
for kvh in range(4):
    scores = nl.ndarray(shape=(8, 4096), dtype=nl.float32, buffer=nl.sbuf)
    for t in range(32):
        kt = nl.ndarray(shape=(128, 128), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=kt, src=kc[kvh, t * 128:(t + 1) * 128, :])
        kT = nl.ndarray(shape=(128, 128), dtype=nl.bfloat16, buffer=nl.psum)
        nisa.nc_transpose(dst=kT, data=kt)
        kTs = nl.ndarray(shape=(128, 128), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=kTs, src=kT)
        sp = nl.ndarray(shape=(8, 128), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=sp, stationary=qT[:, kvh * 8:(kvh + 1) * 8], moving=kTs)
        nisa.activation(dst=scores[:, t * 128:(t + 1) * 128], op=nl.copy, data=sp, scale=0.088)
    negmax = nl.ndarray(shape=(8, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=negmax, op=nl.maximum, data=scores, axis=1, negate=True)
    ssum = nl.ndarray(shape=(8, 1), dtype=nl.float32, buffer=nl.sbuf)
    probs = nl.ndarray(shape=(8, 4096), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.activation(dst=probs, op=nl.exp, data=scores, bias=negmax, reduce_op=nl.add, reduce_res=ssum, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    op = nl.ndarray(shape=(128, 8), dtype=nl.float32, buffer=nl.psum)
    for t in range(32):
        pT = nl.ndarray(shape=(128, 8), dtype=nl.bfloat16, buffer=nl.psum)
        nisa.nc_transpose(dst=pT, data=probs[:, t * 128:(t + 1) * 128])
        pTs = nl.ndarray(shape=(128, 8), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=pTs, src=pT)
        vt = nl.ndarray(shape=(128, 128), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=vt, src=vc[kvh, t * 128:(t + 1) * 128, :])
        nisa.nc_matmul(dst=op, stationary=vt, moving=pTs, accumulate=(t > 0))
    nisa.tensor_copy(dst=attn[:, kvh * 8:(kvh + 1) * 8], src=op)
# O projection back to hidden [128(H0), 16(H1)]
for n in range(16):
    ps = nl.ndarray(shape=(128, 1), dtype=nl.float32, buffer=nl.psum)
    for k in range(32):
        wt = nl.ndarray(shape=(128, 128), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=wt, src=wo[k * 128:(k + 1) * 128, n * 128:(n + 1) * 128])
        nisa.nc_matmul(dst=ps, stationary=wt, moving=attn[:, k:k + 1], accumulate=(k > 0))
    nisa.tensor_tensor(dst=h[:, n:n + 1], data1=h[:, n:n + 1], data2=ps, op=nl.add)
xn2 = rmsnorm(h, ln2, ones)
# router + top-8
lp = nl.ndarray(shape=(1, 128), dtype=nl.float32, buffer=nl.psum)
for k in range(16):
    wt = nl.ndarray(shape=(128, 128), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=wt, src=wr[k * 128:(k + 1) * 128, :])
    nisa.nc_matmul(dst=lp, stationary=xn2[:, k:k + 1], moving=wt, accumulate=(k > 0))
logits = nl.ndarray(shape=(1, 128), dtype=nl.float32, buffer=nl.sbuf)
nisa.tensor_copy(dst=logits, src=lp)
top = nl.ndarray(shape=(1, 8), dtype=nl.float32, buffer=nl.sbuf)
nisa.max8(dst=top, src=logits)
eid = nl.ndarray(shape=(1, 8), dtype=nl.uint32, buffer=nl.sbuf, name='expert_ids')
nisa.nc_find_index8(dst=eid, data=logits, vals=top)
# 8 selected experts, weights fetched by runtime expert id
for j in range(8):
    act = nl.ndarray(shape=(128, 6), dtype=nl.bfloat16, buffer=nl.sbuf)
    for it in range(6):
        g = nl.ndarray(shape=(128, 1), dtype=nl.float32, buffer=nl.psum)
        u = nl.ndarray(shape=(128, 1), dtype=nl.float32, buffer=nl.psum)
        for k in range(16):
            wg = nl.ndarray(shape=(128, 256), dtype=nl.bfloat16, buffer=nl.sbuf)
            nisa.dma_copy(dst=wg, src=wgu.ap(pattern=[[1536, 128], [1, 256]], offset=k * 128 * 1536 + it * 128, scalar_offset=eid[0:1, j:j + 1], indirect_dim=0))
            nisa.nc_matmul(dst=g, stationary=wg[:, 0:128], moving=xn2[:, k:k + 1], accumulate=(k > 0))
            nisa.nc_matmul(dst=u, stationary=wg[:, 128:256], moving=xn2[:, k:k + 1], accumulate=(k > 0))
        gs = nl.ndarray(shape=(128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=gs, op=nl.silu, data=g)
        nisa.tensor_tensor(dst=act[:, it:it + 1], data1=gs, data2=u, op=nl.multiply)
    for n in range(16):
        dp = nl.ndarray(shape=(128, 1), dtype=nl.float32, buffer=nl.psum)
        for k in range(6):
            wdt = nl.ndarray(shape=(128, 128), dtype=nl.bfloat16, buffer=nl.sbuf)
            nisa.dma_copy(dst=wdt, src=wd.ap(pattern=[[2048, 128], [1, 128]], offset=k * 128 * 2048 + n * 128, scalar_offset=eid[0:1, j:j + 1], indirect_dim=0))
            nisa.nc_matmul(dst=dp, stationary=wdt, moving=act[:, k:k + 1], accumulate=(k > 0))
        nisa.scalar_tensor_tensor(dst=h[:, n:n + 1], data=dp, op0=nl.multiply, operand0=0.125, op1=nl.add, operand1=h[:, n:n + 1])
"""
    for b in body.strip("\n").splitlines():
        w("        " + b)
    w("    res = nl.ndarray(shape=(128, 16), dtype=nl.bfloat16, buffer=nl.sbuf)")
    w("    nisa.tensor_copy(dst=res, src=h)")
    w("    nisa.dma_copy(dst=out, src=res)")
    w("    return out")
    w("")
    w("")
    w("def rmsnorm(h, gamma_hbm, ones):")
    w("    sq = nl.ndarray(shape=(128, 16), dtype=nl.float32, buffer=nl.sbuf)")
    w("    part = nl.ndarray(shape=(128, 1), dtype=nl.float32, buffer=nl.sbuf)")
    w("    nisa.activation(dst=sq, op=nl.square, data=h, reduce_op=nl.add, reduce_res=part, reduce_cmd=nisa.reduce_cmd.reset_reduce)")
    w("    tot = nl.ndarray(shape=(128, 1), dtype=nl.float32, buffer=nl.psum)")
    w("    nisa.nc_matmul(dst=tot, stationary=ones, moving=part)")
    w("    rstd = nl.ndarray(shape=(128, 1), dtype=nl.float32, buffer=nl.sbuf)")
    w("    nisa.activation(dst=rstd, op=nl.rsqrt, data=tot, scale=1.0 / 2048, bias=1e-6)")
    w("    g = nl.ndarray(shape=(128, 16), dtype=nl.bfloat16, buffer=nl.sbuf)")
    w("    nisa.dma_copy(dst=g, src=gamma_hbm)")
    w("    xn = nl.ndarray(shape=(128, 16), dtype=nl.bfloat16, buffer=nl.sbuf)")
    w("    nisa.scalar_tensor_tensor(dst=xn, data=h, op0=nl.multiply, operand0=rstd, op1=nl.multiply, operand1=g)")
    w("    return xn")
    src = "\n".join(lines)
    # per-layer argument lists (plain Python lists of the layer's tensors, built from the explicit parameters)
    lists = {"LN1": "ln1", "WQKV": "w_qkv", "KC": "k_cache", "VC": "v_cache", "WO": "w_o", "LN2": "ln2",
             "WR": "w_router", "WGU": "w_gate_up", "WD": "w_down"}
    setup = "".join(
        f"    {k} = [{', '.join(f'{v}_{l}' for l in range(layers))}]\n" for k, v in lists.items()
    )
    src = src.replace("    out = nl.ndarray(shape=(128, 16), dtype=nl.bfloat16, buffer=nl.shared_hbm)\n",
                      setup + "    out = nl.ndarray(shape=(128, 16), dtype=nl.bfloat16, buffer=nl.shared_hbm)\n", 1)
    return src, args


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def bench_dispatch(n: int) -> dict:
    k = load_kernel_source(DISPATCH_SRC, "/bench/dispatch.py")["many_small"]
    x = np.ones((128, 8), dtype=np.float32)
    k(x, 10)  # warm-up
    t0 = time.perf_counter()
    k(x, n)
    dt = time.perf_counter() - t0
    instr = nkisim.last_profile().instructions
    t1 = time.perf_counter()
    nkisim.run(k, Abstract((128, 8), "float32"), n, shape_only=True)
    dt_shape = time.perf_counter() - t1
    return {
        "instructions": instr,
        "seconds": dt,
        "us_per_instruction": dt / instr * 1e6,
        "shape_only_us_per_instruction": dt_shape / instr * 1e6,
        "target_us": 50.0,
        "ok": dt / instr * 1e6 <= 50.0,
    }


def bench_matmul(dtype) -> dict:
    k = load_kernel_source(MATMUL_SRC, "/bench/matmul.py")["matmul"]
    rng = np.random.default_rng(0)
    xT = rng.standard_normal((2048, 128), dtype=np.float32).astype(dtype)
    w = rng.standard_normal((2048, 2048), dtype=np.float32).astype(dtype)
    t0 = time.perf_counter()
    out = k(xT, w)
    dt = time.perf_counter() - t0
    ref = xT.astype(np.float32).T @ w.astype(np.float32)
    err = float(np.abs(out - ref).max() / np.abs(ref).max())
    return {"dtype": np.dtype(dtype).name, "seconds": dt, "rel_err": err, "instructions":
            nkisim.last_profile().instructions, "target_s": 2.0, "ok": dt <= 2.0 and err < 1e-3}


def bench_megakernel(layers: int) -> dict:
    src, args = megakernel_source(layers)
    t0 = time.perf_counter()
    k = load_kernel_source(src, "/bench/megakernel.py")["megakernel"]
    load_s = time.perf_counter() - t0
    abstract = [Abstract(shape, dtype) for _, shape, dtype in args]
    weight_bytes = sum(a.nbytes for a in abstract)
    rss0 = _rss_mb()
    t1 = time.perf_counter()
    nkisim.run(k, *abstract, shape_only=True)
    dt = time.perf_counter() - t1
    p = nkisim.last_profile()
    return {
        "layers": layers,
        "kernel_arguments": len(args),
        "abstract_weight_gb": weight_bytes / 1e9,
        "instructions": p.instructions,
        "dma_bytes_gb": p.dma_bytes / 1e9,
        "hbm_read_gb": p.hbm_read_bytes / 1e9,
        "peak_sbuf_bytes_per_partition": p.peak_sbuf_bytes_per_partition,
        "peak_psum_bytes_per_partition": p.peak_psum_bytes_per_partition,
        "load_seconds": load_s,
        "seconds": dt,
        "us_per_instruction": dt / max(p.instructions, 1) * 1e6,
        "max_rss_growth_mb": _rss_mb() - rss0,
        "target_s": 60.0 * layers / 48,
        "ok": dt <= 60.0 * layers / 48,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-results/nkisim.json")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke test of the benchmark itself)")
    ns = ap.parse_args(argv)
    layers = 2 if ns.quick else ns.layers
    results = {
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "numpy": np.__version__,
        "dispatch": bench_dispatch(500 if ns.quick else 5000),
        "matmul_fp32": bench_matmul(np.float32),
        "matmul_bf16": bench_matmul(ml_dtypes.bfloat16),
        "megakernel_shape_only": bench_megakernel(layers),
    }
    d, m32, m16, mk = (results[k] for k in ("dispatch", "matmul_fp32", "matmul_bf16", "megakernel_shape_only"))
    rows = [
        ("dispatch per small instruction", f"{d['us_per_instruction']:.1f} us", "<= 50 us", d["ok"]),
        ("  (shape-only)", f"{d['shape_only_us_per_instruction']:.1f} us", "", True),
        ("128x2048 @ 2048x2048 fp32", f"{m32['seconds']:.3f} s", "<= 2 s", m32["ok"]),
        ("128x2048 @ 2048x2048 bf16", f"{m16['seconds']:.3f} s", "<= 2 s", m16["ok"]),
        (f"{mk['layers']}-layer megakernel, shape-only", f"{mk['seconds']:.1f} s", f"<= {mk['target_s']:.0f} s",
         mk["ok"]),
        ("  instructions / args / weights", f"{mk['instructions']} / {mk['kernel_arguments']} / "
         f"{mk['abstract_weight_gb']:.1f} GB", "", True),
        ("  per instruction / RSS growth", f"{mk['us_per_instruction']:.1f} us / {mk['max_rss_growth_mb']:.0f} MB",
         "", True),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"{'benchmark':<{w0}}  {'result':<{w1}}  {'target':<9}  ok")
    for name, val, target, ok in rows:
        print(f"{name:<{w0}}  {val:<{w1}}  {target:<9}  {'yes' if ok else 'NO'}")
    os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
    with open(ns.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {ns.out}")
    return 0 if all(r[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
