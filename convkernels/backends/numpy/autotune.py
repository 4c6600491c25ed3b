"""Measured path choice of the NumPy backend: every valid path of a large conv is timed on random
operands and the fastest is kept (Winograd vs shift-gemm vs unfold flips with channels, size and
BLAS build). By default this runs in the background (background.py), after cost_model.py has
answered the request; path_store.py keeps the choices on disk."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from ...paths import ConvPath
from ...spec import ConvKey

#: after each autotune round, paths this many times slower than the fastest stop being timed
AUTOTUNE_DROP_FACTOR = 2.5


def work_key(key: ConvKey) -> tuple:
    """What a measurement depends on. The epilogue runs after every path alike, and moving padding
    between the two sides of an axis moves no work: SD-VAE's upsampling phase convs (four
    paddings) and convs with and without a residual share one measurement, which halved a first
    decode."""
    s = key.spec
    return (key.op, key.x_shape, key.w_shape, key.dtype, s.stride, s.dilation, s.groups, s.transpose,
            s.output_padding, tuple(lo + hi for lo, hi in s.padding))


def random_operands(key: ConvKey) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    dt = np.float64 if key.dtype == "float64" else np.float32
    return rng.standard_normal(key.x_shape).astype(dt), rng.standard_normal(key.w_shape).astype(dt)


def run_timed(p: ConvPath, key: ConvKey, x, w) -> float:
    t0 = time.perf_counter()
    p.run(x, w, key, None, None, None)
    return time.perf_counter() - t0


def time_paths(key: ConvKey, valid: list[ConvPath],
               run_one: Callable[[ConvPath, ConvKey, np.ndarray, np.ndarray], float] = run_timed,
               timings: dict | None = None) -> ConvPath:
    """Best of three interleaved timing rounds of each valid path on random operands. `run_one`
    times one run of one path (the background tuner's waits for an idle process first);
    `timings`, when given, receives each path's best seconds."""
    x, w = random_operands(key)
    # best of three interleaved rounds: the first absorbs cold costs (Winograd's weight
    # transform, first-touch pages) that decided single timings; interleaving keeps other
    # convs running in between, as in a model (Winograd: 78 ms looped alone, 92-126 ms so);
    # with two rounds a burst of load on a shared 2-core box still picked Winograd (197 ms)
    # over shift_gemm (125 ms) at 3x3 128ch 256x256 in one run of five
    best: dict[str, float] = {} if timings is None else timings
    contenders = list(valid)
    for round_ in range(3):
        for p in contenders:
            dt_s = run_one(p, key, x, w)
            best[p.name] = min(best.get(p.name, dt_s), dt_s)
        if round_:
            # a path AUTOTUNE_DROP_FACTOR times slower than the leader once warm is not timed
            # again: it only lengthened a new shape's first call. Not after the cold first
            # round, where a weight transform (F(4x4): 0.1-0.3 s at 512ch) can triple a time
            lead = min(best.values())
            contenders = [p for p in contenders if best[p.name] < AUTOTUNE_DROP_FACTOR * lead]
    return min(contenders, key=lambda p: (best[p.name], p.cost(key)))
