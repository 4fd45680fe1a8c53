"""How a per-token feature vector sits in SBUF.

An activation ``x[T, F]`` is an SBUF tile ``[P, FT, T]`` (P partitions, FT feature chunks, T tokens). Two maps
from a feature ``f`` to ``(p, ft)`` are used:

* chunk-major (default): ``f = ft * P + p`` — chunk ``ft`` holds features ``[ft*P, (ft+1)*P)``. With ``P`` equal to
  the head size, chunk ``ft`` is exactly head ``ft``: per-head ops (q/k-norm, RoPE, attention) see one head per
  chunk with the head dimension on partitions.
* partition-major: ``f = p * FT + ft`` — each partition holds a contiguous run of features, so a store to an
  HBM row ``[T, F]`` moves ``FT`` contiguous elements per partition (used for kernel outputs such as logits).
* head-split (``split = S > 1``, heads larger than 128 partitions, e.g. Gemma's 256): a head of ``D = S * P``
  features is ``S`` partition tiles of ``P``; chunk ``ft = j * H + h`` holds tile ``j`` of head ``h`` (``H`` heads),
  i.e. ``f = h * D + j * P + p``. Tile-major chunk order makes "tile j of every head" (RoPE's half swap, the
  norm's per-tile sums) and "tile j of a head group" (attention's query group) contiguous chunk ranges.

Matmuls put the contraction on partitions; because fusegraph lays out every weight for the kernel (see
:mod:`.weights`), any input layout and any output layout cost the same, so layouts are chosen for the *other*
ops: per-head ops need ``P = head_dim`` (or ``head_dim / S`` when split), everything else takes the largest
``P <= 128`` dividing ``F``.
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
    split: int = 1  # partition tiles per head (head-split layout, see the module docstring); 1: not split

    def __repr__(self) -> str:
        # the unsplit form is the one kernel-argument roles were always named by
        extra = f", split={self.split}" if self.split != 1 else ""
        return f"Layout(P={self.P}, FT={self.FT}, pmajor={self.pmajor}{extra})"

    @property
    def features(self) -> int:
        return self.P * self.FT

    @property
    def heads(self) -> int:
        """Heads of a head-split layout (chunks per partition tile)."""
        return self.FT // self.split

    def feature_index(self) -> torch.Tensor:
        """``idx[p, ft]`` = the feature stored at partition p, chunk ft."""
        p = torch.arange(self.P)[:, None]
        ft = torch.arange(self.FT)[None, :]
        if self.split != 1:
            H = self.heads
            return (ft % H) * (self.split * self.P) + (ft // H) * self.P + p
        return p * self.FT + ft if self.pmajor else ft * self.P + p

    def row_pattern(self) -> list[list[int]]:
        """DMA access pattern ``[[stride, count], ...]`` of one HBM row ``[F]`` in (partition, chunk) order: what
        embedding gathers, loads and stores move between an HBM row and an SBUF tile ``[P, FT]``."""
        if self.split != 1:  # (p, tile j, head h) -> h * D + j * P + p
            return [[1, self.P], [self.P, self.split], [self.P * self.split, self.heads]]
        return [[self.FT, self.P], [1, self.FT]] if self.pmajor else [[1, self.P], [self.P, self.FT]]

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


def experts_intermediate_layout(intermediate: int) -> Layout:
    """The layout of an expert's intermediate vector (the gate/up output, the down input)."""
    return Layout(largest_divisor(intermediate), intermediate // largest_divisor(intermediate))


def head_split(head_size: int) -> int:
    """Partition tiles for a head of ``head_size`` features: the fewest equal tiles of <= 128 (256 -> 2 x 128)."""
    for tiles in range(-(-head_size // PMAX), head_size + 1):
        if head_size % tiles == 0 and head_size // tiles >= 8:
            return tiles
    raise CodegenError(f"head size {head_size} does not split into equal partition tiles of 8..{PMAX}")


def choose(features: int, head_size: int | None = None, pmajor: bool = False) -> Layout:
    """The layout for a vector of ``features``; per-head values put the head dimension on partitions."""
    if head_size:
        if features % head_size:
            raise CodegenError(f"{features} features are not a whole number of heads of size {head_size}")
        if head_size > PMAX:
            tiles = head_split(head_size)
            return Layout(head_size // tiles, features // head_size * tiles, pmajor=False, split=tiles)
        return Layout(head_size, features // head_size, pmajor=False)
    p = largest_divisor(features)
    if p < 8 and features > 64:
        raise CodegenError(f"{features} features only split over {p} partitions (a prime-like size); refusing a layout this slow")
    return Layout(p, features // p, pmajor=pmajor)
