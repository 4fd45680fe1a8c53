"""Hand-written NKI 0.3 kernels (stable API: dst out-parameters, keyword arguments) used by the tests.

Imported inside ``fusegraph.nkisim.as_nki()`` by conftest.py, so ``import nki`` binds to the interpreter.
"""

import nki
import nki.collectives as nccl
import nki.isa as nisa
import nki.language as nl

P = 128


@nki.jit
def tiled_matmul(xT, w):
    """out[M, N] = xT.T @ w with xT [K, M], w [K, N]; K, M, N multiples of 128/128/512 (PSUM accumulation over K)."""
    K, M = xT.shape
    _, N = w.shape
    out = nl.ndarray(shape=(M, N), dtype=xT.dtype, buffer=nl.shared_hbm)
    NT = 512
    for m in nl.affine_range(M // P):
        for n in nl.affine_range(N // NT):
            acc = nl.ndarray(shape=(P, NT), dtype=nl.float32, buffer=nl.psum)
            for k in nl.sequential_range(K // P):
                xt = nl.ndarray(shape=(P, P), dtype=xT.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=xt, src=xT[k * P : (k + 1) * P, m * P : (m + 1) * P])
                wt = nl.ndarray(shape=(P, NT), dtype=w.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=wt, src=w[k * P : (k + 1) * P, nl.ds(n * NT, NT)])
                nisa.nc_matmul(dst=acc, stationary=xt, moving=wt)
            res = nl.ndarray(shape=(P, NT), dtype=xT.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res, src=acc)
            nisa.dma_copy(dst=out[m * P : (m + 1) * P, n * NT : (n + 1) * NT], src=res)
    return out


@nki.jit
def rmsnorm(x, gamma, eps):
    """y = x / sqrt(mean(x^2) + eps) * gamma; tokens on partitions (T <= 128), gamma [1, H]."""
    T, H = x.shape
    out = nl.ndarray(shape=(T, H), dtype=x.dtype, buffer=nl.shared_hbm)
    xt = nl.ndarray(shape=(T, H), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xt, src=x)
    g = nl.ndarray(shape=(T, H), dtype=gamma.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=g, src=gamma.ap(pattern=[[0, T], [1, H]], offset=0))  # broadcast over partitions
    sq = nl.ndarray(shape=(T, H), dtype=nl.float32, buffer=nl.sbuf)
    ss = nl.ndarray(shape=(T, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=sq, op=nl.square, data=xt, reduce_op=nl.add, reduce_res=ss,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    rstd = nl.ndarray(shape=(T, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=rstd, op=nl.rsqrt, data=ss, scale=1.0 / H, bias=eps)
    y = nl.ndarray(shape=(T, H), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=y, data=xt, op0=nl.multiply, operand0=rstd)
    yo = nl.ndarray(shape=(T, H), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=yo, data1=y, data2=g, op=nl.multiply)
    nisa.dma_copy(dst=out, src=yo)
    return out


@nki.jit
def softmax(x):
    """Row softmax of x [T, V] (tokens on partitions)."""
    T, V = x.shape
    out = nl.ndarray(shape=(T, V), dtype=x.dtype, buffer=nl.shared_hbm)
    xt = nl.ndarray(shape=(T, V), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xt, src=x)
    negmax = nl.ndarray(shape=(T, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=negmax, op=nl.maximum, data=xt, axis=1, negate=True, keepdims=True)
    e = nl.ndarray(shape=(T, V), dtype=nl.float32, buffer=nl.sbuf)
    s = nl.ndarray(shape=(T, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=e, op=nl.exp, data=xt, bias=negmax, reduce_op=nl.add, reduce_res=s,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    r = nl.ndarray(shape=(T, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=r, data=s)
    y = nl.ndarray(shape=(T, V), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=y, data=e, op0=nl.multiply, operand0=r)
    nisa.dma_copy(dst=out, src=y)
    return out


@nki.jit
def rope(x, cos, sin):
    """Half-split RoPE on x [d, T] (d on partitions); cos/sin [d/2, T]."""
    d, T = x.shape
    h = d // 2
    out = nl.ndarray(shape=(d, T), dtype=x.dtype, buffer=nl.shared_hbm)
    xt = nl.ndarray(shape=(d, T), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xt, src=x)
    c = nl.ndarray(shape=(h, T), dtype=cos.dtype, buffer=nl.sbuf)
    s = nl.ndarray(shape=(h, T), dtype=sin.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=c, src=cos)
    nisa.dma_copy(dst=s, src=sin)
    # the upper half must start on partition 0 to be combined with cos/sin (partition alignment)
    x2 = nl.ndarray(shape=(h, T), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=x2, src=xt[h:d, :])
    x1 = xt[0:h, :]
    a = nl.ndarray(shape=(h, T), dtype=nl.float32, buffer=nl.sbuf)
    b = nl.ndarray(shape=(h, T), dtype=nl.float32, buffer=nl.sbuf)
    res = nl.ndarray(shape=(d, T), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=a, data1=x1, data2=c, op=nl.multiply)
    nisa.tensor_tensor(dst=b, data1=x2, data2=s, op=nl.multiply)
    nisa.tensor_tensor(dst=res[0:h, :], data1=a, data2=b, op=nl.subtract)
    nisa.tensor_tensor(dst=a, data1=x2, data2=c, op=nl.multiply)
    nisa.tensor_tensor(dst=b, data1=x1, data2=s, op=nl.multiply)
    lo = nl.ndarray(shape=(h, T), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=lo, data1=a, data2=b, op=nl.add)
    nisa.tensor_copy(dst=res[h:d, :], src=lo)
    nisa.dma_copy(dst=out, src=res)
    return out


@nki.jit
def expert_gather_matmul(x, w, expert_ids):
    """out[j] = x.T @ w[expert_ids[j]]: expert weights fetched by a runtime expert id (scalar_offset DMA).

    x [K, T], w [E, K, N], expert_ids [1, k] int32 -> out [k, T, N]."""
    K, T = x.shape
    E, _, N = w.shape
    k = expert_ids.shape[1]
    out = nl.ndarray(shape=(k, T, N), dtype=nl.float32, buffer=nl.shared_hbm)
    ids = nl.ndarray(shape=(1, k), dtype=nl.int32, buffer=nl.sbuf, name="expert_ids")
    nisa.dma_copy(dst=ids, src=expert_ids)
    xt = nl.ndarray(shape=(K, T), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xt, src=x)
    for j in nl.static_range(k):
        wt = nl.ndarray(shape=(K, N), dtype=w.dtype, buffer=nl.sbuf)
        nisa.dma_copy(
            dst=wt,
            src=w.ap(pattern=[[N, K], [1, N]], offset=0, scalar_offset=ids[0:1, j : j + 1], indirect_dim=0),
        )
        ps = nl.ndarray(shape=(T, N), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=xt, moving=wt)
        r = nl.ndarray(shape=(T, N), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=r, src=ps)
        nisa.dma_copy(dst=out[j], src=r)
    return out


@nki.jit
def kv_write(cache, new_row, position):
    """cache[position] = new_row at a runtime position; returns the (updated) cache input."""
    S, D = cache.shape
    pos = nl.ndarray(shape=(1, 1), dtype=nl.int32, buffer=nl.sbuf, name="position")
    nisa.dma_copy(dst=pos, src=position)
    row = nl.ndarray(shape=(1, D), dtype=cache.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=row, src=new_row)
    nisa.dma_copy(
        dst=cache.ap(pattern=[[D, 1], [1, D]], offset=0, scalar_offset=pos, indirect_dim=0),
        src=row,
    )
    return cache


@nki.jit
def decode_attention(q, k_cache, v_cache, position, scale):
    """One decode token, H query heads sharing one KV head.

    q [d, H], k_cache/v_cache [S, d] (S multiple of 128), position [1, 1] int32: attend to rows <= position.
    Returns out [d, H]."""
    d, H = q.shape
    S, _ = k_cache.shape
    nt = S // P
    out = nl.ndarray(shape=(d, H), dtype=nl.float32, buffer=nl.shared_hbm)
    qt = nl.ndarray(shape=(d, H), dtype=q.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=qt, src=q)
    # position broadcast to the H head-partitions, as fp32
    pos_i = nl.ndarray(shape=(H, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=pos_i, src=position.ap(pattern=[[0, H], [1, 1]], offset=0))
    pos_f = nl.ndarray(shape=(H, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=pos_f, src=pos_i)
    scores = nl.ndarray(shape=(H, S), dtype=nl.float32, buffer=nl.sbuf)
    for t in nl.affine_range(nt):
        kt = nl.ndarray(shape=(P, d), dtype=k_cache.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=kt, src=k_cache[t * P : (t + 1) * P, :])
        kT_ps = nl.ndarray(shape=(d, P), dtype=k_cache.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=kT_ps, data=kt)
        kT = nl.ndarray(shape=(d, P), dtype=k_cache.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=kT, src=kT_ps)
        s_ps = nl.ndarray(shape=(H, P), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=s_ps, stationary=qt, moving=kT)
        nisa.activation(dst=scores[:, t * P : (t + 1) * P], op=nl.copy, data=s_ps, scale=scale)
    # mask positions > position
    idx = nl.ndarray(shape=(H, S), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=idx, pattern=[[1, S]], offset=0, channel_multiplier=0)
    keep = nl.ndarray(shape=(H, S), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=keep, data=idx, op0=nl.less_equal, operand0=pos_f)
    penalty = nl.ndarray(shape=(H, S), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=penalty, data=keep, op0=nl.subtract, operand0=1.0, op1=nl.multiply, operand1=30000.0)
    nisa.tensor_tensor(dst=scores, data1=scores, data2=penalty, op=nl.add)
    negmax = nl.ndarray(shape=(H, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=negmax, op=nl.maximum, data=scores, axis=1, negate=True)
    probs = nl.ndarray(shape=(H, S), dtype=nl.float32, buffer=nl.sbuf)
    ssum = nl.ndarray(shape=(H, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=probs, op=nl.exp, data=scores, bias=negmax, reduce_op=nl.add, reduce_res=ssum,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    rs = nl.ndarray(shape=(H, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=rs, data=ssum)
    pn = nl.ndarray(shape=(H, S), dtype=v_cache.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=pn, data=probs, op0=nl.multiply, operand0=rs)
    o_ps = nl.ndarray(shape=(d, H), dtype=nl.float32, buffer=nl.psum)
    for t in nl.affine_range(nt):
        pT_ps = nl.ndarray(shape=(P, H), dtype=v_cache.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=pT_ps, data=pn[:, t * P : (t + 1) * P])
        pT = nl.ndarray(shape=(P, H), dtype=v_cache.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=pT, src=pT_ps)
        vt = nl.ndarray(shape=(P, d), dtype=v_cache.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=vt, src=v_cache[t * P : (t + 1) * P, :])
        nisa.nc_matmul(dst=o_ps, stationary=vt, moving=pT, accumulate=(t > 0))
    o = nl.ndarray(shape=(d, H), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=o, src=o_ps)
    nisa.dma_copy(dst=out, src=o)
    return out


@nki.jit
def lnc_scale_rows(x):
    """LNC=2: each program handles half of the rows: out = 2 * x + 1 (x [2 * 128 * n, F])."""
    R, F = x.shape
    out = nl.ndarray(shape=(R, F), dtype=x.dtype, buffer=nl.shared_hbm)
    n_prg = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    rows = R // n_prg
    for i in nl.affine_range(rows // P):
        r0 = pid * rows + i * P
        t = nl.ndarray(shape=(P, F), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[r0 : r0 + P, :])
        y = nl.ndarray(shape=(P, F), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y, data=t, op0=nl.multiply, operand0=2.0, op1=nl.add, operand1=1.0)
        nisa.dma_copy(dst=out[r0 : r0 + P, :], src=y)
    return out


@nki.jit
def lnc_exchange_sum(x):
    """LNC=2: program p loads x[p] ([128, F]); partial tiles are exchanged with sendrecv and summed; program 0
    writes the sum, then both synchronise on core_barrier.  Returns sum over p of x[p]."""
    _, Pp, F = x.shape
    out = nl.ndarray(shape=(Pp, F), dtype=nl.float32, buffer=nl.shared_hbm)
    pid = nl.program_id(axis=0)
    mine = nl.ndarray(shape=(Pp, F), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=mine, src=x[pid])
    theirs = nl.ndarray(shape=(Pp, F), dtype=nl.float32, buffer=nl.sbuf)
    nisa.sendrecv(src=mine, dst=theirs, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
    total = nl.ndarray(shape=(Pp, F), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=total, data1=mine, data2=theirs, op=nl.add)
    if pid == 0:
        nisa.dma_copy(dst=out, src=total)
    nisa.core_barrier(data=out, cores=(0, 1))
    return out


@nki.jit
def tp_all_reduce(x):
    """Every rank contributes x [128, F]; returns the all-reduced sum (nki.collectives over 2 ranks)."""
    Pp, F = x.shape
    out = nl.ndarray(shape=(Pp, F), dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(shape=(Pp, F), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    r = nl.ndarray(shape=(Pp, F), dtype=x.dtype, buffer=nl.sbuf)
    nccl.all_reduce(srcs=[t], dsts=[r], replica_group=nccl.ReplicaGroup([[0, 1]]), op=nl.add)
    scaled = nl.ndarray(shape=(Pp, F), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=scaled, data=r, op0=nl.add, operand0=float(nccl.rank_id()))
    nisa.dma_copy(dst=out, src=scaled)
    return out


@nki.jit
def topk_experts(logits):
    """Router top-8: max8 values and their indices (nc_find_index8) for logits [T, E]."""
    T, E = logits.shape
    vals = nl.ndarray(shape=(T, 8), dtype=nl.float32, buffer=nl.shared_hbm)
    idx = nl.ndarray(shape=(T, 8), dtype=nl.uint32, buffer=nl.shared_hbm)
    lt = nl.ndarray(shape=(T, E), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=lt, src=logits)
    v = nl.ndarray(shape=(T, 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.max8(dst=v, src=lt)
    i = nl.ndarray(shape=(T, 8), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.nc_find_index8(dst=i, data=lt, vals=v)
    nisa.dma_copy(dst=vals, src=v)
    nisa.dma_copy(dst=idx, src=i)
    return vals, idx
