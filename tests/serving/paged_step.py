"""A small paged-KV decode step written in plain PyTorch (the test client of ``patterns/paged_attention/pattern.py``), in
the vLLM layout: per layer a key and a value cache of ``[num_blocks, block_size, kv_heads, head_dim]``, a block
table ``[B, max_blocks]`` per sequence (the cache blocks holding its positions, in order), a slot mapping ``[B]``
(the flat row ``block * block_size + offset`` this step's key/value goes to) and context lengths ``[B]`` (positions
valid after this step's write). The mask (``-inf`` past each context length) is built before the layers, like
HF's masks. vLLM itself does not install here (it needs a GPU), so this step and its eager run are the reference.
"""
from __future__ import annotations

import torch
from torch import nn


def paged_write(cache: torch.Tensor, slot_mapping: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """vLLM's ``reshape_and_cache``: row ``slot_mapping[b]`` of the flat ``[num_blocks * block_size, KV, D]`` view
    of ``cache`` gets ``value[b]`` ([B, KV, D]), in place."""
    nb, bs, kv, d = cache.shape
    cache.view(nb * bs, kv, d).index_copy_(0, slot_mapping, value)
    return cache


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention of ``q`` ([B, Hq, 1, D]) over the positions each sequence's block table lists: the blocks
    gathered (``cache[block_table]``), GQA as in HF's ``repeat_kv``, additive ``mask`` ([B, 1, 1, L])."""
    B, nblk = block_table.shape
    _, bs, kv, d = k_cache.shape
    k = k_cache[block_table].reshape(B, nblk * bs, kv, d).transpose(1, 2)
    v = v_cache[block_table].reshape(B, nblk * bs, kv, d).transpose(1, 2)
    groups = q.shape[1] // kv
    if groups > 1:  # HF's repeat_kv
        k = k[:, :, None].expand(B, kv, groups, nblk * bs, d).reshape(B, kv * groups, nblk * bs, d)
        v = v[:, :, None].expand(B, kv, groups, nblk * bs, d).reshape(B, kv * groups, nblk * bs, d)
    s = torch.matmul(q, k.transpose(2, 3)) * scale + mask
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v)


class RMSNorm(nn.Module):
    """Root-mean-square norm in fp32, scaled by a weight (the formula of Llama-family models)."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class PagedLayer(nn.Module):
    """RMSNorm, q/k/v projections, paged write, paged attention, o_proj, residual (no rotary embedding: it is
    orthogonal to paging and tested elsewhere)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.norm = RMSNorm(hidden)
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, h: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, block_table: torch.Tensor,
                slot_mapping: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B = h.shape[0]
        x = self.norm(h)
        q = self.q_proj(x).view(B, 1, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, self.kv_heads, self.head_dim)
        paged_write(kc, slot_mapping, k)
        paged_write(vc, slot_mapping, v)
        o = paged_attention(q, kc, vc, block_table, mask, self.head_dim ** -0.5)
        return h + self.o_proj(o.transpose(1, 2).reshape(B, 1, self.heads * self.head_dim))


class PagedDecoder(nn.Module):
    """Embedding, ``layers`` x :class:`PagedLayer`, final norm, lm_head; the mask (``-inf`` past each sequence's
    context length) built once before the layers."""

    def __init__(self, vocab: int = 1000, hidden: int = 256, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
                 layers: int = 2) -> None:
        super().__init__()
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(PagedLayer(hidden, heads, kv_heads, head_dim) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]],
                block_table: torch.Tensor, slot_mapping: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        bs = caches[0][0].shape[1]
        L = block_table.shape[1] * bs
        valid = torch.arange(L, device=tokens.device)[None, :] < context_lens[:, None]
        dtype = self.embed.weight.dtype  # built in the model's dtype (HF's masks use finfo(dtype).min)
        mask = torch.where(valid, torch.zeros((), dtype=dtype), torch.full((), torch.finfo(dtype).min, dtype=dtype))
        mask = mask[:, None, None, :]
        h = self.embed(tokens)  # [B, 1, hidden]
        for layer, (kc, vc) in zip(self.layers, caches):
            h = layer(h, kc, vc, block_table, slot_mapping, mask)
        return self.lm_head(self.norm(h))


class PagedServer:
    """A toy block manager around :class:`PagedDecoder`: sequences of different lengths whose cache blocks are
    scattered over the pool (allocated in a shuffled order), one decode step for all of them per call."""

    def __init__(self, model: PagedDecoder, lens: list[int], *, num_blocks: int = 64, block_size: int = 16,
                 max_blocks: int = 8, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        g = torch.Generator().manual_seed(seed)
        self.model, self.block_size, self.max_blocks = model, block_size, max_blocks
        kv, d = model.kv_heads, model.head_dim
        self.caches = [(torch.randn(num_blocks, block_size, kv, d, generator=g).to(dtype),
                        torch.randn(num_blocks, block_size, kv, d, generator=g).to(dtype)) for _ in model.layers]
        free = torch.randperm(num_blocks, generator=g).tolist()
        self.block_table = torch.zeros(len(lens), max_blocks, dtype=torch.long)
        for b in range(len(lens)):
            for j in range(max_blocks):
                self.block_table[b, j] = free.pop()
        self.lens = torch.tensor(lens)  # positions already cached per sequence (random history)
        self.tokens = torch.randint(0, model.embed.num_embeddings, (len(lens), 1), generator=g)

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pos = self.lens  # this step's row of each sequence
        blk = self.block_table.gather(1, (pos // self.block_size)[:, None])[:, 0]
        slots = blk * self.block_size + pos % self.block_size
        return self.block_table, slots, pos + 1

    def step(self, fn) -> torch.Tensor:
        table, slots, ctx = self.step_inputs()
        with torch.no_grad():
            logits = fn(self.tokens, self.caches, table, slots, ctx)
        self.tokens = logits[:, -1].argmax(-1, keepdim=True)
        self.lens = self.lens + 1
        return logits

    def fork(self) -> "PagedServer":
        import copy

        other = copy.copy(self)
        other.caches = [(k.clone(), v.clone()) for k, v in self.caches]
        return other
