"""A plain PyTorch decoder in the style ``torch.compile`` users write (gpt-fast's ``model.py``), no transformers.

Written here for fusegraph's tests (issue 27), not taken from gpt-fast: the same idioms, our own code.

* :class:`ModelArgs`, a dataclass of sizes;
* :class:`KVCache`, a module with registered ``k_cache`` / ``v_cache`` buffers ``[B, H_kv, L, D]`` written by
  ``k_out[:, :, input_pos] = k_val`` (``index_put_``);
* :class:`RMSNorm` by hand (``x * rsqrt(mean(x^2) + eps) * weight``);
* rope through a precomputed ``freqs_cis`` buffer of real ``(cos, sin)`` pairs ``[L, D/2, 2]``, applied by
  reshaping q/k to ``(..., D/2, 2)``;
* a causal-mask buffer indexed by ``input_pos``;
* ``F.scaled_dot_product_attention`` after ``repeat_interleave`` of k/v for grouped-query attention;
* a SwiGLU feed-forward (``w2(silu(w1(x)) * w3(x))``), a fused ``wqkv`` projection (or separate ``wq``/``wk``/
  ``wv``), tied or untied output.

``Transformer.forward(idx, input_pos)`` returns logits; ``idx`` is ``[B, T]``, ``input_pos`` ``[T]`` (one
position vector for the whole batch, as gpt-fast). :func:`build` prefills a random-weight model eagerly and
returns a :class:`PlainDecodeCase` (a :class:`~fusegraph.models.DecodeCase`-compatible object: ``step(token,
position)``, ``fork()``, ``cache_tensors()``), so ``fusegraph report --model fusegraph.models.gptfast:case``
runs it.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class ModelArgs:
    block_size: int = 64  # the longest sequence the caches and tables hold
    vocab_size: int = 512
    n_layer: int = 2
    n_head: int = 4
    dim: int = 256
    intermediate_size: int | None = None  # None: SwiGLU's 2/3 * 4 * dim, rounded up to a multiple of 256
    n_local_heads: int = -1  # KV heads (-1: as many as n_head)
    head_dim: int | None = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    fused_qkv: bool = True

    def __post_init__(self) -> None:
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_head
        if self.intermediate_size is None:
            hidden = int(2 * (4 * self.dim) / 3)
            self.intermediate_size = -(-hidden // 256) * 256


class KVCache(nn.Module):
    def __init__(self, max_batch_size: int, max_seq_length: int, n_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype))

    def update(self, input_pos: Tensor, k_val: Tensor, v_val: Tensor) -> tuple[Tensor, Tensor]:
        # input_pos: [T]; k_val, v_val: [B, H, T, D]
        k_out, v_out = self.k_cache, self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val
        return k_out, v_out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_table(seq_len: int, head_dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float32) -> Tensor:
    """``[seq_len, head_dim/2, 2]``: (cos, sin) of position * frequency, per rotated pair."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).to(dtype)


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    """Rotate each (even, odd) pair of ``x`` ``[B, T, H, D]`` by the table rows ``freqs_cis`` ``[T, D/2, 2]``."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    table = freqs_cis.view(1, pairs.size(1), 1, pairs.size(3), 2)
    re = pairs[..., 0] * table[..., 0] - pairs[..., 1] * table[..., 1]
    im = pairs[..., 1] * table[..., 0] + pairs[..., 0] * table[..., 1]
    return torch.stack([re, im], dim=-1).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = args.n_head, args.n_local_heads, args.head_dim
        self.dim = args.dim
        q_size, kv_size = args.n_head * args.head_dim, args.n_local_heads * args.head_dim
        self.fused = args.fused_qkv
        if self.fused:
            self.wqkv = nn.Linear(args.dim, q_size + 2 * kv_size, bias=False)
        else:
            self.wq = nn.Linear(args.dim, q_size, bias=False)
            self.wk = nn.Linear(args.dim, kv_size, bias=False)
            self.wv = nn.Linear(args.dim, kv_size, bias=False)
        self.wo = nn.Linear(q_size, args.dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x: Tensor, freqs_cis: Tensor, mask: Tensor, input_pos: Tensor) -> Tensor:
        bsz, seqlen, _ = x.shape
        q_size, kv_size = self.n_head * self.head_dim, self.n_local_heads * self.head_dim
        if self.fused:
            q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
        groups = self.n_head // self.n_local_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, q_size)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.w3 = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: Tensor, input_pos: Tensor, freqs_cis: Tensor, mask: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.config = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_batch_size = -1
        self.max_seq_length = -1
        self.register_buffer("freqs_cis", None, persistent=False)
        self.register_buffer("causal_mask", None, persistent=False)

    def setup_caches(self, max_batch_size: int, max_seq_length: int) -> None:
        args = self.config
        dtype = self.output.weight.dtype
        device = self.output.weight.device
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        for block in self.layers:
            block.attention.kv_cache = KVCache(max_batch_size, max_seq_length, args.n_local_heads, args.head_dim,
                                               dtype).to(device)
        self.freqs_cis = rope_table(args.block_size, args.head_dim, args.rope_base, dtype).to(device)
        self.causal_mask = torch.tril(torch.ones(max_seq_length, max_seq_length, dtype=torch.bool, device=device))

    def forward(self, idx: Tensor, input_pos: Tensor) -> Tensor:
        assert self.freqs_cis is not None, "call setup_caches() first"
        mask = self.causal_mask[None, None, input_pos]
        freqs_cis = self.freqs_cis[input_pos]
        x = self.tok_embeddings(idx)
        for block in self.layers:
            x = block(x, input_pos, freqs_cis, mask)
        return self.output(self.norm(x))


def decode_one_token(model: Transformer, token: Tensor, input_pos: Tensor) -> Tensor:
    """One decode step: ``token`` ``[B, 1]``, ``input_pos`` ``[1]`` -> logits ``[B, 1, vocab]``."""
    return model(token, input_pos)


@dataclass
class PlainDecodeCase:
    """A prefilled :class:`Transformer` and its next decode step's inputs, shaped like
    :class:`fusegraph.models.DecodeCase` (``step``, ``token``, ``position``, ``fork``, ``cache_tensors``). The KV
    caches are the model's own buffers, so :meth:`fork` copies the whole model."""

    name: str
    model: Transformer
    token: Tensor  # [B, 1] int64
    position: Tensor  # [1] int64 (one position for the batch)
    dtype: torch.dtype
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def step(self, tok: Tensor, pos: Tensor) -> Tensor:
        return decode_one_token(self.model, tok, pos)

    def fork(self) -> "PlainDecodeCase":
        return dataclasses.replace(self, model=copy.deepcopy(self.model))

    def cache_tensors(self) -> list[Tensor]:
        out = []
        for block in self.model.layers:
            out += [block.attention.kv_cache.k_cache, block.attention.kv_cache.v_cache]
        return out


