"""Grouped-query attention of one new token over the (just updated) static KV cache.

Three traced forms, all with ``repeat_kv`` (HF's GQA expansion) unless there is one query head per KV head:

* ``eager``: ``softmax(q @ k.T * scale + mask, fp32) @ v`` (HF ``eager_attention_forward``; additive mask);
* ``sdpa``: ``scaled_dot_product_attention`` with HF's boolean mask (captures as
  ``aten._scaled_dot_product_flash_attention_for_cpu`` on CPU, with the bool -> -inf ``where`` in front);
* ``sdpa_additive``: the same with a float mask;
* ``sdpa_shared_mask`` / ``sdpa_additive_shared_mask``: the SDPA forms with one ``[1, 1, 1, L]`` mask row for the
  whole batch (a causal-mask buffer indexed by the step's one position, gpt-fast style); the kernel gets it
  repeated per sequence.

The match's ``mask_form`` param says whether ``mask`` is additive (float) or boolean (True = attend).

The output is ``[B, heads, 1, D]``; the transpose/reshape to ``[B, 1, heads*D]`` that follows is layout glue.
"""
import torch

from fusegraph.matching import Input, register_pattern

Q = Input("q", "B KV*G 1 D")
K = Input("k", "B KV L D")
V = Input("v", "B KV L D")


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def _check(m):
    q, k, v = m.inputs["q"], m.inputs["k"], m.inputs["v"]
    if q.shape is None or k.shape is None or k.shape != v.shape or q.shape[1] % k.shape[1]:
        return f"q {q.shape} / k {k.shape} / v {v.shape} are not grouped-query attention shapes"
    if q.shape[2] != 1:
        return f"{q.shape[2]} query tokens: not a decode step"
    return True


def _derive(m):
    return {"num_key_value_groups": m.inputs["q"].shape[1] // m.inputs["k"].shape[1]}


@register_pattern(
    "fusegraph.decode_attention",
    template="decode_attention",
    priority=30,
    inputs=[Q, K, V, Input("mask", "B 1 1 L")],
    params={"scale": 0.125},
    cases=[{"mask_form": "additive"}, {"G": 1, "mask_form": "additive"}],
    dims={"B": (2, 5), "KV": (2, 3), "G": (3, 4), "L": (16, 20), "D": (8, 12)},
    check=_check,
    derive=_derive,
    derived=("num_key_value_groups",),
)
def decode_attention(q, k, v, mask, *, scale):
    """``softmax(q @ repeat_kv(k).T * scale + mask, dim=-1, fp32).to(q.dtype) @ repeat_kv(v)``."""
    groups = q.shape[1] // k.shape[1]
    key_states = repeat_kv(k, groups)
    value_states = repeat_kv(v, groups)
    attn_weights = torch.matmul(q, key_states.transpose(2, 3)) * scale
    attn_weights = attn_weights + mask
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
    attn_weights = torch.nn.functional.dropout(attn_weights, p=0.0, training=False)
    return torch.matmul(attn_weights, value_states)


@decode_attention.implementation("sdpa", inputs=[Q, K, V, Input("mask", "B 1 1 L", dtype="bool")],
                                 cases=[{"mask_form": "boolean"}, {"G": 1, "mask_form": "boolean"}])
def _sdpa(q, k, v, mask, *, scale):
    groups = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask, dropout_p=0.0, scale=scale, is_causal=False)


@decode_attention.implementation("sdpa_additive")
def _sdpa_additive(q, k, v, mask, *, scale):
    groups = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask, dropout_p=0.0, scale=scale, is_causal=False)


# one mask row for the whole batch (``[1, 1, 1, L]``, broadcast over the sequences): gpt-fast style models index a
# causal-mask buffer by the step's one ``input_pos``; with SDPA's default scale too (canonicalization spells it out)
@decode_attention.implementation("sdpa_shared_mask", inputs=[Q, K, V, Input("mask", "1 1 1 L", dtype="bool")],
                                 cases=[{"mask_form": "boolean"}, {"G": 1, "mask_form": "boolean"}])
