"""Recognize Keras's attention idioms in StableHLO, whose PyTorch spelling is HF's ``[B, heads, T, D]`` layout.

keras-hub (``LlamaAttention``, ``MixtralAttention``) keeps q/k/v as ``[B, T, heads, D]``, rotates them with its
own ``rotate_half`` (``stack((-x2, x1), axis=-2)`` + reshape) and attends with ``jax.nn.dot_product_attention``
(``jnp.repeat``ed keys, einsums with the heads as a batch dim, a boolean ``where`` mask). These functions read
the StableHLO producers of a value (never the names JAX gives its private functions) and say what the HF form
needs; :mod:`.emit` writes that form (``rope``: ``x * cos + rotate_half(x) * sin`` on ``x.transpose(1, 2)``;
attention: ``repeat_kv``, ``q @ k^T * scale + mask``, ``softmax(fp32)``, ``@ v``, or HF's SDPA call when JAX keeps
bf16 scores in fp32), which computes the same values in another layout. Dims are tracked by label: ``B`` batch,
``H`` heads, ``T`` query tokens, ``L`` key positions, ``D`` head dim, ``U<i>`` size-1 dims (the ``G = 1`` group
axis of the grouped einsum).
"""
from __future__ import annotations

from dataclasses import dataclass
from .ir import Module, Op, Value


class _Walk:
    """Producers through inlined ``func.call``s: a callee's block argument resolves to the call's operand."""

    def __init__(self, module: Module) -> None:
        self.module = module
        self.args: dict[int, Value] = {}

    def op(self, v: Value) -> Op | None:
        while True:
            if v.producer is None:
                outer = self.args.get(id(v))
                if outer is None:
                    return None
                v = outer
                continue
            op = v.producer
            if op.name != "func.call":
                return op
            fn = self.module.functions.get(op.attrs.get("callee"))
            if fn is None:
                return None
            for a, o in zip(fn.body.args, op.operands):
                self.args[id(a)] = o
            v = fn.body.returns[op.results.index(v)]

    def outer(self, v: Value) -> Value:
        """The value itself, or the caller's operand for a callee's block argument."""
        while v.producer is None and id(v) in self.args:
            v = self.args[id(v)]
        return v

    def named(self, v: Value, name: str) -> Op | None:
        op = self.op(v)
        return op if op is not None and op.name == name else None

    def splat(self, v: Value) -> float | None:
        """The value of a splat constant through broadcasts/converts/reshapes (and call boundaries)."""
        op = self.op(v)
        while op is not None and op.name in ("stablehlo.broadcast_in_dim", "stablehlo.convert", "stablehlo.reshape"):
            op = self.op(op.operands[0])
        if op is None or op.name != "stablehlo.constant":
            return None
        from .idioms import is_splat

        if not is_splat(op.attrs["value"]):
            return None
        return float(op.attrs["value"].reshape(-1)[0])

    def through(self, v: Value, names: tuple[str, ...]) -> Value:
        op = self.op(v)
        while op is not None and op.name in names:
            v = op.operands[0]
            op = self.op(v)
        return v


# ---- RoPE ---------------------------------------------------------------------------------------------------
def _half_slice(op: Op | None, x: Value, lo: bool) -> bool:
    if op is None or op.name != "stablehlo.slice" or op.operands[0] is not x:
        return False
    shape = x.type.shape
    h = shape[-1] // 2
    want_start = 0 if lo else h
    want_limit = h if lo else shape[-1]
    starts, limits, strides = op.attrs["start_indices"], op.attrs["limit_indices"], op.attrs["strides"]
    return all(st == 1 for st in strides) and tuple(starts[:-1]) == (0,) * (len(shape) - 1) and \
        tuple(limits[:-1]) == tuple(shape[:-1]) and starts[-1] == want_start and limits[-1] == want_limit


