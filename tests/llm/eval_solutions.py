"""Reference NKI solutions of the llm-eval problem set (the "right answers" the scripted endpoint replays).

They are written for the set's plain-tensor interfaces (the template library's kernels in
``fusegraph/llm/examples.py`` take codegen's embedded/laid-out interfaces, so they do not fit these tasks), and
``test_eval_solutions.py`` proves each one passes the harness: every problem of the set is solvable.
"""
from __future__ import annotations

HEADER = '''import nki
import nki.language as nl
import nki.isa as nisa
'''

SCALE_MATRIX = HEADER + '''

@nki.jit
def scale_matrix(x):
    y = nl.ndarray(shape=(256, 1024), dtype=nl.float32, buffer=nl.shared_hbm, name="y")
    for r in range(2):
        t = nl.ndarray(shape=(128, 1024), dtype=nl.float32, buffer=nl.sbuf, name="t")
        nisa.dma_copy(dst=t, src=x[r * 128:(r + 1) * 128, :])
        o = nl.ndarray(shape=(128, 1024), dtype=nl.float32, buffer=nl.sbuf, name="o")
        nisa.tensor_scalar(dst=o, data=t, op0=nl.multiply, operand0=3.5)
        nisa.dma_copy(dst=y[r * 128:(r + 1) * 128, :], src=o)
    return y
'''

ELEMENTWISE_CHAIN = HEADER + '''

@nki.jit
def elementwise_chain(a, b, c):
    y = nl.ndarray(shape=(384, 768), dtype=nl.bfloat16, buffer=nl.shared_hbm, name="y")
    for r in range(3):
        rows = nl.ds(r * 128, 128)
        ta = nl.ndarray(shape=(128, 768), dtype=nl.bfloat16, buffer=nl.sbuf, name="ta")
        tb = nl.ndarray(shape=(128, 768), dtype=nl.bfloat16, buffer=nl.sbuf, name="tb")
        tc = nl.ndarray(shape=(128, 768), dtype=nl.bfloat16, buffer=nl.sbuf, name="tc")
        nisa.dma_copy(dst=ta, src=a[rows, :])
        nisa.dma_copy(dst=tb, src=b[rows, :])
        nisa.dma_copy(dst=tc, src=c[rows, :])
        s = nl.ndarray(shape=(128, 768), dtype=nl.float32, buffer=nl.sbuf, name="s")
        nisa.tensor_tensor(dst=s, data1=ta, data2=tb, op=nl.multiply)
        nisa.tensor_tensor(dst=s, data1=s, data2=tc, op=nl.add)
        h = nl.ndarray(shape=(128, 768), dtype=nl.float32, buffer=nl.sbuf, name="h")
        nisa.activation(dst=h, op=nl.tanh, data=s)
        o = nl.ndarray(shape=(128, 768), dtype=nl.bfloat16, buffer=nl.sbuf, name="o")
        nisa.tensor_scalar(dst=o, data=h, op0=nl.multiply, operand0=0.5)
        nisa.dma_copy(dst=y[rows, :], src=o)
    return y
'''


def _row_softmax(lnc: int) -> str:
    name = "row_softmax" if lnc == 1 else "row_softmax_lnc2"
    return HEADER + f'''

@nki.jit
def {name}(x):
    y = nl.ndarray(shape=(256, 640), dtype=nl.float32, buffer=nl.shared_hbm, name="y")
    programs = {lnc}
    pid = nl.program_id(0) if programs > 1 else 0
    per = 2 // programs
    for i in range(per):
        rows = nl.ds((pid * per + i) * 128, 128)
        t = nl.ndarray(shape=(128, 640), dtype=nl.float32, buffer=nl.sbuf, name="t")
        nisa.dma_copy(dst=t, src=x[rows, :])
        nmax = nl.ndarray(shape=(128, 1), dtype=nl.float32, buffer=nl.sbuf, name="nmax")
        nisa.tensor_reduce(dst=nmax, op=nl.maximum, data=t, axis=1, negate=True, keepdims=True)
        e = nl.ndarray(shape=(128, 640), dtype=nl.float32, buffer=nl.sbuf, name="e")
        ssum = nl.ndarray(shape=(128, 1), dtype=nl.float32, buffer=nl.sbuf, name="ssum")
        nisa.activation(dst=e, op=nl.exp, data=t, bias=nmax, scale=1.0, reduce_op=nl.add, reduce_res=ssum,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        r = nl.ndarray(shape=(128, 1), dtype=nl.float32, buffer=nl.sbuf, name="r")
        nisa.reciprocal(dst=r, data=ssum)
        o = nl.ndarray(shape=(128, 640), dtype=nl.float32, buffer=nl.sbuf, name="o")
        nisa.tensor_scalar(dst=o, data=e, op0=nl.multiply, operand0=r)
        nisa.dma_copy(dst=y[rows, :], src=o)
    return y
'''


