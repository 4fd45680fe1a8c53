"""JAX decode steps written the way JAX users write them, through ``fusegraph.jax.jit`` (issue 27): plain
``jax.numpy`` with and without a batch dimension, a ``jax.vmap``'ed single-sequence step, Equinox and Flax NNX.

Each is a complete decoder step with random weights (embedding, RMSNorm, grouped-query attention over a static KV
cache written at ``pos``, SwiGLU MLP, final norm, LM head) run for several greedy steps through ``fj.jit`` and
``jax.jit``: the tokens are identical, logits and cache close, every step is one kernel launch, no fusegraph
warning (warnings are errors), every op of the step in the kernel's region (coverage 1.0), and the built-in patterns
each idiom is expected to match (``EXPECTED``). Below them, the importer's translations the idioms need, each
checked against ``jax.jit`` on small functions, in and out of range.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest

pytest.importorskip("jaxlib")  # not "jax": tests/jax itself would satisfy that
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fusegraph.jax as fj  # noqa: E402

from jax_helpers import aten_ops, check_against_jax, run_imported  # noqa: E402

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MAX_LEN = 512, 128, 256, 2, 4, 2, 64, 16
GROUPS = HEADS // KV_HEADS
THETA, EPS = 10000.0, 1e-6
BATCH, PROMPT, STEPS = 2, 5, 5


@dataclass
class Idiom:
    """A decode step ``step(params, cache, token, pos) -> (logits, cache)`` and its first inputs."""

    step: Callable[..., Any]
    params: Any
    cache: Any
    token: Any
    pos: Any
    next_token: Callable[[Any], Any]  # logits -> the next step's token argument
    next_pos: Callable[[Any], Any]


def _normal(rng, *shape, std=0.02):
    return jnp.asarray(rng.normal(0.0, std, shape).astype(np.float32))


def _dict_params(seed=0):
    """Weights ``[in, out]`` (used as ``x @ W``), norms around 1, one embedding table (tied LM head)."""
    rng = np.random.default_rng(seed)

    def norm():
        return jnp.asarray(1.0 + rng.normal(0.0, 0.1, (HIDDEN,)).astype(np.float32))

    layers = [{"attn_norm": norm(), "mlp_norm": norm(),
               "wq": _normal(rng, HIDDEN, HEADS * HEAD_DIM), "wk": _normal(rng, HIDDEN, KV_HEADS * HEAD_DIM),
               "wv": _normal(rng, HIDDEN, KV_HEADS * HEAD_DIM), "wo": _normal(rng, HEADS * HEAD_DIM, HIDDEN),
               "w_gate": _normal(rng, HIDDEN, INTER), "w_up": _normal(rng, HIDDEN, INTER),
               "w_down": _normal(rng, INTER, HIDDEN)} for _ in range(LAYERS)]
    return {"embed": _normal(rng, VOCAB, HIDDEN, std=1.0), "layers": layers, "final_norm": norm()}


def rms_norm(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def rope(x, pos):
    """Split-half rotary embedding: ``x`` ``[..., T, N, D]``, ``pos`` ``[..., T]``."""
    half = x.shape[-1] // 2
    freq = 1.0 / THETA ** (jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
    angle = pos[..., None].astype(jnp.float32) * freq  # [..., T, D/2]
    sin, cos = jnp.sin(angle)[..., None, :], jnp.cos(angle)[..., None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# ---- (a) plain jax.numpy, batch dimension, sequence-major cache [B, L, KV, D] --------------------------------
def batched_step(params, cache, token, pos):
    """token ``[B, 1]``, pos a scalar (the batch decodes in lockstep); cache per layer ``(k, v)`` ``[B, L, KV, D]``."""
    b = token.shape[0]
    x = params["embed"][token]  # [B, 1, H]
    positions = jnp.full((b, 1), pos)
    mask = jnp.arange(MAX_LEN) <= pos  # [L]
    new_cache = []
    for layer, (k_cache, v_cache) in zip(params["layers"], cache):
        h = rms_norm(x, layer["attn_norm"])
        q = rope((h @ layer["wq"]).reshape(b, 1, HEADS, HEAD_DIM), positions)
        k = rope((h @ layer["wk"]).reshape(b, 1, KV_HEADS, HEAD_DIM), positions)
        v = (h @ layer["wv"]).reshape(b, 1, KV_HEADS, HEAD_DIM)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k, (0, pos, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v, (0, pos, 0, 0))
        new_cache.append((k_cache, v_cache))
        q = q.reshape(b, 1, KV_HEADS, GROUPS, HEAD_DIM)
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k_cache) / np.sqrt(HEAD_DIM).astype(np.float32)
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores, axis=-1)
        attn = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache).reshape(b, 1, HEADS * HEAD_DIM)
        x = x + attn @ layer["wo"]
        h = rms_norm(x, layer["mlp_norm"])
        x = x + (jax.nn.silu(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"]
    x = rms_norm(x, params["final_norm"])
    return x @ params["embed"].T, new_cache  # tied embeddings


def _batched_idiom(step=batched_step):
    cache = [(jnp.zeros((BATCH, MAX_LEN, KV_HEADS, HEAD_DIM)), jnp.zeros((BATCH, MAX_LEN, KV_HEADS, HEAD_DIM)))
             for _ in range(LAYERS)]
    token = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (BATCH, 1)).astype(np.int32))
    return Idiom(step, _dict_params(), cache, token, jnp.int32(0),
                 next_token=lambda logits: jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None],
                 next_pos=lambda pos: pos + 1)


# ---- (b) plain jax.numpy, one sequence (no batch dimension) ---------------------------------------------------
def single_step(params, cache, token, pos):
    """token and pos scalars; cache per layer ``(k, v)`` ``[L, KV, D]``; logits ``[V]``."""
    x = params["embed"][token]  # [H]
    mask = jnp.arange(MAX_LEN) <= pos
    new_cache = []
    for layer, (k_cache, v_cache) in zip(params["layers"], cache):
        h = rms_norm(x, layer["attn_norm"])
        q = rope((h @ layer["wq"]).reshape(1, HEADS, HEAD_DIM), pos[None])[0]
        k = rope((h @ layer["wk"]).reshape(1, KV_HEADS, HEAD_DIM), pos[None])
        v = (h @ layer["wv"]).reshape(1, KV_HEADS, HEAD_DIM)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k, (pos, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v, (pos, 0, 0))
        new_cache.append((k_cache, v_cache))
        q = q.reshape(KV_HEADS, GROUPS, HEAD_DIM)
        scores = jnp.einsum("kgd,skd->kgs", q, k_cache) / np.sqrt(HEAD_DIM).astype(np.float32)
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores, axis=-1)
        attn = jnp.einsum("kgs,skd->kgd", probs, v_cache).reshape(HEADS * HEAD_DIM)
        x = x + attn @ layer["wo"]
        h = rms_norm(x, layer["mlp_norm"])
        x = x + (jax.nn.silu(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"]
    x = rms_norm(x, params["final_norm"])
    return x @ params["embed"].T, new_cache


def _single_idiom():
    cache = [(jnp.zeros((MAX_LEN, KV_HEADS, HEAD_DIM)), jnp.zeros((MAX_LEN, KV_HEADS, HEAD_DIM)))
             for _ in range(LAYERS)]
    return Idiom(single_step, _dict_params(), cache, jnp.int32(7), jnp.int32(0),
                 next_token=lambda logits: jnp.argmax(logits, -1).astype(jnp.int32),
                 next_pos=lambda pos: pos + 1)


# ---- (c) the single-sequence step, jax.vmap'ed over a batch (per-sequence positions) --------------------------
def vmapped_step(params, cache, token, pos):
    """token ``[B]``, pos ``[B]`` (each sequence at its own position); cache ``[B, L, KV, D]`` per layer."""
    return jax.vmap(single_step, in_axes=(None, 0, 0, 0))(params, cache, token, pos)


def _vmapped_idiom():
    cache = [(jnp.zeros((BATCH, MAX_LEN, KV_HEADS, HEAD_DIM)), jnp.zeros((BATCH, MAX_LEN, KV_HEADS, HEAD_DIM)))
             for _ in range(LAYERS)]
    return Idiom(vmapped_step, _dict_params(), cache, jnp.asarray([7, 300], jnp.int32), jnp.asarray([0, 0], jnp.int32),
                 next_token=lambda logits: jnp.argmax(logits, -1).astype(jnp.int32),
                 next_pos=lambda pos: pos + 1)


# ---- (d) Equinox: eqx.Module, eqx.nn.Linear / Embedding / RMSNorm, one sequence, `.at[pos].set` cache writes ----
def _equinox_idiom():
    eqx = pytest.importorskip("equinox")

    class Attention(eqx.Module):
        q: Any
        k: Any
        v: Any
        o: Any

        def __init__(self, key):
            kq, kk, kv, ko = jax.random.split(key, 4)
            self.q = eqx.nn.Linear(HIDDEN, HEADS * HEAD_DIM, use_bias=False, key=kq)
            self.k = eqx.nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, use_bias=False, key=kk)
            self.v = eqx.nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, use_bias=False, key=kv)
            self.o = eqx.nn.Linear(HEADS * HEAD_DIM, HIDDEN, use_bias=False, key=ko)

        def __call__(self, x, k_cache, v_cache, pos):
            q = rope(self.q(x).reshape(1, HEADS, HEAD_DIM), pos[None])[0]
            k = rope(self.k(x).reshape(1, KV_HEADS, HEAD_DIM), pos[None])[0]
            v = self.v(x).reshape(KV_HEADS, HEAD_DIM)
            k_cache = k_cache.at[pos].set(k)
            v_cache = v_cache.at[pos].set(v)
            q = q.reshape(KV_HEADS, GROUPS, HEAD_DIM)
            scores = jnp.einsum("kgd,skd->kgs", q, k_cache) * HEAD_DIM ** -0.5
            scores = jnp.where(jnp.arange(MAX_LEN) <= pos, scores, -1e9)
            probs = jax.nn.softmax(scores, axis=-1)
            return self.o(jnp.einsum("kgs,skd->kgd", probs, v_cache).reshape(-1)), k_cache, v_cache

    class MLP(eqx.Module):
        gate: Any
        up: Any
        down: Any

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.gate = eqx.nn.Linear(HIDDEN, INTER, use_bias=False, key=k1)
            self.up = eqx.nn.Linear(HIDDEN, INTER, use_bias=False, key=k2)
            self.down = eqx.nn.Linear(INTER, HIDDEN, use_bias=False, key=k3)

        def __call__(self, x):
            return self.down(jax.nn.silu(self.gate(x)) * self.up(x))

    class Block(eqx.Module):
        attn_norm: Any
        attn: Attention
        mlp_norm: Any
        mlp: MLP

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.attn_norm = eqx.nn.RMSNorm(HIDDEN, eps=EPS, use_bias=False)
            self.attn = Attention(k1)
            self.mlp_norm = eqx.nn.RMSNorm(HIDDEN, eps=EPS, use_bias=False)
            self.mlp = MLP(k2)

        def __call__(self, x, k_cache, v_cache, pos):
            a, k_cache, v_cache = self.attn(self.attn_norm(x), k_cache, v_cache, pos)
            x = x + a
            return x + self.mlp(self.mlp_norm(x)), k_cache, v_cache

    class Transformer(eqx.Module):
        embed: Any
        blocks: list
        norm: Any

        def __init__(self, key):
            keys = jax.random.split(key, LAYERS + 1)
            self.embed = eqx.nn.Embedding(VOCAB, HIDDEN, key=keys[0])
            self.blocks = [Block(k) for k in keys[1:]]
            self.norm = eqx.nn.RMSNorm(HIDDEN, eps=EPS, use_bias=False)

        def __call__(self, token, cache, pos):
            x = self.embed(token)
            new_cache = []
            for block, (k_cache, v_cache) in zip(self.blocks, cache):
                x, k_cache, v_cache = block(x, k_cache, v_cache, pos)
                new_cache.append((k_cache, v_cache))
            return self.norm(x) @ self.embed.weight.T, new_cache  # tied embeddings

    def step(model, cache, token, pos):
        return model(token, cache, pos)

    model = Transformer(jax.random.PRNGKey(0))
    cache = [(jnp.zeros((MAX_LEN, KV_HEADS, HEAD_DIM)), jnp.zeros((MAX_LEN, KV_HEADS, HEAD_DIM)))
             for _ in range(LAYERS)]
    return Idiom(step, model, cache, jnp.int32(7), jnp.int32(0),
                 next_token=lambda logits: jnp.argmax(logits, -1).astype(jnp.int32),
                 next_pos=lambda pos: pos + 1)


# ---- (e) Flax NNX: nnx.Module, nnx.Linear / RMSNorm / Embed (tied: Embed.attend), batch dimension ------------
def _flax_idiom():
    pytest.importorskip("flax")
    from flax import nnx

    class Attention(nnx.Module):
        def __init__(self, rngs):
            self.q = nnx.Linear(HIDDEN, HEADS * HEAD_DIM, use_bias=False, rngs=rngs)
            self.k = nnx.Linear(HIDDEN, KV_HEADS * HEAD_DIM, use_bias=False, rngs=rngs)
            self.v = nnx.Linear(HIDDEN, KV_HEADS * HEAD_DIM, use_bias=False, rngs=rngs)
            self.o = nnx.Linear(HEADS * HEAD_DIM, HIDDEN, use_bias=False, rngs=rngs)

        def __call__(self, x, k_cache, v_cache, pos):
            b, t, _ = x.shape
            positions = pos + jnp.zeros((b, t), jnp.int32)
            q = rope(self.q(x).reshape(b, t, HEADS, HEAD_DIM), positions)
            k = rope(self.k(x).reshape(b, t, KV_HEADS, HEAD_DIM), positions)
            v = self.v(x).reshape(b, t, KV_HEADS, HEAD_DIM)
            k_cache = jax.lax.dynamic_update_slice(k_cache, k, (0, pos, 0, 0))
            v_cache = jax.lax.dynamic_update_slice(v_cache, v, (0, pos, 0, 0))
            q = q.reshape(b, t, KV_HEADS, GROUPS, HEAD_DIM)
            scores = jnp.einsum("btkgd,bskd->bkgts", q, k_cache) * HEAD_DIM ** -0.5
            scores = jnp.where(jnp.arange(MAX_LEN)[None, None, None, None, :] <= pos, scores, -jnp.inf)
            probs = jax.nn.softmax(scores, axis=-1)
            out = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache).reshape(b, t, HEADS * HEAD_DIM)
            return self.o(out), k_cache, v_cache

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.attn_norm = nnx.RMSNorm(HIDDEN, epsilon=EPS, rngs=rngs)
            self.attn = Attention(rngs)
            self.mlp_norm = nnx.RMSNorm(HIDDEN, epsilon=EPS, rngs=rngs)
            self.gate = nnx.Linear(HIDDEN, INTER, use_bias=False, rngs=rngs)
            self.up = nnx.Linear(HIDDEN, INTER, use_bias=False, rngs=rngs)
            self.down = nnx.Linear(INTER, HIDDEN, use_bias=False, rngs=rngs)

        def __call__(self, x, k_cache, v_cache, pos):
            a, k_cache, v_cache = self.attn(self.attn_norm(x), k_cache, v_cache, pos)
            x = x + a
            h = self.mlp_norm(x)
            return x + self.down(nnx.silu(self.gate(h)) * self.up(h)), k_cache, v_cache

    class Transformer(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(VOCAB, HIDDEN, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
            self.norm = nnx.RMSNorm(HIDDEN, epsilon=EPS, rngs=rngs)

        def __call__(self, token, cache, pos):
            x = self.embed(token)
            new_cache = []
            for block, (k_cache, v_cache) in zip(self.blocks, cache):
                x, k_cache, v_cache = block(x, k_cache, v_cache, pos)
                new_cache.append((k_cache, v_cache))
            return self.embed.attend(self.norm(x)), new_cache

    model = Transformer(nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def step(state, cache, token, pos):
        return nnx.merge(graphdef, state)(token, cache, pos)

    cache = [(jnp.zeros((BATCH, MAX_LEN, KV_HEADS, HEAD_DIM)), jnp.zeros((BATCH, MAX_LEN, KV_HEADS, HEAD_DIM)))
             for _ in range(LAYERS)]
    token = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (BATCH, 1)).astype(np.int32))
    return Idiom(step, state, cache, token, jnp.int32(0),
                 next_token=lambda logits: jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None],
                 next_pos=lambda pos: pos + 1)


# ---- the check ---------------------------------------------------------------------------------------------
def _prefill(idiom: Idiom, n: int) -> Idiom:
    """Run ``n`` steps with plain ``jax.jit`` (a short "prompt"), so the decode steps attend to several
    positions."""
    run = jax.jit(idiom.step)
    cache, token, pos = idiom.cache, idiom.token, idiom.pos
    for _ in range(n):
        logits, cache = run(idiom.params, cache, token, pos)
        token, pos = idiom.next_token(logits), idiom.next_pos(pos)
    return Idiom(idiom.step, idiom.params, cache, token, pos, idiom.next_token, idiom.next_pos)


def decode(idiom: Idiom, steps: int = STEPS, options=None):
    """``steps`` greedy steps through ``fj.jit`` and ``jax.jit`` side by side (fusegraph warnings are errors)."""
    idiom = _prefill(idiom, PROMPT)
    fused = fj.jit(idiom.step, donate_argnums=(1,), options={"executor": "nkisim", **(options or {})})
    ref = jax.jit(idiom.step)
    cache = rcache = idiom.cache
    tok = rtok = idiom.token
    pos = idiom.pos
    out = {"tokens": [], "ref_tokens": [], "rel_err": [], "launches": []}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any fusegraph warning (a fallback, an eager region) fails the test
        for _ in range(steps):
            logits, cache = fused(idiom.params, cache, tok, pos)
            rlogits, rcache = ref(idiom.params, rcache, rtok, pos)
            scale = float(jnp.abs(rlogits).max())
            out["rel_err"].append(float(jnp.abs(logits - rlogits).max()) / scale)
            tok, rtok = idiom.next_token(logits), idiom.next_token(rlogits)
            out["tokens"].append(np.asarray(tok).tolist())
            out["ref_tokens"].append(np.asarray(rtok).tolist())
            out["launches"].append(fused.last.launches_per_step)
            pos = idiom.next_pos(pos)
    out["cache_err"] = max(float(jnp.abs(a - b).max())
                           for a, b in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(rcache)))
    out["fused"] = fused
    return out


def check_one_kernel(out, steps: int = STEPS):
    assert out["tokens"] == out["ref_tokens"]
    assert max(out["rel_err"]) < 1e-4, out["rel_err"]
    assert out["cache_err"] < 1e-4
    assert out["launches"] == [1] * steps
    c = out["fused"].last
    assert c.verified and c.fallback is None
    data = c.report().to_dict()
    assert len(data["regions"]) == 1, [r["kind"] for r in data["regions"]]
    return data


IDIOMS = {"batched": _batched_idiom, "unbatched": _single_idiom, "vmap": _vmapped_idiom, "equinox": _equinox_idiom,
          "flax_nnx": _flax_idiom}

# The built-in patterns each idiom's step matches (the rest of the kernel is generic lowering's tensor path; host
# pieces are the index/mask/rotary-table arithmetic before the kernel). Batched steps with a sequence-major cache
# are imported in HF's layout (cache state [B, KV, L, D], grouped einsum attention as HF's GQA, split-half RoPE as
# HF's rope): the patterns of a HF Llama. Without a batch dim (and under vmap) no HF form exists for the cache
# and attention; Flax's RMSNorm multiplies x * (rsqrt * scale) (another rounding than HF's, so not rmsnorm) and
# Equinox's reduces a vector to a scalar (mean without keepdims).
EXPECTED = {
    "batched": {"decode_attention": 2, "kv_cache_update": 4, "rope": 4, "rmsnorm": 5, "linear": 15, "swiglu": 2,
                "embedding": 1},
    "unbatched": {"rmsnorm": 5, "linear": 15, "swiglu": 2, "embedding": 1},
    "vmap": {"decode_attention": 2, "rope": 4, "rmsnorm": 5, "linear": 15, "swiglu": 2, "embedding": 1},
    "equinox": {"linear": 15, "swiglu": 2, "embedding": 1},
    "flax_nnx": {"decode_attention": 2, "kv_cache_update": 4, "rope": 4, "linear": 15, "swiglu": 2, "embedding": 1},
}


@pytest.mark.parametrize("name", sorted(IDIOMS, key=list(IDIOMS).index))
def test_idiomatic_jax_step_is_one_kernel_and_equals_jax(name):
    """Greedy steps through fj.jit and jax.jit: the same tokens, logits and cache within 1e-4 (fp32), one kernel
    launch per step, no fusegraph warning, every op ran in the kernel (coverage 1.0: the step has no ops the
    kernel leaves to the host)."""
    out = decode(IDIOMS[name]())
    data = check_one_kernel(out)
    assert data["coverage"] == 1.0 and data["coverage_all_ops"] == 1.0, (data["coverage"], data["unmatched"])
    assert all(r["executed_by"] == "nkisim" for r in data["regions"])
    counts = {k.removeprefix("fusegraph."): v for k, v in data["pattern_counts"].items()}
    assert {k: counts.get(k) for k in EXPECTED[name]} == EXPECTED[name], counts


# ---- the importer on the idioms' pieces (each against jax.jit, in range and out of range) -------------------
C = jnp.asarray(np.random.default_rng(3).normal(size=(16, 2, 4)).astype(np.float32))
ROW = jnp.asarray(np.random.default_rng(4).normal(size=(2, 4)).astype(np.float32))


@pytest.mark.parametrize("pos", [0, 5, 15, 16, -1, -16, -17, 100])
def test_at_set_row_is_a_guarded_index_copy(pos):
    """``cache.at[pos].set(row)`` (a scatter: XLA drops a window outside the operand, jnp wraps -16..-1 first) is
    ``index_copy`` at the clamped position of ``where(in range, row, old row)``: equal to JAX for every ``pos``."""
    imported, _ = check_against_jax(lambda c, r, p: c.at[p].set(r), C, ROW, jnp.int32(pos))
    ops = aten_ops(imported)
    assert "aten.index_copy.default" in ops and "aten.index_put.default" not in ops, ops


@pytest.mark.parametrize("pos", [0, 3, 15, 16, -2])
def test_at_set_in_a_middle_dim_and_integer_scatter(pos):
    b = jnp.asarray(np.random.default_rng(5).normal(size=(2, 16, 4)).astype(np.float32))
    check_against_jax(lambda c, r, p: c.at[:, p].set(r), b, ROW, jnp.int32(pos))
    ints = jnp.arange(16 * 3, dtype=jnp.int32).reshape(16, 3)
    check_against_jax(lambda c, p: c.at[p].set(jnp.asarray([7, -8, 2 ** 31 - 1], jnp.int32)), ints, jnp.int32(pos))


def test_scatter_of_several_rows_set_and_add_drops_out_of_range_windows():
    x = jnp.asarray(np.random.default_rng(6).normal(size=(6, 3)).astype(np.float32))
    idx = jnp.asarray([0, 4, 9, -3, -7], jnp.int32)  # 9 and -7 (after jnp's wrap: -1) are dropped
    upd = jnp.asarray(np.random.default_rng(7).normal(size=(5, 3)).astype(np.float32))
    imported, _ = check_against_jax(lambda x, i, u: (x.at[i].set(u), x.at[i].add(u), x.at[i].add(1.0)), x, idx, upd)
    assert "aten.index_put.default" in aten_ops(imported)


@pytest.mark.parametrize("pos", [[0, 3], [15, 7], [16, -1], [40, 2]])
def test_vmapped_dynamic_update_slice_is_an_index_put(pos):
    """``jax.vmap`` of a ``dynamic_update_slice`` at per-row positions is a scatter over clamped starts (XLA's
    ``dynamic_update_slice`` clamps): ``index_put`` over index grids, no guard."""
    cache = jnp.asarray(np.random.default_rng(8).normal(size=(2, 16, 2, 4)).astype(np.float32))
    new = jnp.asarray(np.random.default_rng(9).normal(size=(2, 1, 2, 4)).astype(np.float32))

    def write(c, k, p):
        return jax.vmap(lambda c, k, p: jax.lax.dynamic_update_slice(c, k, (p, 0, 0)))(c, k, p)

    imported, _ = check_against_jax(write, cache, new, jnp.asarray(pos, jnp.int32))
    (put,) = [n for n in imported.gm.graph.nodes
              if n.op == "call_function" and str(n.target) == "aten.index_put.default"]
    assert put.args[0].op == "placeholder"  # into the cache itself: no dropped window to send past its end


def test_equinox_linear_and_row_lookup_are_linear_and_embedding():
    """``W @ x`` with the weight on the left (eqx.nn.Linear) is ``linear(x, W)``; a row of a ``[V, H]`` argument
    read by ``dynamic_slice`` (eqx.nn.Embedding, ``table[token]``) is ``embedding``, also under ``jax.vmap``."""
    w = jnp.asarray(np.random.default_rng(10).normal(size=(8, 4)).astype(np.float32))
    table = jnp.asarray(np.random.default_rng(11).normal(size=(10, 4)).astype(np.float32))
    for tok in (0, 9, 12, -1, -11):
        imported, _ = check_against_jax(lambda w, t, i: w @ t[i], w, table, jnp.int32(tok))
        ops = aten_ops(imported)
        assert "aten.embedding.default" in ops and "aten.t.default" in ops and "aten.bmm.default" not in ops, ops
    # vmap'ed, table[token] is a gather that keeps the row dim: an embedding too
    imported, _ = check_against_jax(jax.vmap(lambda t, i: t[i], in_axes=(None, 0)), table,
                                    jnp.asarray([0, 9, 12, -1, -11], jnp.int32))
    assert "aten.embedding.default" in aten_ops(imported)


def _attention_inputs(seed=12):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(2, 1, 2, 3, 8)).astype(np.float32))  # [B, T, KV, G, D]
    k, v = (jnp.asarray(rng.normal(size=(2, 16, 2, 8)).astype(np.float32)) for _ in range(2))  # [B, L, KV, D]
    return q, k, v


@pytest.mark.parametrize("fill", ["finfo", "-inf", "-1e9"])
@pytest.mark.parametrize("scale", ["multiply", "divide by 8"])
def test_grouped_einsum_attention_imports_as_hf_grouped_query_attention(fill, scale):
    """``einsum(btkgd,bskd->bkgts)``, ``where(arange(L) <= pos, s, fill)``, softmax, ``einsum(bkgts,bskd->btkgd)`` is
    HF's eager GQA (``repeat_kv`` by G, additive mask, fp32 softmax) with KV * G heads."""
    fills = {"finfo": float(jnp.finfo(jnp.float32).min), "-inf": -jnp.inf, "-1e9": -1e9}

    def attend(q, k, v, pos):
        s = jnp.einsum("btkgd,bskd->bkgts", q, k)
        s = s * 0.125 if scale == "multiply" else s / np.float32(8.0)
        s = jnp.where(jnp.arange(16) <= pos, s, fills[fill])
        return jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, axis=-1), v).reshape(2, 1, -1)

    for pos in (0, 5, 15):
        imported, _ = check_against_jax(attend, *_attention_inputs(), jnp.int32(pos), rtol=1e-6, atol=1e-6)
    ops = aten_ops(imported)
    assert "aten._softmax.default" in ops and ops.count("aten.bmm.default") == 2 and "aten.div.Tensor" not in ops