def _sdpa_shared_mask(q, k, v, mask, *, scale):
    return _sdpa(q, k, v, mask, scale=scale)


@decode_attention.implementation("sdpa_additive_shared_mask", inputs=[Q, K, V, Input("mask", "1 1 1 L")])
def _sdpa_additive_shared_mask(q, k, v, mask, *, scale):
    return _sdpa_additive(q, k, v, mask, scale=scale)


def _check_sinks(m):
    ok = _check(m)
    if ok is not True:
        return ok
    q, s = m.inputs["q"], m.inputs["sinks"]
    if s.shape is None or tuple(s.shape) != (q.shape[1],):
        return f"sinks {s.shape} are not one logit per query head ({q.shape[1]})"
    return True


@register_pattern(
    "fusegraph.decode_attention_sinks",
    template="decode_attention",
    priority=32,
    inputs=[Q, K, V, Input("mask", "B 1 1 L"), Input("sinks", "KV*G", kind="weight")],
    params={"scale": 0.125},
    # one sequence: the sinks' expand to the batch is a no-op, which canonicalization folds (its own trace)
    cases=[{"mask_form": "additive"}, {"G": 1, "mask_form": "additive"}, {"B": 1, "mask_form": "additive"},
           {"B": 1, "G": 1, "mask_form": "additive"}],
    dims={"B": (2, 5), "KV": (2, 3), "G": (3, 4), "L": (16, 20), "D": (8, 12)},
    check=_check_sinks,
    derive=_derive,
    derived=("num_key_value_groups",),
)
def decode_attention_sinks(q, k, v, mask, sinks, *, scale):
    """GPT-OSS: one learned logit per query head (a "sink") joins each row's softmax, and its probability is
    dropped: ``softmax(cat([q @ k.T * scale + mask, sink]) - max)[..., :-1] @ v``."""
    groups = q.shape[1] // k.shape[1]
    key_states = repeat_kv(k, groups)
    value_states = repeat_kv(v, groups)
    attn_weights = torch.matmul(q, key_states.transpose(2, 3)) * scale
    attn_weights = attn_weights + mask
    s = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    combined = torch.cat([attn_weights, s], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.nn.functional.softmax(combined, dim=-1, dtype=combined.dtype)
    scores = probs[..., :-1]
    attn_weights = torch.nn.functional.dropout(scores, p=0.0, training=False).to(value_states.dtype)
    return torch.matmul(attn_weights, value_states)


@register_pattern(
    "fusegraph.decode_attention_softcap",
    template="decode_attention",
    priority=31,
    inputs=[Q, K, V, Input("mask", "B 1 1 L")],
    params={"scale": 0.125, "softcap": 50.0},
    cases=[{"mask_form": "additive"}, {"G": 1, "mask_form": "additive"}],
    dims={"B": (2, 5), "KV": (2, 3), "G": (3, 4), "L": (16, 20), "D": (8, 12)},
    check=_check,
    derive=_derive,
    derived=("num_key_value_groups",),
)
def decode_attention_softcap(q, k, v, mask, *, scale, softcap):
    """Gemma 2: the scores soft-capped, ``tanh(s / softcap) * softcap``, before the mask."""
    groups = q.shape[1] // k.shape[1]
    key_states = repeat_kv(k, groups)
    value_states = repeat_kv(v, groups)
    attn_weights = torch.matmul(q, key_states.transpose(2, 3)) * scale
    attn_weights = attn_weights / softcap
    attn_weights = torch.tanh(attn_weights)
    attn_weights = attn_weights * softcap
    attn_weights = attn_weights + mask
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
    attn_weights = torch.nn.functional.dropout(attn_weights, p=0.0, training=False)
    return torch.matmul(attn_weights, value_states)