def rotate_half_of(v: Value) -> Value | None:
    """Keras's ``rotate_half``: ``reshape(concatenate(bcast(-x[..., h:]), bcast(x[..., :h]), dim=-2))`` (a stack
    along a new axis before the last, flattened back): ``x``. That is ``cat((-x2, x1), -1)`` exactly."""
    reshape = v.producer
    if reshape is None or reshape.name != "stablehlo.reshape":
        return None
    cat = reshape.operands[0].producer
    if cat is None or cat.name != "stablehlo.concatenate" or len(cat.operands) != 2:
        return None
    rank = len(v.type.shape)
    if cat.attrs["dimension"] != rank - 1 or len(cat.result.type.shape) != rank + 1:
        return None
    parts = []
    for operand in cat.operands:
        b = operand.producer
        if b is None or b.name != "stablehlo.broadcast_in_dim" or \
                tuple(b.attrs["broadcast_dimensions"]) != tuple(d for d in range(rank + 1) if d != rank - 1):
            return None
        parts.append(b.operands[0])
    neg = parts[0].producer
    if neg is None or neg.name != "stablehlo.negate":
        return None
    hi = neg.operands[0].producer
    x = hi.operands[0] if hi is not None and hi.name == "stablehlo.slice" else None
    if x is None or x.type.shape != v.type.shape or x.type.shape[-1] % 2:
        return None
    if not _half_slice(hi, x, lo=False) or not _half_slice(parts[1].producer, x, lo=True):
        return None
    return x


def rope_of(add: Op) -> tuple[Value, Value, Value] | None:
    """``x * cos + rotate_half(x) * sin`` with Keras's ``rotate_half`` on a 4-d ``[B, T, H, D]`` value:
    (x, cos, sin)."""
    if len(add.result.type.shape) != 4:
        return None
    for m1, m2 in ((add.operands[0], add.operands[1]), (add.operands[1], add.operands[0])):
        a, b = m1.producer, m2.producer
        if a is None or b is None or a.name != "stablehlo.multiply" or b.name != "stablehlo.multiply":
            continue
        for r, s in ((b.operands[0], b.operands[1]), (b.operands[1], b.operands[0])):
            x = rotate_half_of(r)
            if x is None:
                continue
            if a.operands[0] is x:
                return x, a.operands[1], s
            if a.operands[1] is x:
                return x, a.operands[0], s
    return None


def _product(v: Value) -> tuple[Value, Value] | None:
    op = v.producer
    return (op.operands[0], op.operands[1]) if op is not None and op.name == "stablehlo.multiply" else None


def _times(v: Value, x: Value) -> Value | None:
    """The other factor of ``v = x * t`` (either order), else ``None``."""
    p = _product(v)
    if p is None:
        return None
    return p[1] if p[0] is x else p[0] if p[1] is x else None


def _broadcast_key(v: Value) -> tuple:
    """``v`` up to the ``broadcast_in_dim`` ops that make it (JAX broadcasts a table again for every use):
    (source value, where its dims land, the shape)."""
    dims = list(range(len(v.type.shape)))
    shape = tuple(v.type.shape)
    op = v.producer
    while op is not None and op.name == "stablehlo.broadcast_in_dim":
        dims = [dims[d] for d in op.attrs["broadcast_dimensions"]]
        v = op.operands[0]
        op = v.producer
    return id(v), tuple(dims), shape


def _same(a: Value | None, b: Value) -> bool:
    return a is not None and (a is b or _broadcast_key(a) == _broadcast_key(b))


def split_rope_of(cat: Op) -> tuple[Value, Value, Value] | None:
    """The split-half rotary embedding JAX code writes, ``x1, x2 = x[..., :h], x[..., h:]`` and
    ``concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)`` with half tables ``cos``/``sin``, on a 4-d
    ``[B, T, H, D]`` value: (x, cos, sin). Per element that is HF's ``x * cat(cos, cos) + rotate_half(x) *
    cat(sin, sin)`` (``a - b`` is ``a + (-b)`` exactly)."""
    if cat.name != "stablehlo.concatenate" or len(cat.operands) != 2 or len(cat.result.type.shape) != 4 or \
            cat.attrs["dimension"] != 3:
        return None
    lo, hi = (o.producer for o in cat.operands)
    if lo is None or hi is None or lo.name != "stablehlo.subtract" or hi.name != "stablehlo.add":
        return None
    a, b = lo.operands  # x1 * cos, x2 * sin
    pa, pb = _product(a), _product(b)
    if pa is None or pb is None:
        return None
    for x1, cos in (pa, pa[::-1]):
        s1 = x1.producer
        if s1 is None or s1.name != "stablehlo.slice":
            continue
        x = s1.operands[0]
        if x.type.shape != cat.result.type.shape or not _half_slice(s1, x, lo=True):
            continue
        for x2, sin in (pb, pb[::-1]):
            if x2.producer is None or not _half_slice(x2.producer, x, lo=False):
                continue
            # the second half: x2 * cos + x1 * sin, in either order
            for c_term, s_term in ((hi.operands[0], hi.operands[1]), (hi.operands[1], hi.operands[0])):
                if _same(_times(c_term, x2), cos) and _same(_times(s_term, x1), sin):
                    return x, cos, sin
    return None


