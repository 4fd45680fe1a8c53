"""Paged KV caches (vLLM's layout): per layer a key and a value cache of ``[num_blocks, block_size, kv_heads,
head_dim]``, a block table ``[B, max_blocks]`` naming the cache blocks that hold each sequence's positions in
order, a slot mapping ``[B]`` (the flat row ``block * block_size + offset`` of this step's new key/value).

* ``fusegraph.paged_kv_write``: vLLM's ``reshape_and_cache`` written in PyTorch,
  ``cache.view(-1, KV, D).index_copy_(0, slot_mapping, value)``;
* ``fusegraph.paged_attention``: decode attention over the gathered blocks, ``cache[block_table]`` reshaped to
  ``[B, KV, max_blocks * block_size, D]``, then HF's eager GQA attention with an additive mask (positions past
  each sequence's context length masked).

The test client is ``tests/serving/paged_step.py``; both lower in ``lowering.py`` next to this module.
"""
import torch

from fusegraph.matching import Input, register_pattern


def _write_check(m):
    cache, value = m.inputs["cache"], m.inputs["value"]
    if cache.shape is None or value.shape is None or len(cache.shape) != 4 or len(value.shape) != 3:
        return "a paged KV write needs a [num_blocks, block_size, KV, D] cache and [B, KV, D] rows"
    if tuple(cache.shape[2:]) != tuple(value.shape[1:]):
        return f"rows {value.shape} do not fit the cache {cache.shape}"
    return True


@register_pattern(
    "fusegraph.paged_kv_write",
    template="paged_kv_write",
    priority=15,
    inputs=[Input("cache", "NB BS KV D", kind="state"), Input("slots", "B", dtype="int64"), Input("value", "B KV D")],
    dims={"NB": (6, 7), "BS": (4, 5), "KV": (2, 3), "D": (8, 12), "B": (2, 3)},
    check=_write_check,
)
def paged_kv_write(cache, slots, value):
    """Row ``slots[b]`` of the flat ``[NB * BS, KV, D]`` view of ``cache`` gets ``value[b]``, in place."""
    nb, bs, kv, d = cache.shape
    cache.view(nb * bs, kv, d).index_copy_(0, slots, value)
    return cache


def _check(m):
    q, k, v, table = m.inputs["q"], m.inputs["k_cache"], m.inputs["v_cache"], m.inputs["block_table"]
    if None in (q.shape, k.shape, v.shape, table.shape) or k.shape != v.shape or q.shape[1] % k.shape[2]:
        return f"q {q.shape} / caches {k.shape} {v.shape} are not paged grouped-query attention shapes"
    if q.shape[2] != 1:
        return f"{q.shape[2]} query tokens: not a decode step"
    return True


def _derive(m):
    return {"num_key_value_groups": m.inputs["q"].shape[1] // m.inputs["k_cache"].shape[2]}


@register_pattern(
    "fusegraph.paged_attention",
    template="paged_attention",
    priority=32,
    inputs=[Input("q", "B KV*G 1 D"), Input("k_cache", "NB BS KV D"), Input("v_cache", "NB BS KV D"),
            Input("block_table", "B MB", dtype="int64"), Input("mask", "B 1 1 MB*BS")],
    params={"scale": 0.125},
    cases=[{}, {"G": 1}],
    dims={"B": (2, 3), "NB": (9, 10), "BS": (4, 5), "MB": (3, 4), "KV": (2, 3), "G": (3, 4), "D": (8, 12)},
    check=_check,
    derive=_derive,
    derived=("num_key_value_groups",),
)
def paged_attention(q, k_cache, v_cache, block_table, mask, *, scale):
    """``softmax(q @ K^T * scale + mask, fp32).to(q.dtype) @ V`` with ``K``/``V`` the blocks of each sequence's
    table, in order (``[B, KV * G, MB * BS, D]`` after HF's ``repeat_kv`` expansion)."""
    B, nblk = block_table.shape
    _, bs, kv, d = k_cache.shape
    k = k_cache[block_table].reshape(B, nblk * bs, kv, d).transpose(1, 2)
    v = v_cache[block_table].reshape(B, nblk * bs, kv, d).transpose(1, 2)
    groups = q.shape[1] // kv
    if groups > 1:
        k = k[:, :, None].expand(B, kv, groups, nblk * bs, d).reshape(B, kv * groups, nblk * bs, d)
        v = v[:, :, None].expand(B, kv, groups, nblk * bs, d).reshape(B, kv * groups, nblk * bs, d)
    s = torch.matmul(q, k.transpose(2, 3)) * scale + mask
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v)
