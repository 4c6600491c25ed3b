"""Spatial tiling of a decode: one settings type, TileSettings, read by three of diffusers' rules.

Image rule, exactly as diffusers' `AutoencoderKL.tiled_decode` does it (tile starts every
`overlap_size` latents, linear blend of the overlaps with the tile above and to the left, crop to
`row_limit`), plus a peak-memory estimate that decides when to tile (models/nn/tile_memory.py). Blending runs on host arrays:
each decoded tile is final output (only blended and cropped), so bringing it to the host right
away is what keeps device memory bounded by one tile. Unlike diffusers, which keeps every decoded
tile until the end, rows stream: only the previous row of tiles (their bottom `blend_extent`
rows) stays alive beside the output image. The values are the same because diffusers' blends
read exactly those rows (its in-place updates included).

Video rule, as diffusers' `AutoencoderKLWan.tiled_decode`: overlapping latent tiles, each decoded
with its own causal feature cache, blended linearly into the tile above and to the left, then
cropped to the stride (plan_video_tiles, stitch_video_tiles; the Wan decoder runs the loops).
"""
from __future__ import annotations

import logging
import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import interrupt
# the peak-memory estimates that decide when to tile (the tests and families reach them here)
from .tile_memory import (estimate_decode_peak_bytes, estimate_encode_peak_bytes,  # noqa: F401
                          estimate_tiled_peak_bytes, stage_bytes)

log = logging.getLogger("convserve.models")

DEFAULT_MEMORY_BUDGET = 1 << 30  # 1 GiB of working memory for one decode call
MIN_TILE_LATENT = 8


@dataclass(frozen=True)
class TileSettings:
    """A decoder's tiles (models/contract.py: `tiling`), in output pixels as diffusers'
    enable_tiling takes them: tiles `tile_px` a side, one every `stride_px`, each blended with its
    neighbours over the rest; `overlap` is that rest as a share of a tile.

    The image rule (image_tiles) is defined on `overlap` (diffusers' tile_overlap_factor: it
    rounds the stride itself, and stride_px is what that comes to) and tiles automatically
    (tiled=None) a decode whose estimated peak exceeds `memory_budget_bytes`. The video rule
    (video_tiles) is defined on tile_px and stride_px as given (diffusers' tile_sample_min_* and
    tile_sample_stride_*, which need not be whole latents); it has no memory budget (None): the
    Wan decoder tiles by frame size."""

    tile_px: int
    stride_px: int
    overlap: float
    memory_budget_bytes: int | None = None

    def __post_init__(self):
        if not 0 < self.stride_px <= self.tile_px:
            raise ValueError(f"tile stride {self.stride_px} must be in (0, tile size {self.tile_px}]")


# ---- the image rule (diffusers AutoencoderKL) ---------------------------------------------------
def image_tiles(tile_latent: int, spatial_factor: int, overlap: float = 0.25,
                memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET) -> TileSettings:
    """Tiles of `tile_latent` latents overlapping by `overlap` of a tile; settings diffusers would
    tile inconsistently are refused (validate_image_tiles)."""
    _check_image_tiles(tile_latent, spatial_factor, overlap)
    return TileSettings(tile_latent * spatial_factor, int(tile_latent * (1 - overlap)) * spatial_factor, overlap,
                        memory_budget_bytes)