# ---- attention ----------------------------------------------------------------------------------------------
@dataclass
class Attention:
    """What the HF form of one decode attention needs, by StableHLO value (``outer`` values of the function
    being emitted) and dim labels."""

    q: Value
    q_labels: list[str]
    k: Value  # the unrepeated keys, labels [B, L, H, D]
    v: Value
    groups: int  # how often keys and values are repeated
    scale: float
    pred: Value  # the boolean mask (True = attend), labels ``mask_labels``
    mask_labels: list[str]
    fill: float
    out_labels: list[str]
    score_dtype: str  # the element type the scores are computed in (Keras: f32 also for bf16 q/k)
    softmax_dtype: str = ""  # the element type the masked scores enter the softmax in
    scores_converted: bool = False  # a convert between the scaled scores and the mask (a rounding step)
    probs_dtype: str = ""  # the element type of the probabilities the values are weighted with
    q_groups: int = 1  # the size of q's ``G`` dim (grouped einsum ``btkgd,bskd->bkgts``: heads = KV * G)


def _repeat_of(w: _Walk, v: Value) -> tuple[Value, int] | None:
    """``jnp.repeat(k, n, axis=2)`` on ``[B, L, KV, D]`` (``broadcast_in_dim`` to ``[B, L, KV, n, D]`` +
    reshape), or ``k`` itself (n = 1): (k, n)."""
    if len(v.type.shape) != 4:
        return None
    reshape = w.named(v, "stablehlo.reshape")
    if reshape is None:
        return w.outer(v), 1
    b = w.named(reshape.operands[0], "stablehlo.broadcast_in_dim")
    if b is None or tuple(b.attrs["broadcast_dimensions"]) != (0, 1, 2, 4):
        return None
    k = b.operands[0]
    bs = b.result.type.shape
    if len(k.type.shape) != 4 or tuple(bs[:3]) != tuple(k.type.shape[:3]) or bs[4] != k.type.shape[3]:
        return None
    return w.outer(k), bs[3]


def _dot(op: Op) -> tuple[tuple, tuple, tuple, tuple]:
    dn = op.attrs["dot_dimension_numbers"]
    return dn["lhs_batch"], dn["rhs_batch"], dn["lhs_contract"], dn["rhs_contract"]


def _free(rank: int, *used: tuple) -> list[int]:
    taken = {d for u in used for d in u}
    return [d for d in range(rank) if d not in taken]


def _result_labels(op: Op, lhs: list[str], rhs: list[str]) -> list[str]:
    lb, rb, lc, rc = _dot(op)
    return [lhs[d] for d in lb] + [lhs[d] for d in _free(len(lhs), lb, lc)] + [rhs[d] for d in _free(len(rhs), rb, rc)]


KV_LABELS = ["B", "L", "H", "D"]


def _scores(w: _Walk, s_op: Op) -> tuple[Value, list[str], Value, int, list[str]] | None:
    """``q . repeat(k)`` over D with (B, heads) as batch dims: (q, q labels, k, groups, score labels)."""
    lb, rb, lc, rc = _dot(s_op)
    if len(lc) != 1 or len(lb) != 2:
        return None
    for qi, ki in ((0, 1), (1, 0)):
        qv, kv = s_op.operands[qi], s_op.operands[ki]
        (qb, kb), (qc, kc) = ((lb, rb), (lc, rc)) if qi == 0 else ((rb, lb), (rc, lc))
        rep = _repeat_of(w, kv)
        if rep is None or _free(4, kb, kc) != [1] or kc != (3,) or sorted(kb) != [0, 2]:
            continue
        k_labels = KV_LABELS
        q_labels: list[str | None] = [None] * len(qv.type.shape)
        q_labels[qc[0]] = "D"
        for a, b in zip(qb, kb):
            q_labels[a] = k_labels[b]
        free = [d for d, lab in enumerate(q_labels) if lab is None]
        h = q_labels.index("H")
        if h + 1 in free and qv.type.shape[h + 1] != 1 and (len(free) == 2 or rep[1] == 1):
            # grouped einsum (``btkgd,bskd->bkgts``; ``kgd,skd->kgs`` vmap'ed, without a token dim): the dim after
            # the KV heads is the group of query heads that share one KV head (head kv * G + g, as
            # ``jnp.repeat``/HF's repeat_kv pair them). Any labelling is the same arithmetic; this one keeps the
            # query-token dim (1 in a decode step) apart from the heads
            q_labels[h + 1] = "G"
            free.remove(h + 1)
        big = [d for d in free if qv.type.shape[d] != 1]
        if len(big) > 1:
            return None
        if free:  # else no query-token dim: one token per sequence (a vmap'ed single-token step)
            t = big[0] if big else free[0]
            for i, d in enumerate(free):
                q_labels[d] = "T" if d == t else f"U{i}"
        ql = [str(x) for x in q_labels]
        labels = _result_labels(s_op, ql, k_labels) if qi == 0 else _result_labels(s_op, k_labels, ql)
        return qv, ql, rep[0], rep[1], labels
    return None


