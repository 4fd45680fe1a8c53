"""The rotary cos/sin tables of the current positions, from the ``inv_freq`` buffer (HF ``*RotaryEmbedding``)."""
import torch

from fusegraph.codegen.api import lower_on_host, register_lowering
from fusegraph.matching import Input, register_pattern

INV_FREQ = Input("inv_freq", "F", dtype="float32", kind="buffer")
POSITIONS = Input("position_ids", "B S", dtype="int64")


#: the two table patterns differ only in how the frequencies are laid out
TABLES = dict(template="rope_tables", block="prologue", priority=15, inputs=[INV_FREQ, POSITIONS],
              outputs=("cos", "sin"), params={"attention_scaling": 1.0}, dims={"F": (4, 10), "B": (2, 3), "S": (1, 3)})


@register_pattern("fusegraph.rope_tables", **TABLES)
def rope_tables(inv_freq, position_ids, *, attention_scaling, dtype):
    """transformers 5: ``freqs = pos[..., None].float() * inv_freq``; cos/sin of ``cat(freqs, freqs)`` scaled."""
    freqs = position_ids[..., None].float() * inv_freq.to(dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * attention_scaling
    sin = emb.sin() * attention_scaling
    return cos.to(dtype=dtype), sin.to(dtype=dtype)


@rope_tables.implementation("matmul", cases=[{"B": 1}, {}])
def _matmul(inv_freq, position_ids, *, attention_scaling, dtype):
    """transformers 4.x: the outer product written as a batched matmul."""
    inv_freq_expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    position_ids_expanded = position_ids[:, None, :].float()
    freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * attention_scaling
    sin = emb.sin() * attention_scaling
    return cos.to(dtype=dtype), sin.to(dtype=dtype)


@register_pattern("fusegraph.rope_tables_interleaved", **TABLES)
def rope_tables_interleaved(inv_freq, position_ids, *, attention_scaling, dtype):
    """Cohere: each frequency repeated for its pair (``repeat_interleave``) instead of the two halves, for the
    interleaved rotation (:mod:`.rope_interleaved`)."""
    freqs = position_ids[..., None].float() * inv_freq.to(dtype=torch.float)
    emb = torch.repeat_interleave(freqs, 2, dim=-1)
    cos = emb.cos() * attention_scaling
    sin = emb.sin() * attention_scaling
    return cos.to(dtype=dtype), sin.to(dtype=dtype)


@register_pattern("fusegraph.rope_tables_pairs", **{**TABLES, "outputs": ("freqs_cis",)})
def rope_tables_pairs(inv_freq, position_ids, *, attention_scaling, dtype):
    """Llama 4, DeepSeek-V2: ``torch.polar(torch.ones_like(freqs), freqs) * attention_scaling``, a complex table, as
    the program holds it once complex values are real pairs (``fusegraph/program/complex_pairs.py``): the magnitude
    times cos and sin of the angles, stacked last (``torch.view_as_real``'s layout). Host-side like the others, for
    the same reason: sin/cos of arbitrary angles."""
    freqs = position_ids[..., None].float() * inv_freq.to(dtype=torch.float)
    magnitude = torch.ones_like(freqs)
    table = torch.stack([magnitude * torch.cos(freqs), magnitude * torch.sin(freqs)], dim=-1)
    return table * attention_scaling


register_lowering(rope_tables, rope_tables_interleaved, rope_tables_pairs, host_side=True)(lower_on_host)