def test_attention_scaled_by_a_division_that_is_not_a_power_of_two_is_left_as_written():
    """``s / sqrt(32)`` is not ``s * (1 / sqrt(32))`` bit for bit: not HF's form (it runs as written)."""
    def attend(q, k, v):
        s = jnp.einsum("btkgd,bskd->bkgts", q, k) / np.sqrt(32).astype(np.float32)
        return jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, axis=-1), v)

    imported, _ = check_against_jax(attend, *_attention_inputs(), rtol=1e-6, atol=1e-6)
    assert "aten.div.Tensor" in aten_ops(imported)


def test_split_half_rope_is_hf_rope_bit_for_bit():
    """``cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin])`` is HF's ``x * cat(cos, cos) + rotate_half(x) *
    cat(sin, sin)``: the same products and sums per element, so the same bits."""
    rng = np.random.default_rng(13)
    x = jnp.asarray(rng.normal(size=(2, 1, 4, 32)).astype(np.float32))
    cos, sin = (jnp.asarray(rng.normal(size=(2, 1, 16)).astype(np.float32)) for _ in range(2))

    def rotate(x, cos, sin):  # rope() above with its tables given (sin/cos are JAX's and PyTorch's own, not exact)
        c, s = cos[..., None, :], sin[..., None, :]
        x1, x2 = x[..., :16], x[..., 16:]
        return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    imported, _ = check_against_jax(rotate, x, cos, sin, rtol=1e-6, atol=1e-6)  # XLA's CPU code contracts to FMAs
    (got,) = run_imported(imported, x, cos, sin)
    np.testing.assert_array_equal(got, np.asarray(rotate(x, cos, sin)))  # op by op (not jitted): the same bits
    ops = aten_ops(imported)
    assert "aten.neg.default" in ops and "aten.sub.Tensor" not in ops, ops  # rotate_half's -x2, no x1*c - x2*s