def attention_of(module: Module, op2: Op) -> Attention | None:
    """``dot_general(repeat(v), softmax(where(mask, (q . repeat(k)) * scale, fill)))`` (either operand order,
    any batch/free dim order, transposes and converts between the steps): what jax.nn.dot_product_attention
    (keras's ``ops.dot_product_attention``) lowers to."""
    if op2.name != "stablehlo.dot_general":
        return None
    w = _Walk(module)
    lb, rb, lc, rc = _dot(op2)
    if len(lc) != 1 or len(lb) != 2:
        return None
    for pi in (0, 1):
        pv, vv = op2.operands[pi], op2.operands[1 - pi]
        probs_dtype = pv.type.dtype
        pv = w.through(pv, ("stablehlo.convert",))
        post = w.named(pv, "stablehlo.select")  # keras.layers.Softmax zeroes masked probabilities again
        if post is not None and w.splat(post.operands[2]) == 0.0:
            pv = w.through(post.operands[1], ("stablehlo.convert",))
        div = w.named(pv, "stablehlo.divide")
        if div is None:
            continue
        sm = _softmax(w, div)
        if sm is None:
            continue
        x, dim = sm
        sel = w.named(x, "stablehlo.select")
        if sel is None:
            continue
        fill = w.splat(sel.operands[2])
        pred, pred_dims = _mask_source(w, sel.operands[0])
        if fill is None or (post is not None and _mask_source(w, post.operands[0])[0] is not pred):
            continue
        chain: list[Op] = []
        y = sel.operands[1]
        op = w.op(y)
        while op is not None and op.name in ("stablehlo.transpose", "stablehlo.convert"):
            chain.append(op)
            op = w.op(op.operands[0])
        found = _scaled(w, op) if op is not None else None
        if found is None:
            continue
        s_op, scale, inner = found
        scores = _scores(w, s_op)
        if scores is None:
            continue
        qv, q_labels, k, groups, labels = scores
        for c in reversed(inner + chain):  # from the scores up to the mask's operand
            if c.name == "stablehlo.transpose":
                labels = [labels[d] for d in c.attrs["permutation"]]
        if labels[dim] != "L":
            continue
        # P . repeat(v) over L, with (B, H) batch
        (pb, vb), (pc, vc) = ((lb, rb), (lc, rc)) if pi == 0 else ((rb, lb), (rc, lc))
        rep = _repeat_of(w, vv)
        if rep is None or rep[1] != groups or pc != (dim,) or vc != (1,) or sorted(vb) != [0, 2] or \
                [labels[a] for a in pb] != [KV_LABELS[b] for b in vb]:
            continue
        out = _result_labels(op2, labels, KV_LABELS) if pi == 0 else _result_labels(op2, KV_LABELS, labels)
        q_groups = qv.type.shape[q_labels.index("G")] if "G" in q_labels else 1
        if sorted(x for x in out if not x.startswith("U")) != \
                sorted(["B", "D", "H"] + ["T"] * ("T" in q_labels) + ["G"] * ("G" in q_labels)):
            continue
        if q_groups > 1 and groups > 1:  # repeated keys and grouped queries at once: not a form JAX code writes
            continue
        return Attention(q=w.outer(qv), q_labels=q_labels, k=k, v=rep[0], groups=groups, scale=scale,
                         pred=pred, mask_labels=[labels[d] for d in pred_dims], fill=fill, out_labels=out,
                         score_dtype=s_op.result.type.dtype, softmax_dtype=x.type.dtype,
                         scores_converted=any(c.name == "stablehlo.convert" for c in chain),
                         probs_dtype=probs_dtype, q_groups=q_groups)
    return None