def _rmsnorm(lnc: int) -> str:
    name = "rmsnorm" if lnc == 1 else "rmsnorm_lnc2"
    return HEADER + f'''

@nki.jit
def {name}(x, w):
    y = nl.ndarray(shape=(256, 2048), dtype=nl.bfloat16, buffer=nl.shared_hbm, name="y")
    programs = {lnc}
    pid = nl.program_id(0) if programs > 1 else 0
    per = 2 // programs
    wt = nl.ndarray(shape=(128, 2048), dtype=nl.bfloat16, buffer=nl.sbuf, name="wt")
    nisa.dma_copy(dst=wt, src=w.ap(pattern=[[0, 128], [1, 2048]], offset=0))
    for i in range(per):
        rows = nl.ds((pid * per + i) * 128, 128)
        t = nl.ndarray(shape=(128, 2048), dtype=nl.bfloat16, buffer=nl.sbuf, name="t")
        nisa.dma_copy(dst=t, src=x[rows, :])
        sq = nl.ndarray(shape=(128, 2048), dtype=nl.float32, buffer=nl.sbuf, name="sq")
        ss = nl.ndarray(shape=(128, 1), dtype=nl.float32, buffer=nl.sbuf, name="ss")
        nisa.activation(dst=sq, op=nl.square, data=t, reduce_op=nl.add, reduce_res=ss,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        rstd = nl.ndarray(shape=(128, 1), dtype=nl.float32, buffer=nl.sbuf, name="rstd")
        nisa.activation(dst=rstd, op=nl.rsqrt, data=ss, scale=1.0 / 2048, bias=1e-6)
        xn = nl.ndarray(shape=(128, 2048), dtype=nl.bfloat16, buffer=nl.sbuf, name="xn")
        nisa.activation(dst=xn, op=nl.copy, data=t, scale=rstd)
        o = nl.ndarray(shape=(128, 2048), dtype=nl.bfloat16, buffer=nl.sbuf, name="o")
        nisa.tensor_tensor(dst=o, data1=xn, data2=wt, op=nl.multiply)
        nisa.dma_copy(dst=y[rows, :], src=o)
    return y
'''


