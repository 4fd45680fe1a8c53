"""How a per-token feature vector sits in SBUF.

An activation ``x[T, F]`` is an SBUF tile ``[P, FT, T]`` (P partitions, FT feature chunks, T tokens). Two maps
from a feature ``f`` to ``(p, ft)`` are used:

* chunk-major (default): ``f = ft * P + p`` — chunk ``ft`` holds features ``[ft*P, (ft+1)*P)``. With ``P`` equal to
  the head size, chunk ``ft`` is exactly head ``ft``: per-head ops (q/k-norm, RoPE, attention) see one head per
  chunk with the head dimension on partitions.
* partition-major: ``f = p * FT + ft`` — each partition holds a contiguous run of features, so a store to an
  HBM row ``[T, F]`` moves ``FT`` contiguous elements per partition (used for kernel outputs such as logits).

Matmuls put the contraction on partitions; because fusegraph lays out every weight for the kernel (see
:mod:`.weights`), any input layout and any output layout cost the same, so layouts are chosen for the *other*
ops: per-head ops need ``P = head_dim``, everything else takes the largest ``P <= 128`` dividing ``F``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import CodegenError

PMAX = 128


def largest_divisor(n: int, limit: int = PMAX) -> int:
    for p in range(min(n, limit), 0, -1):
        if n % p == 0:
            return p
    return 1


@dataclass(frozen=True)
class Layout:
    P: int
    FT: int
    pmajor: bool = False

    @property
    def features(self) -> int:
        return self.P * self.FT

    def feature_index(self) -> torch.Tensor:
        """``idx[p, ft]`` = the feature stored at partition p, chunk ft."""
        p = torch.arange(self.P)[:, None]
        ft = torch.arange(self.FT)[None, :]
        return p * self.FT + ft if self.pmajor else ft * self.P + p

    def to_tile(self, x: torch.Tensor) -> torch.Tensor:
        """[T, F] -> [P, FT, T] (host-side helper for tests and the reference VM)."""
        idx = self.feature_index()
        return x[:, idx].permute(1, 2, 0).contiguous()

    def from_tile(self, tile: torch.Tensor) -> torch.Tensor:
        """[P, FT, T] -> [T, F]."""
        T = tile.shape[-1]
        out = torch.empty(T, self.features, dtype=tile.dtype)
        out[:, self.feature_index().reshape(-1)] = tile.reshape(self.P * self.FT, T).T
        return out


def choose(features: int, head_size: int | None = None, pmajor: bool = False) -> Layout:
    """The layout for a vector of ``features``; per-head values put the head dimension on partitions."""
    if head_size:
        if head_size > PMAX:
            raise CodegenError(f"head size {head_size} > {PMAX} partitions is not supported by the attention templates")
        if features % head_size:
            raise CodegenError(f"{features} features are not a whole number of heads of size {head_size}")
        return Layout(head_size, features // head_size, pmajor=False)
    p = largest_divisor(features)
    if p < 8 and features > 64:
        raise CodegenError(f"{features} features only split over {p} partitions (a prime-like size); refusing a layout this slow")
    return Layout(p, features // p, pmajor=pmajor)