def _scaled(w: _Walk, op: Op) -> tuple[Op, float, list[Op]] | None:
    """``dot_general * scale`` (or ``/ c`` with ``c`` a power of two, whose reciprocal is exact: the same
    products), with transposes between the scores and the scaling: (scores op, scale, those transposes)."""
    import math

    if op.name not in ("stablehlo.multiply", "stablehlo.divide"):
        return None
    for si in ((0, 1) if op.name == "stablehlo.multiply" else (0,)):
        c = w.splat(op.operands[1 - si])
        if c is None:
            continue
        if op.name == "stablehlo.divide":
            if c == 0 or not math.isfinite(c) or math.frexp(c)[0] != 0.5:
                return None
            c = 1.0 / c
        inner: list[Op] = []
        t = w.op(op.operands[si])
        while t is not None and t.name == "stablehlo.transpose":
            inner.append(t)
            t = w.op(t.operands[0])
        if t is not None and t.name == "stablehlo.dot_general":
            return t, c, inner
    return None


def _mask_source(w: _Walk, v: Value) -> tuple[Value, list[int]]:
    """A mask through its ``broadcast_in_dim``s (``jnp.where(allowed[L], scores, fill)`` broadcasts ``[L]`` to the
    scores' shape): (the caller's value, the dim of ``v`` each of its dims is).  Same-rank broadcasts (size-1
    dims expanded) keep every dim."""
    dims = list(range(len(v.type.shape)))
    op = w.op(v)
    while op is not None and op.name == "stablehlo.broadcast_in_dim":
        bd = op.attrs["broadcast_dimensions"]
        dims = [dims[d] for d in bd]
        v = op.operands[0]
        op = w.op(v)
    return w.outer(v), dims


def _softmax(w: _Walk, divide: Op) -> tuple[Value, int] | None:
    """:func:`.idioms.softmax_of` through call boundaries (the same structure, with this walk's producers)."""
    e, s = divide.operands
    exp = w.named(e, "stablehlo.exponential")
    r_sum = _reduce(w, s, "sum")
    if exp is None or r_sum is None or w.outer(r_sum.operands[0]) is not w.outer(e) or \
            len(r_sum.attrs["dimensions"]) != 1:
        return None
    sub = w.named(exp.operands[0], "stablehlo.subtract")
    if sub is None:
        return None
    x, m = sub.operands
    guard = w.named(w.through(m, ("stablehlo.broadcast_in_dim",)), "stablehlo.maximum")
    if guard is not None:
        a, b = guard.operands
        m = b if w.splat(a) == float("-inf") else a if w.splat(b) == float("-inf") else m
    r_max = _reduce(w, m, "max")
    if r_max is None or w.outer(r_max.operands[0]) is not w.outer(x) or \
            r_max.attrs["dimensions"] != r_sum.attrs["dimensions"] or w.splat(r_sum.operands[1]) != 0.0:
        return None
    return x, r_sum.attrs["dimensions"][0]


def _reduce(w: _Walk, v: Value, kind: str) -> Op | None:
    from .idioms import reduce_kind

    op = w.op(w.through(v, ("stablehlo.broadcast_in_dim",)))
    if op is not None and op.name == "stablehlo.reshape":
        op = w.op(op.operands[0])
    return op if op is not None and op.name == "stablehlo.reduce" and reduce_kind(op) == kind else None


def label_positions(labels: list[str], wanted: list[str]) -> list[int] | None:
    """Where each wanted label sits (``None`` if one is missing)."""
    try:
        return [labels.index(x) for x in wanted]
    except ValueError:
        return None


# ---- dense MoE experts --------------------------------------------------------------------------------------
@dataclass
class DenseExperts:
    """keras-hub's ``MixtralSparseMoeBlock``: every expert on every token, weighted by a dense ``[E, T]`` routing
    (the top-k weights scattered with ``one_hot``), summed over experts. ``gate``/``up``/``down`` are the
    entry function's arguments ``[E, H, I]``, ``[E, H, I]``, ``[E, I, H]``."""

    reduce: Op
    x: Value  # [T, H]
    indices: Value  # [T, K]
    weights: Value  # [T, K]
    gate: Value
    up: Value
    down: Value


def _expert_proj(w: _Walk, v: Value, x: Value | None) -> tuple[Value, Value] | None:
    """``transpose(dot_general(W[E, H, I], x[T, H]) over H, [0, 2, 1])`` = einsum ``th,ehm->etm``: (W, x)."""
    t = w.named(v, "stablehlo.transpose")
    if t is None or tuple(t.attrs["permutation"]) != (0, 2, 1):
        return None
    d = w.named(t.operands[0], "stablehlo.dot_general")
    if d is None or _dot(d) != ((), (), (1,), (1,)):
        return None
    W, xx = d.operands
    if len(W.type.shape) != 3 or len(xx.type.shape) != 2 or (x is not None and w.outer(xx) is not x):
        return None
    return W, w.outer(xx)