LAYERNORM = HEADER + '''

@nki.jit
def layernorm(x, w, b):
    y = nl.ndarray(shape=(256, 768), dtype=nl.float32, buffer=nl.shared_hbm, name="y")
    wt = nl.ndarray(shape=(128, 768), dtype=nl.float32, buffer=nl.sbuf, name="wt")
    bt = nl.ndarray(shape=(128, 768), dtype=nl.float32, buffer=nl.sbuf, name="bt")
    nisa.dma_copy(dst=wt, src=w.ap(pattern=[[0, 128], [1, 768]], offset=0))
    nisa.dma_copy(dst=bt, src=b.ap(pattern=[[0, 128], [1, 768]], offset=0))
    for r in range(2):
        rows = nl.ds(r * 128, 128)
        t = nl.ndarray(shape=(128, 768), dtype=nl.float32, buffer=nl.sbuf, name="t")
        nisa.dma_copy(dst=t, src=x[rows, :])
        s = nl.ndarray(shape=(128, 1), dtype=nl.float32, buffer=nl.sbuf, name="s")
        nisa.tensor_reduce(dst=s, op=nl.add, data=t, axis=1, keepdims=True)
        nmean = nl.ndarray(shape=(128, 1), dtype=nl.float32, buffer=nl.sbuf, name="nmean")
        nisa.tensor_scalar(dst=nmean, data=s, op0=nl.multiply, operand0=-1.0 / 768)
        xc = nl.ndarray(shape=(128, 768), dtype=nl.float32, buffer=nl.sbuf, name="xc")
        nisa.tensor_scalar(dst=xc, data=t, op0=nl.add, operand0=nmean)
        sq = nl.ndarray(shape=(128, 768), dtype=nl.float32, buffer=nl.sbuf, name="sq")
        ss = nl.ndarray(shape=(128, 1), dtype=nl.float32, buffer=nl.sbuf, name="ss")
        nisa.activation(dst=sq, op=nl.square, data=xc, reduce_op=nl.add, reduce_res=ss,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        rstd = nl.ndarray(shape=(128, 1), dtype=nl.float32, buffer=nl.sbuf, name="rstd")
        nisa.activation(dst=rstd, op=nl.rsqrt, data=ss, scale=1.0 / 768, bias=1e-5)
        xn = nl.ndarray(shape=(128, 768), dtype=nl.float32, buffer=nl.sbuf, name="xn")
        nisa.tensor_scalar(dst=xn, data=xc, op0=nl.multiply, operand0=rstd)
        o = nl.ndarray(shape=(128, 768), dtype=nl.float32, buffer=nl.sbuf, name="o")
        nisa.tensor_tensor(dst=o, data1=xn, data2=wt, op=nl.multiply)
        nisa.tensor_tensor(dst=o, data1=o, data2=bt, op=nl.add)
        nisa.dma_copy(dst=y[rows, :], src=o)
    return y
'''

SILU_GATE = HEADER + '''

@nki.jit
def silu_gate(gate, up):
    y = nl.ndarray(shape=(384, 1024), dtype=nl.float32, buffer=nl.shared_hbm, name="y")
    for r in range(3):
        rows = nl.ds(r * 128, 128)
        g = nl.ndarray(shape=(128, 1024), dtype=nl.float32, buffer=nl.sbuf, name="g")
        u = nl.ndarray(shape=(128, 1024), dtype=nl.float32, buffer=nl.sbuf, name="u")
        nisa.dma_copy(dst=g, src=gate[rows, :])
        nisa.dma_copy(dst=u, src=up[rows, :])
        a = nl.ndarray(shape=(128, 1024), dtype=nl.float32, buffer=nl.sbuf, name="a")
        nisa.activation(dst=a, op=nl.silu, data=g)
        o = nl.ndarray(shape=(128, 1024), dtype=nl.float32, buffer=nl.sbuf, name="o")
        nisa.tensor_tensor(dst=o, data1=a, data2=u, op=nl.multiply)
        nisa.dma_copy(dst=y[rows, :], src=o)
    return y
'''

GELU_TANH_GATE = HEADER + '''

@nki.jit
def gelu_tanh_gate(gate, up):
    y = nl.ndarray(shape=(256, 1536), dtype=nl.bfloat16, buffer=nl.shared_hbm, name="y")
    for r in range(2):
        rows = nl.ds(r * 128, 128)
        g = nl.ndarray(shape=(128, 1536), dtype=nl.bfloat16, buffer=nl.sbuf, name="g")
        u = nl.ndarray(shape=(128, 1536), dtype=nl.bfloat16, buffer=nl.sbuf, name="u")
        nisa.dma_copy(dst=g, src=gate[rows, :])
        nisa.dma_copy(dst=u, src=up[rows, :])
        a = nl.ndarray(shape=(128, 1536), dtype=nl.bfloat16, buffer=nl.sbuf, name="a")
        nisa.activation(dst=a, op=nl.gelu_apprx_tanh, data=g)
        o = nl.ndarray(shape=(128, 1536), dtype=nl.bfloat16, buffer=nl.sbuf, name="o")
        nisa.tensor_tensor(dst=o, data1=a, data2=u, op=nl.multiply)
        nisa.dma_copy(dst=y[rows, :], src=o)
    return y
'''