def validate_image_tiles(settings: TileSettings, spatial_factor: int) -> None:
    _check_image_tiles(settings.tile_px // spatial_factor, spatial_factor, settings.overlap)


def _check_image_tiles(tile_latent: int, spatial_factor: int, overlap: float) -> None:
    """diffusers rounds the tile stride in latents and the blend width in pixels separately;
    unless they agree (stride * factor == row_limit) its tiled output is not 8x the latents
    (tile 10 at overlap 0.25 decodes 10x23 latents to 84x196). Such settings are refused."""
    plan = TilePlan(tile_latent, tile_latent * spatial_factor, overlap)
    if tile_latent < 2 or not 0 <= overlap < 1:
        raise ValueError(f"tile_latent_size must be >= 2 and 0 <= overlap < 1, got {tile_latent}, {overlap}")
    if not _tiles_consistently(tile_latent, spatial_factor, overlap):
        raise ValueError(f"tile_latent_size {tile_latent} with overlap {overlap} tiles "
                         f"inconsistently (stride {plan.overlap_size} latents vs {plan.row_limit} pixels "
                         f"kept); use a multiple of {round(1 / overlap) if overlap else 1}")


def smaller_image_tiles(settings: TileSettings, spatial_factor: int) -> TileSettings | None:
    """These settings with tiles about half the size (the largest consistent size at most half),
    or None at the floor (MIN_TILE_LATENT): a decode that ran out of memory retries in them."""
    size = settings.tile_px // spatial_factor
    if size // 2 < MIN_TILE_LATENT:
        return None
    new = _consistent_tile(size // 2, spatial_factor, settings.overlap)
    if new >= size:
        return None
    return dataclasses.replace(settings, tile_px=new * spatial_factor,
                               stride_px=int(new * (1 - settings.overlap)) * spatial_factor)


@dataclass(frozen=True)
class TilePlan:
    tile_latent: int       # diffusers' tile_latent_min_size
    tile_sample: int       # diffusers' tile_sample_min_size
    overlap_factor: float

    @property
    def overlap_size(self) -> int:
        return int(self.tile_latent * (1 - self.overlap_factor))

    @property
    def blend_extent(self) -> int:
        return int(self.tile_sample * self.overlap_factor)

    @property
    def row_limit(self) -> int:
        return self.tile_sample - self.blend_extent


def _auto_tile(model, tiled: bool | None, whole_bytes: Callable[[], int],
               tile_bytes: Callable[[int], int]) -> int | None:
    """The tile size, or None = run in one piece (tiled False, or auto (None) and the whole run fits the
    budget). Auto mode shrinks the tile until one tile's working set, tile_bytes(tile), fits too."""
    s = model.tiling
    if tiled is False or (tiled is None and whole_bytes() <= s.memory_budget_bytes):
        return None
    tile = s.tile_px // model.config.spatial_factor
    while tiled is None and tile > MIN_TILE_LATENT and tile_bytes(tile) > s.memory_budget_bytes:
        tile = _consistent_tile(tile // 2, model.config.spatial_factor, s.overlap)
    return tile


def plan_encode(model, x_shape: tuple[int, ...], tiled: bool | None) -> TilePlan | None:
    """None = encode in one piece; else diffusers' tiling rule (images larger than one tile)."""
    n, h, w = x_shape[0], x_shape[1], x_shape[2]
    f = model.config.spatial_factor
    tile = _auto_tile(model, tiled, lambda: estimate_encode_peak_bytes(model, n, h, w),
                      lambda t: estimate_encode_peak_bytes(model, n, min(h, t * f), min(w, t * f)))
    if tile is None or (h <= tile * f and w <= tile * f):
        return None
    return TilePlan(tile, tile * f, model.tiling.overlap)


def plan_decode(model, z_shape: tuple[int, ...], tiled: bool | None) -> TilePlan | None:
    """None = decode in one piece. diffusers tiles only when the latents exceed one tile."""
    n, h, w = z_shape[0], z_shape[1], z_shape[2]
    s = model.tiling
    tile = _auto_tile(model, tiled, lambda: estimate_decode_peak_bytes(model, n, h, w),
                      lambda t: estimate_tiled_peak_bytes(model, n, h, w, t))
    if tile is not None and tiled is None:
        tile = max(tile, MIN_TILE_LATENT)
        if estimate_tiled_peak_bytes(model, n, h, w, tile) > s.memory_budget_bytes:
            log.warning("%s: decode of %s latents may exceed the memory budget %d B even in %d-latent tiles",
                        model.name, z_shape, s.memory_budget_bytes, tile)
    if tile is None or (h <= tile and w <= tile):
        return None
    return TilePlan(tile, tile * model.config.spatial_factor, s.overlap)


def _tiles_consistently(tile: int, f: int, overlap: float) -> bool:
    """diffusers' tiled decode and tiled encode both come out at exactly 8x / 1/8 the input size."""
    p = TilePlan(tile, tile * f, overlap)
    stride_px = int(p.tile_sample * (1 - overlap))
    keep_latent = tile - int(tile * overlap)
    return p.overlap_size >= 1 and p.overlap_size * f == p.row_limit and stride_px == keep_latent * f


def _consistent_tile(tile: int, f: int, overlap: float) -> int:
    """The largest tile size <= `tile` that validate_image_tiles accepts."""
    for t in range(max(tile, 2), 1, -1):
        if _tiles_consistently(t, f, overlap):
            return t
    return tile


def blend_lines(a: np.ndarray, b: np.ndarray, extent: int, axis: int) -> None:
    """diffusers' blend_v / blend_h along `axis`, in place on b: its first `extent` lines fade in
    from the last lines of a (which holds at least those)."""
    extent = min(a.shape[axis], b.shape[axis], extent)
    if extent <= 0:
        return
    shape = [1] * b.ndim
    shape[axis] = extent
    wb = (np.arange(extent, dtype=np.float32) / np.float32(extent)).reshape(shape)
    head = [slice(None)] * b.ndim
    head[axis] = slice(0, extent)
    tail = [slice(None)] * a.ndim
    tail[axis] = slice(a.shape[axis] - extent, a.shape[axis])
    b[tuple(head)] = a[tuple(tail)] * (1 - wb) + b[tuple(head)] * wb


def tiled_decode(decode_tile: Callable[[np.ndarray], np.ndarray], z: np.ndarray, plan: TilePlan) -> np.ndarray:
    """z: unscaled latents, host NHWC. decode_tile: latents tile -> decoded tile (host NHWC)."""
    f = plan.tile_sample // plan.tile_latent
    return tiled_map(decode_tile, z, plan.tile_latent, plan.overlap_size, plan.blend_extent, plan.row_limit,
                     lambda size: size * f)


def tiled_encode(encode_tile: Callable[[np.ndarray], np.ndarray], x: np.ndarray, plan: TilePlan,
                 downsamples: int) -> np.ndarray:
    """diffusers' AutoencoderKL._tiled_encode: image tiles of tile_sample pixels every
    int(tile_sample * (1 - overlap)) pixels, blended over int(tile_latent * overlap) latents."""
    ts, tl, o = plan.tile_sample, plan.tile_latent, plan.overlap_factor
    blend = int(tl * o)

    def out_len(size: int) -> int:
        for _ in range(downsamples):  # 3x3 stride-2 conv, padding (0, 1): floor(n / 2)
            size = (size - 2) // 2 + 1
        return size

    return tiled_map(encode_tile, x, ts, int(ts * (1 - o)), blend, tl - blend, out_len)


def tiled_map(fn: Callable[[np.ndarray], np.ndarray], x: np.ndarray, tile: int, stride: int, blend: int,
              keep: int, out_len: Callable[[int], int]) -> np.ndarray:
    """The tiling loop shared by decode and encode (host NHWC in and out): input tiles of `tile`
    every `stride`, each output tile blended over `blend` rows/columns with its upper and left
    neighbours (diffusers' in-place blend_v / blend_h order), then cropped to `keep`."""
    n, h, w, _ = x.shape
    if stride < 1:
        raise ValueError(f"tile of {tile} with stride {stride} does not advance")
    starts_h, starts_w = list(range(0, h, stride)), list(range(0, w, stride))
    crop_h = [min(keep, out_len(min(tile, h - s))) for s in starts_h]
    crop_w = [min(keep, out_len(min(tile, w - s))) for s in starts_w]
    out: np.ndarray | None = None
    prev_strips: list[np.ndarray] | None = None
    y0 = 0
    for i, si in enumerate(starts_h):
        strips: list[np.ndarray] = []
        left: np.ndarray | None = None
        x0 = 0
        for j, sj in enumerate(starts_w):
            interrupt.check()  # its requesters gone: stop between tiles
            t = fn(np.ascontiguousarray(x[:, si:si + tile, sj:sj + tile]))
            if out is None:
                out = np.empty((n, sum(crop_h), sum(crop_w), t.shape[-1]), np.float32)
            if prev_strips is not None:
                blend_lines(prev_strips[j], t, blend, axis=1)
            if left is not None:
                blend_lines(left, t, blend, axis=2)
            out[:, y0:y0 + crop_h[i], x0:x0 + crop_w[j]] = t[:, :crop_h[i], :crop_w[j]]
            x0 += crop_w[j]
            strips.append(t[:, max(0, t.shape[1] - blend):].copy())
            left = t
        prev_strips = strips
        y0 += crop_h[i]
    assert out is not None
    return out


# ---- the tiny-decoder rule (diffusers AutoencoderTiny) -----------------------------------------
# Tiles are not cropped (unlike AutoencoderKL's rule): each is written whole, its first `blend`
# rows and columns toward earlier tiles faded in by a clamped ramp. Default: 64 latents, 1/8 overlap.
def tiny_tiles(tile_latent: int, spatial_factor: int, overlap: float = 0.125,
               memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET) -> TileSettings:
    blend = int(tile_latent * overlap)
    if not 1 <= blend < tile_latent:
        raise ValueError(f"tiles of {tile_latent} latents at overlap {overlap} blend over {blend}; need 1..tile-1")
    return TileSettings(tile_latent * spatial_factor, (tile_latent - blend) * spatial_factor, overlap,
                        memory_budget_bytes)


def smaller_tiny_tiles(settings: TileSettings, spatial_factor: int) -> TileSettings | None:
    half = settings.tile_px // spatial_factor // 2
    if half < MIN_TILE_LATENT or int(half * settings.overlap) < 1:
        return None
    return tiny_tiles(half, spatial_factor, settings.overlap, settings.memory_budget_bytes)


def ramp_blended_map(fn: Callable[[np.ndarray], np.ndarray], x: np.ndarray, tile: int, overlap: float,
                     scale: float, out_channels: int) -> np.ndarray:
    """AutoencoderTiny's _tiled_decode (scale = its factor) / _tiled_encode (scale = 1 / factor) on
    host NHWC: input tiles of `tile` every tile - int(tile * overlap), output offsets floored as
    diffusers' integer division does, the ramp's slope from the unfloored blend width as its does."""
    n, h, w, _ = x.shape
    blend = int(tile * overlap)
    ramp = np.arange(int(tile * scale), dtype=np.float32) / np.float32(max(blend * scale - 1, 1e-30))
    ramp = np.clip(ramp, 0, 1)
    out = np.zeros((n, int(h * scale), int(w * scale), out_channels), np.float32)
    for si in range(0, h, tile - blend):
        for sj in range(0, w, tile - blend):
            interrupt.check()  # its requesters gone: stop between tiles
            t = fn(np.ascontiguousarray(x[:, si:si + tile, sj:sj + tile]))
            y0, x0 = int(si * scale), int(sj * scale)
            region = out[:, y0:y0 + t.shape[1], x0:x0 + t.shape[2]]
            th, tw = region.shape[1:3]
            mask_y = ramp[:th] if si else np.ones(th, np.float32)
            mask_x = ramp[:tw] if sj else np.ones(tw, np.float32)
            mask = (mask_y[:, None] * mask_x[None, :])[None, :, :, None]
            region[...] = mask * t[:, :th, :tw] + (1 - mask) * region
    return out


# ---- the video rule (diffusers AutoencoderKLWan) -----------------------------------------------
# diffusers runs every tile through the whole clip before the next tile; the Wan decoder swaps the
# loops (latent frame outer, tile inner, one FeatureCache per tile) so frame groups still leave as
# they finish. Tiles never see each other, so the result is the same. Peak memory is then one
# tile's chunk activations plus every tile's cache (CACHE_T frames per conv).
def video_tiles(tile_px: int = 256, stride_px: int = 192) -> TileSettings:
    """Tiles of `tile_px` output pixels every `stride_px` (diffusers' defaults: 256 / 192)."""
    return TileSettings(tile_px, stride_px, (tile_px - stride_px) / tile_px if tile_px > 0 else 0.0)


def video_tiles_for_size(tile_size: int) -> TileSettings:
    """Tiles of `tile_size` output pixels a side, overlapping by a quarter (diffusers' 256/192)."""
    return video_tiles(int(tile_size), max(8, int(tile_size) * 3 // 4))


def smaller_video_tiles(settings: TileSettings, spatial_factor: int) -> TileSettings | None:
    """These settings with tile size and stride halved, or None below two latents a tile (one a
    stride): a decode that ran out of memory retries in them."""
    size, stride = settings.tile_px // 2, settings.stride_px // 2
    if size < 2 * spatial_factor or stride < spatial_factor:
        return None
    return video_tiles(size, stride)


@dataclass(frozen=True)
class VideoTilePlan:
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


def plan_video_tiles(latent_h: int, latent_w: int, spatial_factor: int,
                     settings: TileSettings) -> VideoTilePlan | None:
    """The tile grid, or None when the frame fits one tile (diffusers does not tile then: a
    single tile would be cropped to the stride)."""
    tile_latent = settings.tile_px // spatial_factor
    stride_latent = settings.stride_px // spatial_factor
    if tile_latent < 1 or stride_latent < 1:
        raise ValueError(f"tiles of {settings.tile_px}/{settings.stride_px} px are below one latent "
                         f"({spatial_factor} px)")
    if latent_h <= tile_latent and latent_w <= tile_latent:
        return None
    return VideoTilePlan(rows=tuple(range(0, latent_h, stride_latent)),
                         cols=tuple(range(0, latent_w, stride_latent)), tile_latent=tile_latent,
                         stride_px=settings.stride_px, blend_px=settings.tile_px - settings.stride_px,
                         out_h=latent_h * spatial_factor, out_w=latent_w * spatial_factor)


def stitch_video_tiles(plan: VideoTilePlan, tiles: list[list[np.ndarray]]) -> np.ndarray:
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