def _routing(w: _Walk, v: Value, experts: int) -> tuple[Value, Value] | None:
    """``transpose(sum(one_hot(idx, E) * weights[..., None], axis=1))`` ([E, T]): (idx, weights)."""
    t = w.named(v, "stablehlo.transpose")
    if t is None or tuple(t.attrs["permutation"]) != (1, 0):
        return None
    r = w.op(t.operands[0])
    from .idioms import reduce_kind

    dtype = v.type.dtype
    if r is not None and r.name == "stablehlo.convert":  # bf16: the sum over k in fp32, rounded back (exact)
        r = w.op(r.operands[0])
    if r is None or r.name != "stablehlo.reduce" or reduce_kind(r) != "sum" or tuple(r.attrs["dimensions"]) != (1,) \
            or w.splat(r.operands[1]) != 0.0:
        return None
    m = w.op(r.operands[0])
    if m is not None and m.name == "stablehlo.convert" and r.operands[0].type.dtype == "f32":
        m = w.op(m.operands[0])  # the bf16 products widened to fp32 (exact)
    if m is None or m.name != "stablehlo.multiply":
        return None
    for a, b in ((m.operands[0], m.operands[1]), (m.operands[1], m.operands[0])):
        idx = _one_hot(w, a, experts)
        if idx is None:
            continue
        weights = w.through(b, ("stablehlo.broadcast_in_dim",))
        bc = w.named(b, "stablehlo.broadcast_in_dim")
        # one nonzero term per expert (distinct top-k experts): the routing is a weight exactly when it is in the
        # weights' own dtype
        if bc is None or weights.type.shape != idx.type.shape or weights.type.dtype != dtype:
            continue
        return idx, w.outer(weights)
    return None


def _one_hot(w: _Walk, v: Value, experts: int) -> Value | None:
    """``jax.nn.one_hot(idx, E)``: ``convert(idx[..., None] == iota(E))``: idx ``[T, K]``."""
    conv = w.named(v, "stablehlo.convert")
    inner = w.named(conv.operands[0], "stablehlo.convert") if conv is not None else None
    if inner is not None:  # bf16: the fp32 one-hot converted again (0 and 1: exact)
        conv = inner
    cmp = w.named(conv.operands[0], "stablehlo.compare") if conv is not None else None
    if cmp is None or cmp.attrs["comparison_direction"] != "EQ" or len(v.type.shape) != 3 or v.type.shape[2] != experts:
        return None
    for a, b in ((cmp.operands[0], cmp.operands[1]), (cmp.operands[1], cmp.operands[0])):
        iota = w.named(w.through(b, ("stablehlo.broadcast_in_dim",)), "stablehlo.iota")
        if iota is None or iota.attrs["iota_dimension"] != len(iota.result.type.shape) - 1 or \
                iota.result.type.shape[-1] != experts:
            continue
        idx = w.outer(w.through(a, ("stablehlo.broadcast_in_dim",)))
        if len(idx.type.shape) == 2 and tuple(idx.type.shape) == tuple(v.type.shape[:2]):
            return idx
    return None


