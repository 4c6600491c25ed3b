"""Arrays on their way to the host: the 8-bit pixel rule every backend's to_host_async(...,
uint8=True) matches, and the handle of a copy that is already done."""
from __future__ import annotations

import numpy as np


def pixels_to_uint8(x: np.ndarray) -> np.ndarray:
    """Images in [0, 1] as 8-bit: floor(clip(x, 0, 1) * 255 + 0.5), each step in float32 and
    rounded on its own (no fused multiply-add), as the service's codecs.to_uint8 computes on
    float32 arrays. Every backend's to_host_async(..., uint8=True) matches it bit for bit on
    the float32 values the same array would have come back as. NaN becomes 0 (NumPy's cast of
    NaN to uint8 is unspecified; the device kernels define it as 0)."""
    x = np.asarray(x, dtype=np.float32)
    y = np.clip(x, np.float32(0.0), np.float32(1.0))
    y *= np.float32(255.0)
    y += np.float32(0.5)
    nan = np.isnan(y)
    if nan.any():
        y[nan] = 0.0
    return y.astype(np.uint8)


class HostReady:
    """A to_host_async whose copy is already done."""

    def __init__(self, host: np.ndarray):
        self._host = host

    def result(self) -> np.ndarray:
        return self._host
