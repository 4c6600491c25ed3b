"""Shared by the CPU and GPU tests of 8-bit pixels leaving a backend (to_host_async(uint8=True)):
the host formula they must match bit for bit, and float32 values that tell it apart from near
misses (float64 arithmetic, round-half-even, a missing clip)."""
from __future__ import annotations

import numpy as np


def host_to_uint8(images01: np.ndarray) -> np.ndarray:
    """service.codecs.to_uint8 as written there (copied, so the GPU tests need no service
    imports; tests/test_backend_uint8.py checks the two agree), on float32 input."""
    with np.errstate(invalid="ignore"):  # NaN: NumPy's cast gives 0 on x86 and warns
        return (np.clip(images01, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def edge_values() -> np.ndarray:
    """float32: 0, 1, -0, below 0, above 1, +-inf, every k / 255, and the values next to every
    x * 255 = k + 0.5 boundary (the exact quotient and 3 ulps either side). At 128 of these a
    float64 computation of the same formula gives another byte; round-half-even at 130."""
    k = np.arange(256)
    bits = ((k + 0.5) / 255).astype(np.float32).view(np.int32)
    near = (bits[:, None] + np.arange(-3, 4)[None, :]).ravel().astype(np.int32).view(np.float32)
    exact = (k / 255).astype(np.float32)
    special = np.array([0.0, -0.0, 1.0, np.nextafter(1, 2), np.nextafter(0, -1), -1e-30, 1e-30, -0.5, 1.5,
                        -3.0, 7.0, 65504.0, -65504.0, np.inf, -np.inf], np.float32)
    return np.concatenate([special, exact, near]).astype(np.float32)


def pixel_array(rng: np.random.Generator, shape) -> np.ndarray:
    """float32 of `shape`: the edge values first (as many as fit), the rest uniform on [-0.2, 1.2]."""
    x = rng.uniform(-0.2, 1.2, int(np.prod(shape))).astype(np.float32)
    edges = edge_values()
    n = min(edges.size, x.size)
    x[:n] = edges[:n]
    return x.reshape(shape)