def dense_experts_of(module: Module, op: Op) -> DenseExperts | None:
    """``sum_e routing[e, t] * down_e(silu(gate_e x) * up_e x)`` as keras-hub's Mixtral writes it (see
    :class:`DenseExperts`), with the three weights arguments of the entry function read only here."""
    from .idioms import reduce_kind, silu_of

    rounded = None  # bf16/fp16: ``convert(sum(convert(products, f32)), dtype)``, what HF's bf16 ``sum`` computes
    if op.name == "stablehlo.convert" and op.result.type.dtype in ("bf16", "f16") and \
            op.operands[0].type.dtype == "f32" and op.operands[0].producer is not None and \
            len(op.operands[0].users) == 1:
        rounded, op = op.result.type.dtype, op.operands[0].producer
    if op.name != "stablehlo.reduce" or reduce_kind(op) != "sum" or tuple(op.attrs["dimensions"]) != (0,):
        return None
    w = _Walk(module)
    if w.splat(op.operands[1]) != 0.0:
        return None
    src = op.operands[0]
    if rounded is not None:
        up = w.named(src, "stablehlo.convert")
        if up is None or up.operands[0].type.dtype != rounded:
            return None
        src = up.operands[0]
    m = w.named(src, "stablehlo.multiply")
    if m is None:
        return None
    entry = module.entry.body.args
    for a, b in ((m.operands[0], m.operands[1]), (m.operands[1], m.operands[0])):
        d = w.named(a, "stablehlo.dot_general")
        if d is None or _dot(d) != ((0,), (0,), (2,), (1,)):
            continue
        hidden, down = d.operands
        experts = down.type.shape[0]
        bc = w.named(b, "stablehlo.broadcast_in_dim")
        routing = _routing(w, w.through(b, ("stablehlo.broadcast_in_dim",)), experts) if bc is not None else None
        if routing is None:
            continue
        prod = w.named(hidden, "stablehlo.multiply")
        if prod is None:
            continue
        for u, g in ((prod.operands[0], prod.operands[1]), (prod.operands[1], prod.operands[0])):
            act = w.op(g)
            gx = None
            if act is not None and act.name == "stablehlo.multiply" and rounded is None:
                gx = silu_of(act)
                gx = w.outer(gx) if gx is not None else None
            elif act is not None and act.name == "stablehlo.convert" and rounded is not None:
                gx = fp32_silu_of(module, act)  # Keras's bf16 silu: fp32 inside, one rounding (F.silu)
            if gx is None:
                continue
            gate = _expert_proj(w, gx, None)
            up = _expert_proj(w, u, gate[1]) if gate is not None else None
            if gate is None or up is None:
                continue
            weights = (gate[0], up[0], down)
            if any(x.producer is not None or x not in entry or len(x.users) != 1 for x in weights):
                continue
            e, h, i = gate[0].type.shape
            if up[0].type.shape != (e, h, i) or down.type.shape != (e, i, h) or e != experts:
                continue
            return DenseExperts(reduce=op, x=gate[1], indices=routing[0], weights=routing[1], gate=gate[0],
                                up=up[0], down=down)
    return None


def dense_experts(module: Module) -> list[DenseExperts]:
    """Every :func:`dense_experts_of` in the entry function (decided before emission: their weights are
    presented to the program in HF's fused ``[E, 2I, H]`` / ``[E, H, I]`` layout)."""
    found = []
    for op in module.entry.body.ops:
        if op.name in ("stablehlo.reduce", "stablehlo.convert"):
            e = dense_experts_of(module, op)
            if e is not None:
                found.append(e)
    return found


# ---- RoPE tables --------------------------------------------------------------------------------------------
@dataclass(eq=False)
class RopeTable:
    """keras-hub's rotary table: ``cos``/``sin`` of ``cat(freqs, freqs)`` with ``freqs = outer(iota(T) +
    start_index, inv_freq)`` (``RotaryEmbedding._compute_cos_sin_embedding``), ``inv_freq`` computed from
    constants only (``iota``, ``power``...)."""

    op: Op  # the cosine or sine
    inv_freq: Value  # [F], from constants only
    start: Value  # the scalar start index (integer), as the caller's value
    tokens: int
    dims: tuple[int, ...]  # where the table's [B=1, T, 2F] dims sit in the op's result


def _stacked_pair(w: _Walk, v: Value) -> Value | None:
    """``reshape(concatenate(bcast(f), bcast(f), dim=-2))`` (stack of one value with itself, flattened): f,
    which makes it ``cat((f, f), -1)``."""
    r = w.named(v, "stablehlo.reshape")
    cat = w.named(r.operands[0], "stablehlo.concatenate") if r is not None else None
    if cat is None or len(cat.operands) != 2:
        return None
    rank = len(v.type.shape)
    if cat.attrs["dimension"] != rank - 1 or len(cat.result.type.shape) != rank + 1:
        return None
    srcs = []
    for operand in cat.operands:
        b = w.named(operand, "stablehlo.broadcast_in_dim")
        if b is None or tuple(b.attrs["broadcast_dimensions"]) != tuple(d for d in range(rank + 1) if d != rank - 1):
            return None
        srcs.append(b.operands[0])
    if srcs[0] is not srcs[1] or tuple(srcs[0].type.shape[:-1]) != tuple(v.type.shape[:-1]) or \
            2 * srcs[0].type.shape[-1] != v.type.shape[-1]:
        return None
    return srcs[0]


