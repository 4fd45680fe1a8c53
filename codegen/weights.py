"""Host-side weight layouts: model parameters re-laid out once so every weight DMA is contiguous per partition.

Trainium deployments never stream a row-major ``[N, K]`` weight into a matmul as-is; they store it in the layout
the kernel reads. fusegraph does the same once per parameter (cached by the executor, refreshed when the
parameter's version counter changes): for ``y = x @ W.T`` with input layout ``(Pk, KT)`` and output layout
``(Pn, NT)`` the kernel weight is ``Wk[kp, nt, kt, j] = W[out(j, nt), in(kp, kt)]``, so output chunk ``nt`` is a
contiguous ``[KT, Pn]`` block on each partition and the matmul ``stationary = Wk[:, nt, kt, :]``,
``moving = x[:, kt, :]`` accumulates ``out[:, nt, :]`` in PSUM.
"""
from __future__ import annotations

import torch

from .layout import Layout


def linear(weight: torch.Tensor, in_layout: Layout, out_layout: Layout) -> torch.Tensor:
    """[N, K] -> [Pk, NT, KT, Pn]."""
    out_idx = out_layout.feature_index()  # [Pn, NT]
    in_idx = in_layout.feature_index()  # [Pk, KT]
    rows = out_idx.T[None, :, None, :]
    cols = in_idx[:, None, :, None]
    return weight[rows, cols].contiguous()


def experts(weight: torch.Tensor, in_layout: Layout, out_layout: Layout) -> torch.Tensor:
    """[E, N, K] -> [E, Pk, NT, KT, Pn] (one linear layout per expert, experts outermost for indexed DMA)."""
    out_idx = out_layout.feature_index()
    in_idx = in_layout.feature_index()
    rows = out_idx.T[None, None, :, None, :]
    cols = in_idx[None, :, None, :, None]
    e = torch.arange(weight.shape[0])[:, None, None, None, None]
    return weight[e, rows, cols].contiguous()


def per_feature(vec: torch.Tensor, layout: Layout, offset: float = 0.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[F] -> [P, FT] (norm weights, biases); ``offset`` is added in fp32 (Gemma-style ``1 + w``)."""
    out = vec[layout.feature_index()]
    if offset:
        out = out.float() + offset
    return out.to(dtype or out.dtype).contiguous()


def router(weight: torch.Tensor, in_layout: Layout) -> torch.Tensor:
    """[E, H] -> [P, KT, E]: the router's logits come out token-major ([T, E] in PSUM) for top-k."""
    return weight[:, in_layout.feature_index()].permute(1, 2, 0).contiguous()


def rotate_half_matrix(head_dim: int, dtype: torch.dtype, rotary_dim: int = 0, interleaved: bool = False) -> torch.Tensor:
    """R with ``rotate_half(x) = R.T @ x`` over the head dimension (entries 0/±1: exact in any dtype). With a
    partial ``rotary_dim`` only the first ``rotary_dim`` features rotate; R is zero past them. ``interleaved``:
    the GPT-J pair rotation ``(x[2i], x[2i+1]) -> (-x[2i+1], x[2i])`` instead of the two halves."""
    if interleaved:
        r = torch.zeros(head_dim, head_dim, dtype=dtype)
        i = torch.arange(0, rotary_dim or head_dim, 2)
        r[i + 1, i] = -1.0
        r[i, i + 1] = 1.0
        return r
    h = (rotary_dim or head_dim) // 2
    r = torch.zeros(head_dim, head_dim, dtype=dtype)
    m = torch.arange(h)
    r[m + h, m] = -1.0
    r[m, m + h] = 1.0
    return r


def rotation_tiles(matrix: torch.Tensor, tile: int) -> torch.Tensor:
    """[D, D] -> [P, S, S, P] (``S = D / P`` partition tiles): block ``[:, i, j, :]`` maps input tile i to output
    tile j, so a head split over tiles rotates by matmuls contracting over one tile each (heads > 128)."""
    D = matrix.shape[0]
    S = D // tile
    return matrix.reshape(S, tile, S, tile).permute(1, 0, 2, 3).contiguous()


def rotation_blocks(matrix: torch.Tensor, tile: int) -> list[list[tuple[int, int]]]:
    """Per output tile j of a head-split rotation, its nonzero input tiles ``[(i, sign)]``: ``sign`` is +1/-1 when
    block (i, j) is a signed identity (rotate_half's half swap: no matmul needed), 0 for any other block."""
    S = matrix.shape[0] // tile
    eye = torch.eye(tile, dtype=matrix.dtype)
    out: list[list[tuple[int, int]]] = []
    for j in range(S):
        row = []
        for i in range(S):
            b = matrix[i * tile:(i + 1) * tile, j * tile:(j + 1) * tile]
            if not b.any():
                continue
            row.append((i, 1 if torch.equal(b, eye) else -1 if torch.equal(b, -eye) else 0))
        out.append(row)
    return out


def rotation_is_tile_swap(blocks: list[list[tuple[int, int]]]) -> bool:
    """Every output tile reads at most one input tile, by a signed identity: RoPE needs no matmul at all."""
    return all(len(row) <= 1 and all(sign for _, sign in row) for row in blocks)


def ones(p: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.ones(p, p, dtype=dtype)


def token_selectors(tokens: int, partitions: int, dtype: torch.dtype) -> torch.Tensor:
    """S[t', t, j] = (t' == t): ``S[:, t, :]`` as a matmul stationary broadcasts row t of a token-major tile."""
    eye = torch.eye(tokens, dtype=dtype)
    return eye[:, :, None].expand(tokens, tokens, partitions).contiguous()