def build(*, batch: int = 1, tied: bool = False, fused_qkv: bool = True, prompt_len: int = 8,
          max_seq_length: int = 32, dtype: torch.dtype = torch.float32, seed: int = 0,
          **args: Any) -> PlainDecodeCase:
    """A tiny random-weight :class:`Transformer` (2 layers, dim 256, 4 heads, 2 KV heads, vocabulary 512), its
    caches set up for ``batch`` sequences and prefilled eagerly with a random prompt of ``prompt_len`` tokens."""
    margs = ModelArgs(**{"block_size": max_seq_length, "n_local_heads": 2, "tie_embeddings": tied,
                         "fused_qkv": fused_qkv, **args})
    torch.manual_seed(seed)
    model = Transformer(margs)
    with torch.no_grad():
        # nn.Linear's default init gives near-uniform logits: unit-variance projections instead, and a small
        # embedding so that the layers, not the token's own (tied) embedding, decide the next token
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1 if p is model.tok_embeddings.weight else p.shape[1] ** -0.5)
    model = model.to(dtype).eval()
    model.setup_caches(batch, max_seq_length)
    prompt = torch.randint(0, margs.vocab_size, (batch, prompt_len))
    with torch.no_grad():
        logits = model(prompt, torch.arange(prompt_len))
    token = logits[:, -1].argmax(-1, keepdim=True)
    return PlainDecodeCase(name="gptfast-tiny" + ("-tied" if tied else ""), model=model, token=token,
                           position=torch.tensor([prompt_len]), dtype=dtype,
                           options={"batch": batch, "tied": tied, "max_cache_len": max_seq_length, "prompt": prompt})


def case() -> PlainDecodeCase:
    """``fusegraph report --model fusegraph.models.gptfast:case``: batch 1, untied, fused wqkv."""
    return build()
