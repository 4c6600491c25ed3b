"""The NumPy backend's cost model: which conv path a new shape takes before anything is timed.

Timing every valid path inside a request made a new shape's first call cost ~9 steady ones
(SD-VAE 256 decode on 2 cores: 33.5 s first, 3.6 s steady), and on a shared box those timings
were noise (the same Winograd conv measured 15 ms idle and 370-1500 ms while other jobs ran). So
a new shape's choice is an estimate instead: three machine rates, measured once per process in
~0.1 s (gemm multiply-adds per second, streaming memory bytes per second, cache-resident bytes per
second), applied to what each path does: its gemm multiply-adds, the bytes it streams through
memory and the bytes it re-reads from cache. The background tuner (background.py) times the
candidates later, off the request path, and a measured choice then replaces the estimate.

Checked against timings of every SD-VAE decoder conv (where the measured best was clear): Winograd
F(4x4) < F(2x2) < shift_gemm < unfold for 3x3 convs of 128-512 channels, shift_gemm for the 3-channel
output conv; tests/test_numpy_first_call.py holds the model to that.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import numpy as np

from ...paths import ConvPath
from ...spec import ConvKey, prod
from . import conv as nc


@dataclass(frozen=True)
class MachineRates:
    gemm_macs_per_s: float
    memory_bytes_per_s: float
    cache_bytes_per_s: float


#: stand-in rates (a 2-core AVX2 box) for where measuring is not wanted (tests of the rules)
NOMINAL = MachineRates(gemm_macs_per_s=4e10, memory_bytes_per_s=1e10, cache_bytes_per_s=4e10)

_rates: MachineRates | None = None
_rates_lock = threading.Lock()


def _best_of(fn, reps: int = 3) -> float:
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def measure_rates() -> MachineRates:
    """The three rates, best of three short runs each (~0.1 s in all); measured once per process."""
    global _rates
    with _rates_lock:
        if _rates is not None:
            return _rates
        rng = np.random.default_rng(0)
        # a gemm of the shape the paths run (thousands of rows, hundreds of channels)
        a = rng.standard_normal((1024, 512), dtype=np.float32)
        b = rng.standard_normal((512, 512), dtype=np.float32)
        out = np.empty((1024, 512), np.float32)
        gemm = 1024 * 512 * 512 / _best_of(lambda: np.matmul(a, b, out=out))
        # streaming: a 16 MiB copy (read + write) is past a 2-core box's caches
        src = np.ones(4 << 20, np.float32)
        dst = np.empty_like(src)
        memory = 2 * src.nbytes / _best_of(lambda: np.copyto(dst, src))
        # cache-resident: the accumulation of an L2-sized tile (read two, write one)
        acc, t = np.ones(64 << 10, np.float32), np.ones(64 << 10, np.float32)

        def adds():
            for _ in range(16):
                acc.__iadd__(t)
        cache = 16 * 3 * acc.nbytes / _best_of(adds)
        _rates = MachineRates(gemm, memory, max(cache, memory))
        return _rates


def _cost(gemm_macs: float, memory_bytes: float, cache_bytes: float, r: MachineRates) -> float:
    return gemm_macs / r.gemm_macs_per_s + memory_bytes / r.memory_bytes_per_s + cache_bytes / r.cache_bytes_per_s


def _winograd(key: ConvKey, tile: nc.WinogradTile, r: MachineRates, item: int) -> float:
    n, h, w, c = key.x_shape
    ho, wo, o = key.out_shape[1], key.out_shape[2], key.out_channels
    th, tw, q = tile.tiles(ho), tile.tiles(wo), tile.planes
    tiles = n * th * tw
    # the transformed weights are re-read by each tile-row group's batched gemm
    rows = max(1, min(th, nc.WINOGRAD_TILE_BYTES // max(1, q * tw * max(c, o) * 4)))
    groups = n * math.ceil(th / rows)
    memory = (n * h * w * c + n * ho * wo * o) * item + groups * q * c * o * 4
    # V and M: written by the transforms, read by the gemms (a 16 MiB tile: L3 at best)
    transformed = 2 * q * tiles * (c + o) * item
    return _cost(q * tiles * c * o, memory + transformed / 2, transformed / 2, r)


def _winograd_3d(key: ConvKey, tile: nc.WinogradTile, r: MachineRates, item: int) -> float:
    """conv_winograd_3d: every padded input frame transformed once into V (planes, tiles, frames, C),
    then per output frame one batched gemm over kT frames (a kT C-deep reduction) and its output
    transform. The transformed weights (planes, kT C, O) are re-read per output frame and row group:
    from memory once, from cache after that (charged all from memory, F(4x4)'s 2.25x larger
    weights lost a 16 x 16 conv that it won by 25 %, 2-core Xeon 2026-11-29)."""
    n, t_in, h, w, c = key.x_shape
    t_out, ho, wo, o = key.out_shape[1:]
    kt, (tlo, thi) = key.kernel[0], key.spec.padding[0]
    frames = t_in + tlo + thi
    th, tw, q = tile.tiles(ho), tile.tiles(wo), tile.planes
    rows = max(1, min(th, nc.WINOGRAD_TILE_BYTES // max(1, q * tw * frames * c * 4)))
    groups = n * math.ceil(th / rows)
    tiles = n * th * tw
    weights = q * kt * c * o * 4
    memory = (n * t_in * h * w * c + n * t_out * ho * wo * o) * item + weights
    transformed = 2 * q * tiles * (frames * c + t_out * o) * item
    return _cost(q * tiles * t_out * kt * c * o, memory + transformed / 2,
                 transformed / 2 + (groups * t_out - 1) * weights, r)


def estimate(path: ConvPath, key: ConvKey, r: MachineRates) -> float:
    """Seconds the path is expected to take on `key`. Paths without a model of their own (sub-pixel,
    depthwise) are charged their static cost rule as gemm multiply-adds plus
    one pass over input and output: they rarely compete with a modelled path, and where they do,
    background measurement has the last word."""
    item = 8 if key.dtype == "float64" else 4
    x_bytes, out_bytes = prod(key.x_shape) * item, prod(key.out_shape) * item
    name = path.name
    if name == "winograd_f2x3":
        if key.dtype == "float64":  # the pure NumPy transforms: several more passes over V and M
            return 2 * _winograd(key, nc.F2X3, r, item)
        return _winograd(key, nc.F2X3, r, item)
    if name == "winograd_f4x3":
        return _winograd(key, nc.F4X3, r, item)
    if name in ("winograd_f2x3_3d", "winograd_f4x3_3d"):
        return _winograd_3d(key, nc.F2X3 if name == "winograd_f2x3_3d" else nc.F4X3, r, item)
    if name == "shift_gemm":
        # every tap's gemm runs over the padded rows (padded width, valid rows), and its product
        # is added into a cache-sized accumulator tile
        s = key.spec
        sp = [v + lo + hi for v, (lo, hi) in zip(key.x_shape[1:-1], s.padding)]
        rows = key.x_shape[0] * key.out_shape[1] * prod(sp[1:])
        taps = prod(key.kernel)
        macs = rows * taps * key.in_channels * key.out_channels
        return _cost(macs, x_bytes + 2 * out_bytes, 3 * (taps - 1) * rows * key.out_channels * item, r)
    if name in ("im2col_gemm", "tiled_unfold"):
        taps = prod(key.kernel)
        cols = prod(key.out_shape[:-1]) * taps * key.in_channels * item // max(1, key.spec.groups)
        if key.spec.transpose:  # col2im: the gemm's columns scattered back, read and written
            cols = prod(key.x_shape[:-1]) * taps * key.out_channels * item
        return _cost(key.macs(), x_bytes + out_bytes + 2 * cols, 0.0, r)
    if name == "pointwise_gemm":
        return _cost(key.macs(), x_bytes + out_bytes, 0.0, r)
    return _cost(path.cost(key), x_bytes + out_bytes, 0.0, r)


def model_choice(key: ConvKey, valid: list[ConvPath], r: MachineRates) -> ConvPath:
    """The valid path with the least estimated time (ties: the static cost rule)."""
    return min(valid, key=lambda p: (estimate(p, key, r), p.cost(key)))
