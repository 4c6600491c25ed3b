"""Measured path choice of the NumPy backend: every valid path of a large conv is timed on random
operands and the fastest is kept (Winograd vs shift-gemm vs unfold flips with channels, size and
BLAS build). path_store.py keeps the choices on disk."""
from __future__ import annotations

import time

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


def time_paths(key: ConvKey, valid: list[ConvPath]) -> ConvPath:
    """Best of three interleaved timing rounds of each valid path on random operands."""
    rng = np.random.default_rng(0)
    dt = np.float64 if key.dtype == "float64" else np.float32
    x = rng.standard_normal(key.x_shape).astype(dt)
    w = rng.standard_normal(key.w_shape).astype(dt)
    # best of three interleaved rounds: the first absorbs cold costs (Winograd's weight
    # transform, first-touch pages) that decided single timings; interleaving keeps other
    # convs running in between, as in a model (Winograd: 78 ms looped alone, 92-126 ms so);
    # with two rounds a burst of load on a shared 2-core box still picked Winograd (197 ms)
    # over shift_gemm (125 ms) at 3x3 128ch 256x256 in one run of five
    best: dict[str, float] = {}
    contenders = list(valid)
    for round_ in range(3):
        for p in contenders:
            t0 = time.perf_counter()
            p.run(x, w, key, None, None, None)
            dt_s = time.perf_counter() - t0
            best[p.name] = min(best.get(p.name, dt_s), dt_s)
        if round_:
            # a path AUTOTUNE_DROP_FACTOR times slower than the leader once warm is not timed
            # again: it only lengthened a new shape's first call. Not after the cold first
            # round, where a weight transform (F(4x4): 0.1-0.3 s at 512ch) can triple a time
            lead = min(best.values())
            contenders = [p for p in contenders if best[p.name] < AUTOTUNE_DROP_FACTOR * lead]
    return min(contenders, key=lambda p: (best[p.name], p.cost(key)))