def _matmul_psum(lnc: int) -> str:
    name = "matmul_psum" if lnc == 1 else "matmul_psum_lnc2"
    return HEADER + f'''

@nki.jit
def {name}(x, w):
    y = nl.ndarray(shape=(256, 640), dtype=nl.bfloat16, buffer=nl.shared_hbm, name="y")
    programs = {lnc}
    pid = nl.program_id(0) if programs > 1 else 0
    per = 2 // programs
    wt = nl.ndarray(shape=(128, 3, 640), dtype=nl.bfloat16, buffer=nl.sbuf, name="wt")
    for kt in range(3):
        nisa.dma_copy(dst=wt[:, kt, :], src=w[nl.ds(kt * 128, 128), :])
    for i in range(per):
        rows = nl.ds((pid * per + i) * 128, 128)
        xt = nl.ndarray(shape=(128, 384), dtype=nl.bfloat16, buffer=nl.sbuf, name="xt")
        nisa.dma_copy(dst=xt, src=x[rows, :])
        xT = nl.ndarray(shape=(128, 3, 128), dtype=nl.bfloat16, buffer=nl.sbuf, name="xT")
        for kt in range(3):
            tp = nl.ndarray(shape=(128, 128), dtype=nl.bfloat16, buffer=nl.psum, name="tp")
            nisa.nc_transpose(dst=tp, data=xt[:, nl.ds(kt * 128, 128)])
            nisa.tensor_copy(dst=xT[:, kt, :], src=tp)
        o = nl.ndarray(shape=(128, 640), dtype=nl.bfloat16, buffer=nl.sbuf, name="o")
        for n0, nsz in ((0, 512), (512, 128)):
            acc = nl.ndarray(shape=(128, nsz), dtype=nl.float32, buffer=nl.psum, name="acc")
            for kt in range(3):
                nisa.nc_matmul(dst=acc, stationary=xT[:, kt, :], moving=wt[:, kt, nl.ds(n0, nsz)],
                               accumulate=(kt != 0))
            nisa.tensor_copy(dst=o[:, nl.ds(n0, nsz)], src=acc)
        nisa.dma_copy(dst=y[rows, :], src=o)
    return y
'''


TRANSPOSE = HEADER + '''

@nki.jit
def transpose(x):
    y = nl.ndarray(shape=(384, 256), dtype=nl.float32, buffer=nl.shared_hbm, name="y")
    for r in range(2):
        t = nl.ndarray(shape=(128, 384), dtype=nl.float32, buffer=nl.sbuf, name="t")
        nisa.dma_copy(dst=t, src=x[nl.ds(r * 128, 128), :])
        for c in range(3):
            tp = nl.ndarray(shape=(128, 128), dtype=nl.float32, buffer=nl.psum, name="tp")
            nisa.nc_transpose(dst=tp, data=t[:, nl.ds(c * 128, 128)])
            o = nl.ndarray(shape=(128, 128), dtype=nl.float32, buffer=nl.sbuf, name="o")
            nisa.tensor_copy(dst=o, src=tp)
            nisa.dma_copy(dst=y[nl.ds(c * 128, 128), nl.ds(r * 128, 128)], src=o)
    return y
'''

CUMSUM = HEADER + '''

@nki.jit
def cumsum(x):
    y = nl.ndarray(shape=(256, 512), dtype=nl.float32, buffer=nl.shared_hbm, name="y")
    ones = nl.ndarray(shape=(128, 512), dtype=nl.float32, buffer=nl.sbuf, name="ones")
    nisa.memset(dst=ones, value=1.0)
    for r in range(2):
        rows = nl.ds(r * 128, 128)
        t = nl.ndarray(shape=(128, 512), dtype=nl.float32, buffer=nl.sbuf, name="t")
        nisa.dma_copy(dst=t, src=x[rows, :])
        o = nl.ndarray(shape=(128, 512), dtype=nl.float32, buffer=nl.sbuf, name="o")
        nisa.tensor_tensor_scan(dst=o, data0=ones, data1=t, initial=0.0, op0=nl.multiply, op1=nl.add)
        nisa.dma_copy(dst=y[rows, :], src=o)
    return y
'''

