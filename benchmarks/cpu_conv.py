"""NumPy backend vs PyTorch CPU (and MLX CPU where installed) on the conv shapes of
../shared/PEERS.md. Prints a ratio table (peer time / ours: > 1 means we are faster).

    python benchmarks/cpu_conv.py [--reps 5] [--no-mlx]

Each time is the median of at least --reps calls and at least 0.5 s of calls.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402

from convkernels import get_backend  # noqa: E402

# name, N, H, W, C_in, C_out, k, groups, target ratio (peer/ours)
SHAPES = [
    ("3x3 512->512 64x64", 1, 64, 64, 512, 512, 3, 1, 0.8),
    ("3x3 128->128 256x256", 1, 256, 256, 128, 128, 3, 1, 0.8),
    ("dw7x7 96ch 56x56", 1, 56, 56, 96, 96, 7, 96, 0.5),
    ("dw7x7 384ch 14x14", 1, 14, 14, 384, 384, 7, 384, 0.5),
]


def timeit(fn, reps, min_seconds=0.5):
    """Median of at least `reps` calls, and of enough calls to fill `min_seconds`: five samples of
    a 0.2 ms conv are mostly timer noise and the other runtime's threads winding down."""
    fn()
    ts = []
    start = time.perf_counter()
    while len(ts) < reps or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-mlx", action="store_true")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    be = get_backend("numpy")
    mx = None
    if not args.no_mlx:
        try:
            import mlx.core as mx
        except ImportError:
            mx = None
    print(f"machine: {describe_machine()}")
    head = f"{'conv (NHWC, fp32, batch 1)':26s} {'ours ms':>9s} {'torch ms':>9s} {'torch/ours':>10s} {'target':>7s}"
    if mx is not None:
        head += f" {'mlx-cpu ms':>10s} {'mlx/ours':>9s}"
    print(head)
    rows = []
    rng = np.random.default_rng(0)
    for name, n, h, w, cin, cout, k, g, target in SHAPES:
        x = rng.standard_normal((n, h, w, cin)).astype(np.float32)
        wt = (rng.standard_normal((cout, k, k, cin // g)) * 0.05).astype(np.float32)
        reps = args.reps if h * w * cin * cout // g < 1e9 else max(2, args.reps // 2)
        ours = timeit(lambda: be.conv2d(x, wt, padding=k // 2, groups=g), reps)
        xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
        wtt = torch.from_numpy(wt).permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            peer = timeit(lambda: F.conv2d(xt, wtt, padding=k // 2, groups=g), reps)
        line = f"{name:26s} {ours * 1e3:9.2f} {peer * 1e3:9.2f} {peer / ours:10.2f} {target:7.1f}"
        if mx is not None:
            xm, wm = mx.array(x), mx.array(wt)
            def run_mlx():
                mx.eval(mx.conv2d(xm, wm, padding=k // 2, groups=g))
            mt = timeit(run_mlx, max(1, reps // 2))
            line += f" {mt * 1e3:10.1f} {mt / ours:9.2f}"
        print(line, flush=True)
        rows.append((name, ours, peer))
    print("path choices:", sorted({(c['op'], c['path']) for c in be.conv_choices()}))


if __name__ == "__main__":
    main()