def constant_cone(w: _Walk, v: Value, limit: int = 64) -> list[Op] | None:
    """The ops computing ``v`` from constants only (in a topological order), or ``None``."""
    allowed = {"stablehlo.constant", "stablehlo.iota", "stablehlo.broadcast_in_dim", "stablehlo.convert",
               "stablehlo.reshape", "stablehlo.add", "stablehlo.multiply", "stablehlo.divide", "stablehlo.power",
               "stablehlo.subtract", "stablehlo.negate", "stablehlo.exponential", "stablehlo.log"}
    order: list[Op] = []
    seen: set[int] = set()

    def visit(x: Value) -> bool:
        op = x.producer
        if op is None or op.name not in allowed:
            return False
        if id(op) in seen:
            return True
        seen.add(id(op))
        if len(seen) > limit or not all(visit(o) for o in op.operands):
            return False
        order.append(op)
        return True

    return order if visit(v) else None


def rope_table_of(module: Module, op: Op) -> RopeTable | None:
    """See :class:`RopeTable`: ``cosine``/``sine`` of the broadcast ``cat(freqs, freqs)``."""
    if op.name not in ("stablehlo.cosine", "stablehlo.sine"):
        return None
    w = _Walk(module)
    b = w.named(op.operands[0], "stablehlo.broadcast_in_dim")
    emb = b.operands[0] if b is not None else op.operands[0]
    dims = tuple(b.attrs["broadcast_dimensions"]) if b is not None else tuple(range(len(emb.type.shape)))
    if len(emb.type.shape) != 3 or emb.type.shape[0] != 1 or emb.type.dtype != "f32" or \
            any(op.result.type.shape[d] != n for d, n in zip(dims, emb.type.shape)):
        return None
    freqs = _stacked_pair(w, emb)
    outer = w.named(freqs, "stablehlo.dot_general") if freqs is not None else None
    if outer is None or _dot(outer) != ((), (), (), ()):
        return None
    pos, inv = outer.operands
    if len(inv.type.shape) != 1 or tuple(pos.type.shape) != tuple(emb.type.shape[:2]) or constant_cone(w, inv) is None:
        return None
    pb = w.named(pos, "stablehlo.broadcast_in_dim")  # [T] -> [1, T]
    add = w.named(pb.operands[0], "stablehlo.add") if pb is not None and \
        tuple(pb.attrs["broadcast_dimensions"]) == (1,) else None
    if add is None:
        return None
    for a, s in ((add.operands[0], add.operands[1]), (add.operands[1], add.operands[0])):
        iota = w.named(a, "stablehlo.iota")
        start = w.through(s, ("stablehlo.broadcast_in_dim",))
        conv = w.named(start, "stablehlo.convert")
        if iota is None or conv is None or conv.operands[0].type.shape != () or \
                not conv.operands[0].type.dtype.startswith("i"):
            continue
        return RopeTable(op=op, inv_freq=inv, start=w.outer(conv.operands[0]), tokens=iota.result.type.shape[0],
                         dims=dims)
    return None


def inv_freq_cone(module: Module, table: RopeTable) -> list[Op] | None:
    """The constant-only ops that compute a table's ``inv_freq``."""
    return constant_cone(_Walk(module), table.inv_freq)


def rope_tables(module: Module) -> list[RopeTable]:
    """Every :func:`rope_table_of` in the entry function (their ``inv_freq`` is folded before tracing)."""
    return [t for t in (rope_table_of(module, op) for op in module.entry.body.ops) if t is not None]


# ---- SiLU computed in fp32 ----------------------------------------------------------------------------------
def fp32_silu_of(module: Module, convert: Op) -> Value | None:
    """``convert(silu(convert(x, f32)), dtype(x))`` with ``x`` bf16/fp16 (Keras's ``ops.silu`` under a bf16
    policy, ``jax.nn.silu`` through a ``func.call``): ``x`` as the caller's value. That is one rounding of the
    fp32 SiLU, which is what PyTorch's (and the kernel's) bf16 ``silu`` computes: ``F.silu(x)``."""
    from .idioms import silu_of

    if convert.name != "stablehlo.convert" or convert.result.type.dtype not in ("bf16", "f16") or \
            convert.operands[0].type.dtype != "f32":
        return None
    w = _Walk(module)
    m = w.named(convert.operands[0], "stablehlo.multiply")
    x32 = silu_of(m) if m is not None else None
    if x32 is None:
        return None
    up = w.named(x32, "stablehlo.convert")
    if up is None or up.operands[0].type.dtype != convert.result.type.dtype or \
            tuple(up.operands[0].type.shape) != tuple(convert.result.type.shape):
        return None
    return w.outer(up.operands[0])