@pytest.mark.parametrize("write", ["dynamic_update_slice", "at_set", "vmap"])
def test_sequence_major_cache_is_state_in_hf_layout_written_in_place(write):
    """A donated ``[B, L, KV, D]`` cache written one position at a time is one ``[B, KV, L, D]`` state input (HF's
    layout), the write an ``index_copy`` along its dim 2 (per-sequence positions, vmap'ed: an ``index_put``);
    equal to JAX for positions in and out of range."""
    from fusegraph.stablehlo import import_stablehlo

    def step(cache, k, pos):
        if write == "at_set":
            new = cache.at[:, pos].set(k[:, 0])
        elif write == "vmap":
            new = jax.vmap(lambda c, k, p: jax.lax.dynamic_update_slice(c, k, (p, 0, 0)))(cache, k, pos)
        else:
            new = jax.lax.dynamic_update_slice(cache, k, (0, pos, 0, 0))
        return new.sum(axis=1), new

    cache = jnp.asarray(np.random.default_rng(14).normal(size=(2, 16, 2, 8)).astype(np.float32))
    k = jnp.asarray(np.random.default_rng(15).normal(size=(2, 1, 2, 8)).astype(np.float32))
    positions = [[0, 3], [15, 16], [-1, 40]] if write == "vmap" else [0, 3, 15, 16, -1, 40]
    text = jax.jit(step, donate_argnums=(0,)).lower(cache, k, jnp.asarray(positions[0], jnp.int32)).as_text()
    imported = import_stablehlo(text, arg_kinds=["state", "step", "step"])
    assert imported.inputs[0].kind == "state" and imported.inputs[0].shape == (2, 2, 16, 8)
    op = "index_put" if write == "vmap" else "index_copy"
    writes = [n for n in imported.gm.graph.nodes if n.op == "call_function" and op in str(n.target)]
    assert len(writes) == 1 and writes[0].args[0] is next(iter(imported.gm.graph.nodes))  # into the state input
    for pos in positions:
        expected = jax.jit(step)(cache, k, jnp.asarray(pos, jnp.int32))
        got = run_imported(imported, cache, k, np.asarray(pos, np.int32))
        np.testing.assert_allclose(got[0], np.asarray(expected[0]), rtol=1e-6, atol=1e-6)  # a sum: its own order
        np.testing.assert_array_equal(got[1], np.asarray(expected[1]))  # the cache: the same bits
