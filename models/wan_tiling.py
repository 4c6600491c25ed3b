"""Spatial tiling for the Wan video VAE decode, as diffusers' `AutoencoderKLWan.tiled_decode`:
overlapping latent tiles, each decoded with its own causal feature cache, blended linearly
into the tile above and to the left, then cropped to the stride.

diffusers runs every tile through the whole clip before the next tile; here the loops are
swapped (latent frame outer, tile inner, one FeatureCache per tile) so frame groups still
leave as they finish. Tiles never see each other, so the result is the same. Peak memory is
then one tile's chunk activations plus every tile's cache (CACHE_T frames per conv)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .tiling import blend_lines


@dataclass(frozen=True)
class TileSettings:
    """Sizes in output pixels, as diffusers' enable_tiling takes them."""

    min_size: int = 256      # tile_sample_min_height/width
    stride: int = 192        # tile_sample_stride_height/width

    def __post_init__(self):
        if not 0 < self.stride <= self.min_size:
            raise ValueError(f"tile stride {self.stride} must be in (0, tile size {self.min_size}]")

    @classmethod
    def for_tile_size(cls, tile_size: int) -> TileSettings:
        """Tiles of `tile_size` output pixels a side, overlapping by a quarter (diffusers' 256/192)."""
        return cls(int(tile_size), max(8, int(tile_size) * 3 // 4))

    def halved(self, spatial_factor: int) -> TileSettings | None:
        """These settings with tile size and stride halved, or None below two latents a tile (one
        a stride): a decode that ran out of memory retries in them."""
        size, stride = self.min_size // 2, self.stride // 2
        if size < 2 * spatial_factor or stride < spatial_factor:
            return None
        return dataclasses.replace(self, min_size=size, stride=stride)


@dataclass(frozen=True)
class TilePlan:
    rows: tuple[int, ...]    # latent start row of each tile row
    cols: tuple[int, ...]
    tile_latent: int
    stride_px: int
    blend_px: int
    out_h: int
    out_w: int

    @property
    def count(self) -> int:
        return len(self.rows) * len(self.cols)


def plan_tiles(latent_h: int, latent_w: int, spatial_factor: int, settings: TileSettings) -> TilePlan | None:
    """The tile grid, or None when the frame fits one tile (diffusers does not tile then: a
    single tile would be cropped to the stride)."""
    tile_latent = settings.min_size // spatial_factor
    stride_latent = settings.stride // spatial_factor
    if tile_latent < 1 or stride_latent < 1:
        raise ValueError(f"tiles of {settings.min_size}/{settings.stride} px are below one latent "
                         f"({spatial_factor} px)")
    if latent_h <= tile_latent and latent_w <= tile_latent:
        return None
    return TilePlan(rows=tuple(range(0, latent_h, stride_latent)), cols=tuple(range(0, latent_w, stride_latent)),
                    tile_latent=tile_latent, stride_px=settings.stride,
                    blend_px=settings.min_size - settings.stride,
                    out_h=latent_h * spatial_factor, out_w=latent_w * spatial_factor)


def stitch(plan: TilePlan, tiles: list[list[np.ndarray]]) -> np.ndarray:
    """Blend and crop one chunk's decoded tiles (N, f, th, tw, 3 each, row-major grid) into
    (N, f, H, W, 3). Blends in place in diffusers' order, so each tile blends with its
    neighbours as already blended."""
    out_rows = []
    for i, row in enumerate(tiles):
        pieces = []
        for j, tile in enumerate(row):
            if i > 0:
                blend_lines(tiles[i - 1][j], tile, plan.blend_px, axis=2)
            if j > 0:
                blend_lines(row[j - 1], tile, plan.blend_px, axis=3)
            pieces.append(tile[:, :, :plan.stride_px, :plan.stride_px])
        out_rows.append(np.concatenate(pieces, axis=3))
    return np.ascontiguousarray(np.concatenate(out_rows, axis=2)[:, :, :plan.out_h, :plan.out_w])