TOPK = HEADER + '''

@nki.jit
def topk(x):
    values = nl.ndarray(shape=(256, 8), dtype=nl.float32, buffer=nl.shared_hbm, name="values")
    indices = nl.ndarray(shape=(256, 8), dtype=nl.int32, buffer=nl.shared_hbm, name="indices")
    for r in range(2):
        rows = nl.ds(r * 128, 128)
        t = nl.ndarray(shape=(128, 512), dtype=nl.float32, buffer=nl.sbuf, name="t")
        nisa.dma_copy(dst=t, src=x[rows, :])
        v = nl.ndarray(shape=(128, 8), dtype=nl.float32, buffer=nl.sbuf, name="v")
        nisa.max8(dst=v, src=t)
        i = nl.ndarray(shape=(128, 8), dtype=nl.uint32, buffer=nl.sbuf, name="i")
        nisa.nc_find_index8(dst=i, data=t, vals=v)
        i32 = nl.ndarray(shape=(128, 8), dtype=nl.int32, buffer=nl.sbuf, name="i32")
        nisa.tensor_copy(dst=i32, src=i)
        nisa.dma_copy(dst=values[rows, :], src=v)
        nisa.dma_copy(dst=indices[rows, :], src=i32)
    return values, indices
'''

GATHER_ROWS = HEADER + '''

@nki.jit
def gather_rows(table, idx):
    y = nl.ndarray(shape=(256, 256), dtype=nl.float32, buffer=nl.shared_hbm, name="y")
    for r in range(2):
        it = nl.ndarray(shape=(128, 1), dtype=nl.int32, buffer=nl.sbuf, name="it")
        nisa.dma_copy(dst=it, src=idx.ap(pattern=[[1, 128], [1, 1]], offset=r * 128))
        g = nl.ndarray(shape=(128, 256), dtype=nl.float32, buffer=nl.sbuf, name="g")
        nisa.dma_copy(dst=g, src=table.ap(pattern=[[256, 128], [1, 256]], offset=0, vector_offset=it,
                                           indirect_dim=0))
        nisa.dma_copy(dst=y[nl.ds(r * 128, 128), :], src=g)
    return y
'''

KV_ROW_WRITE = HEADER + '''

@nki.jit
def kv_row_write(cache, k, pos):
    pt = nl.ndarray(shape=(1, 4), dtype=nl.int32, buffer=nl.sbuf, name="pt")
    nisa.dma_copy(dst=pt, src=pos.ap(pattern=[[4, 1], [1, 4]], offset=0))
    for b in range(4):
        kt = nl.ndarray(shape=(8, 64), dtype=nl.bfloat16, buffer=nl.sbuf, name="kt")
        nisa.dma_copy(dst=kt, src=k[b])
        nisa.dma_copy(dst=cache.ap(pattern=[[256 * 64, 8], [1, 64]], offset=b * 8 * 256 * 64,
                                   scalar_offset=pt[0:1, b:b + 1], indirect_dim=2), src=kt)
    return cache
'''

SOLUTIONS: dict[str, str] = {
    "scale_matrix": SCALE_MATRIX,
    "elementwise_chain": ELEMENTWISE_CHAIN,
    "row_softmax": _row_softmax(1),
    "rmsnorm": _rmsnorm(1),
    "layernorm": LAYERNORM,
    "silu_gate": SILU_GATE,
    "gelu_tanh_gate": GELU_TANH_GATE,
    "matmul_psum": _matmul_psum(1),
    "transpose": TRANSPOSE,
    "cumsum": CUMSUM,
    "topk": TOPK,
    "gather_rows": GATHER_ROWS,
    "kv_row_write": KV_ROW_WRITE,
    "row_softmax_lnc2": _row_softmax(2),
    "rmsnorm_lnc2": _rmsnorm(2),
    "matmul_psum_lnc2": _matmul_psum(2),
}
