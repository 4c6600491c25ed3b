"""A video decoder's latents, prepared frame by frame as the decode reaches them.

The decode wants its latents de-normalised (the model's per-channel affine map, e.g. x * std +
mean) and channels-last (N, T, h, w, C), one latent frame (or run of frames) at a time. Doing
that for the whole clip before the first frame group costs several passes over it (121 frames
at 720p: 28 MB, 20-40 ms on a 2-core host) that a stream's first group then waits for. Here a
clip is checked whole up front (bad latents still fail before the first group) and each slice
is prepared only when asked for, so the first group waits for its own frame's work only.
"""
from __future__ import annotations

from typing import Callable

import numpy as np


class PreparedLatents:
    """(N, C, T, h, w) latents seen as the de-normalised, channels-last (N, T, h, w, C) float32
    array the decode reads: `shape` is that array's, and z[:, a:b, ...] gives its frames a..b
    (with any further indexing of rows and columns), computed then."""

    def __init__(self, latents: np.ndarray, denormalise: Callable[[np.ndarray], np.ndarray], name: str):
        lat = np.asarray(latents)
        if lat.dtype.kind != "f":
            raise ValueError(f"{name}: latents must be floating point, got {lat.dtype}")
        # the map is affine per channel, so its results over a channel lie between those of that
        # channel's smallest and largest latent: both finite means every result is (and a NaN or
        # an Inf anywhere in the latents shows in them)
        ends = [lat.min(axis=(0, 2, 3, 4), keepdims=True), lat.max(axis=(0, 2, 3, 4), keepdims=True)]
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is the finding, not a warning
            finite = all(np.isfinite(denormalise(e.astype(np.float32))).all() for e in ends)
        if not finite:
            raise ValueError(f"{name}: latents contain NaN or Inf (or overflow when de-normalised)")
        self._lat, self._denormalise = lat, denormalise
        n, c, t, h, w = lat.shape
        self.shape = (n, t, h, w, c)

    def __getitem__(self, key) -> np.ndarray:
        """z[:, frames] or z[:, frames, rows, cols]: the first index must take every batch item."""
        key = key if isinstance(key, tuple) else (key,)
        if len(key) < 2 or key[0] != slice(None) or not isinstance(key[1], slice):
            raise IndexError("index a prepared clip as z[:, start:stop, ...]")
        frames = self._denormalise(self._lat[:, :, key[1]].astype(np.float32))
        return np.ascontiguousarray(frames.transpose(0, 2, 3, 4, 1)[(slice(None), slice(None), *key[2:])])
