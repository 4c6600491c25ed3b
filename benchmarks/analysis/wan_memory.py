"""Peak live array memory of one Wan 2.1 VAE decode on the NumPy backend.

The model code is the one the CUDA backend runs, so references it keeps alive show up here as
they do in the CuPy pool. Live bytes are numpy's allocations as `tracemalloc` traces them,
counted from after the model load (weights excluded). Prints, per latent shape: the peak of one
decode, its time (a separate run without tracing), the per-chunk peaks with what each chunk
starts with (the causal cache plus what the caller holds), and a floor: the cache the decode
must carry (CACHE_T input frames per cached conv) plus the largest chunk's two biggest
activations (a conv's input and output, alive together).

    python benchmarks/analysis/wan_memory.py [--preset wan2.1-vae] [--shapes 3x12x20 2x24x40] [--profile]

--profile also prints the ops whose calls reached the highest live bytes (live before the call,
the call's own peak above that), by layer: where the decode's peak sits.
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo (benchmarks.machine)
from benchmarks.machine import describe_machine  # noqa: E402

from convkernels import get_backend  # noqa: E402
from models import load_model  # noqa: E402
from models.wan_vae.layers import FeatureCache  # noqa: E402

MIB = 1 << 20


def slot_bytes(state: FeatureCache) -> int:
    return sum(s.nbytes for s in state.slots if isinstance(s, np.ndarray))


def decode_traced(model, lat):
    """One decode, groups dropped as they come: (peak, per-chunk [(start live, peak, cache)],
    steady cache bytes, the largest conv's input + output bytes)."""
    b = model.backend
    big = [0]
    origs = {n: getattr(b, n) for n in ("conv3d", "conv2d", "upsample_conv2d")}

    def watch(f):
        def w(x, *a, **k):
            out = f(x, *a, **k)
            big[0] = max(big[0], x.nbytes + out.nbytes)
            return out
        return w

    for n, f in origs.items():
        setattr(b, n, watch(f))
    chunks = []
    z = model._prepare(lat)
    state = FeatureCache()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    overall = cache = 0
    try:
        for k in range(z.shape[1]):
            tracemalloc.reset_peak()
            start = tracemalloc.get_traced_memory()[0] - base
            group = model._decode_chunk(z[:, k:k + 1], state, clip=(0.0, 1.0)).result()
            peak = tracemalloc.get_traced_memory()[1] - base
            del group
            chunks.append((start, peak, slot_bytes(state)))
            overall = max(overall, peak)
            cache = max(cache, slot_bytes(state))
    finally:
        tracemalloc.stop()
        for n, f in origs.items():
            setattr(b, n, f)
    return overall, chunks, cache, big[0]


def decode_timed(model, lat, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for g in model.decode_frames(lat, tiled=False):
            del g
        times.append(time.perf_counter() - t0)
    return min(times)


def profile(model, lat, top):
    """Live bytes around every backend op: which layer's call the peak falls in."""
    b = model.backend
    names = ("conv3d", "conv2d", "upsample_conv2d", "rms_norm", "concat", "attention", "asarray")
    origs = {n: getattr(b, n) for n in names}
    rows = []

    def where():
        f = sys._getframe(2)
        parts = []
        while f is not None and len(parts) < 3:
            code = f.f_code
            if "wan_" in code.co_filename:
                parts.append(f"{code.co_name}:{f.f_lineno}")
            f = f.f_back
        return " < ".join(parts)

    def wrap(n):
        f = origs[n]

        def w(*a, **k):
            live = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            out = f(*a, **k)
            cur, peak = tracemalloc.get_traced_memory()
            rows.append((peak, live, n, where(), chunk[0]))
            return out
        return w

    chunk = [0]
    for n in names:
        setattr(b, n, wrap(n))
    try:
        z = model._prepare(lat)
        state = FeatureCache()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        for k in range(z.shape[1]):
            chunk[0] = k
            g = model._decode_chunk(z[:, k:k + 1], state, clip=(0.0, 1.0)).result()
            del g
        tracemalloc.stop()
    finally:
        for n, f in origs.items():
            setattr(b, n, f)
    rows.sort(key=lambda r: -r[0])
    print(f"  top {top} op calls by peak live bytes (MiB: peak, live before the call, op's own temporaries+output)")
    for peak, live, n, loc, k in rows[:top]:
        print(f"    chunk {k}: {(peak - base) / MIB:8.1f} {(live - base) / MIB:8.1f} {(peak - live) / MIB:8.1f}  {n:16s} {loc}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="wan2.1-vae")
    ap.add_argument("--shapes", nargs="+", default=["3x12x20"], help="latent TxHxW")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--autotune", action="store_true",
                    help="let large convs pick their path by timing (default: the static cost rule, so "
                         "runs compare the same paths; timing on a busy machine picks differently)")
    args = ap.parse_args()

    backend = get_backend("numpy", **({} if args.autotune else {"autotune_min_macs": float("inf")}))
    model = load_model("w", args.preset, backend)
    print(f"machine: {describe_machine()}")
    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"model: {args.preset} random init, numpy backend {backend.dtype}; live bytes from tracemalloc "
          f"(weights excluded), time: best of {args.reps} untraced after a warm-up, conv paths "
          f"{'autotuned' if args.autotune else 'by cost rule'}")
    rng = np.random.default_rng(0)
    for shape in args.shapes:
        t, h, w = (int(v) for v in shape.split("x"))
        lat = rng.standard_normal((1, model.latent_channels, t, h, w)).astype(np.float32)
        frames = 1 + model.temporal_factor * (t - 1)
        out_bytes = frames * h * w * model.spatial_factor ** 2 * 3 * 4
        decode_timed(model, lat, 1)  # warm-up: path choices, Winograd weights
        secs = decode_timed(model, lat, args.reps)
        peak, chunks, cache, pair = decode_traced(model, lat)
        print(f"latents 1x{model.latent_channels}x{shape} -> {frames}x{h * model.spatial_factor}x"
              f"{w * model.spatial_factor}: peak live {peak / MIB:.1f} MiB, time {secs:.3f} s; "
              f"floor ~{(cache + pair) / MIB:.1f} MiB (steady cache {cache / MIB:.1f} + largest conv in+out "
              f"{pair / MIB:.1f}); output {out_bytes / MIB:.1f} MiB, not held")
        for k, (start, p, c) in enumerate(chunks):
            print(f"  chunk {k}: start {start / MIB:7.1f} MiB, peak {p / MIB:7.1f} MiB, cache after {c / MIB:6.1f} MiB")
        if args.profile:
            profile(model, lat, args.top)


if __name__ == "__main__":
    main()
