"""Each MLX-backend conv path vs `mlx_native` in the same run, on the shapes of the three MLX
PRs the paths come from (seeds 000-002). Prints the device, the MLX version and, per shape,
native ms / path ms (> 1 means the path is faster than MLX's own dispatch).

    python benchmarks/mlx/mlx_paths.py [--reps 3] [--spatial-div N] [--frames T] [--dtype float32] [--only PATH]

On MLX's CPU device (Linux) the PR shapes are scaled down by default (conv3d: spatial / 8,
5 frames; conv_transpose1d: 41 input samples, 64 MiB unfold limit) because MLX's CPU conv runs
at ~2 GMAC/s; the shapes actually run are printed. On Metal they run at full size.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # this group's scripts; the repo (benchmarks.machine)
from benchmarks.machine import describe_machine  # noqa: E402

import mlx.core as mx  # noqa: E402

from convkernels import ConvSpec  # noqa: E402
from convkernels.backends.mlx.backend import MlxBackend  # noqa: E402


def make_runner(path, x, w, spec, **options):
    be = MlxBackend(timing_sample_rate=0.0, autotune=False, **options)
    be.paths.forced = path
    return be, (lambda: be.conv(x, w, spec))


ONLY: str | None = None


def row(label, path, x, w, spec, reps, **options):
    """native and path alternate rep by rep (the 2-core box is shared, load drifts), the
    ratio is the median of the per-rep ratios."""
    if ONLY and ONLY not in label and ONLY != path:
        return
    be_nat, nat = make_runner("mlx_native", x, w, spec, **options)
    be_path, alt = make_runner(path, x, w, spec, **options)
    mx.eval(nat())
    mx.eval(alt())
    t_nat, t_path = [], []
    for _ in range(reps):
        for fn, ts in ((nat, t_nat), (alt, t_path)):
            t0 = time.perf_counter()
            mx.eval(fn())
            ts.append(time.perf_counter() - t0)
    taken = {c["path"] for c in be_path.conv_choices()}
    taken = taken.pop() if len(taken) == 1 else taken
    note = "" if taken == path else f"  (guard refused: ran {taken})"
    ratio = statistics.median(a / b for a, b in zip(t_nat, t_path))
    print(f"{label:44s} {path:15s} {statistics.median(t_nat) * 1e3:10.2f} {statistics.median(t_path) * 1e3:10.2f} "
          f"{ratio:8.2f}x{note}", flush=True)


def main():
    metal = bool(mx.metal.is_available())
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--spatial-div", type=int, default=1 if metal else 8)
    ap.add_argument("--frames", type=int, default=0 if metal else 5, help="cap on conv3d frames (0: PR sizes)")
    ap.add_argument("--dtype", default="bfloat16" if metal else "float32")
    ap.add_argument("--only", help="run only shapes whose label contains this, or this path")
    args = ap.parse_args()
    global ONLY
    ONLY = args.only
    dt = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[args.dtype]
    print(f"machine: {describe_machine()}")
    print(f"mlx {mx.__version__}, device {mx.default_device()}, metal {metal}, dtype {args.dtype}, "
          f"median of {args.reps} alternating reps (nat/path: median of per-rep ratios, > 1: path faster)")
    print(f"{'shape (NHWC / NTHWC)':44s} {'path':15s} {'native ms':>10s} {'path ms':>10s} {'nat/path':>9s}")

    # PR 3446: depthwise 3x3, pad 1, stride 1; a mod-8 sibling; ConvNeXt's 7x7 stages
    for c, s, k in ((384, 60, 3), (768, 30, 3), (1536, 15, 3), (384, 64, 3), (192, 28, 7), (384, 14, 7),
                    (768, 7, 7)):
        x = mx.random.normal((1, s, s, c)).astype(dt)
        w = mx.random.normal((c, k, k, 1)).astype(dt)
        row(f"dw{k}x{k} {c}ch {s}x{s}", "depthwise_tail", x, w, ConvSpec.make(2, 1, k // 2, 1, c), args.reps)

    # PR 3785: 3x3x3, no depth padding, channels mod 16
    for t, h, wd, c in ((41, 60, 104, 256), (41, 120, 208, 512), (17, 64, 64, 256)):
        t = min(t, args.frames) if args.frames else t
        h, wd = max(3, h // args.spatial_div), max(3, wd // args.spatial_div)
        x = mx.random.normal((1, t, h, wd, c)).astype(dt)
        w = (mx.random.normal((c, 3, 3, 3, c)) * 0.05).astype(dt)
        spec = ConvSpec.make(3, 1, ((0, 0), (1, 1), (1, 1)))
        row(f"conv3d 3x3x3 {t}x{h}x{wd} {c}->{c}", "small_kd_2d", x, w, spec, min(args.reps, 3))

    # PR 3084: conv_transpose1d (1, 5158, 1), kernel 4096, stride 1024 (~86.6 GB unfold), as H=1
    length = 5158 if metal else 41
    limit = None if metal else 64 << 20
    x = mx.random.normal((1, 1, length, 1)).astype(dt)
    w = mx.random.normal((1, 1, 4096, 1)).astype(dt)
    spec = ConvSpec.make(2, (1, 1024), 0, transpose=True)
    lim = f", limit {limit >> 20} MiB" if limit else ""
    row(f"conv_transpose1d L={length} k4096 s1024{lim}", "tiled_unfold", x, w, spec, args.reps,
        unfold_limit_bytes=limit)


if __name__ == "__main__":
    main()
