"""Whether the streamed MP4 encoder keeps pace with the decoder: the fragmented-MP4 writer the
service uses (service/codecs/fmp4.py: libx264, tune zerolatency, one fragment per frame group)
timed per frame group at a video's size, by x264 preset, thread count and entropy coder (MP4_CABAC), on smooth moving frames
(uint8, as they leave the device). The decode's own time per group is the budget: an encoder
slower than it makes /decode?format=mp4 wait for the last groups' encode.

    python benchmarks/service/video_encoder.py [--size 480x832] [--frames 81] [--presets ultrafast,superfast,veryfast]
                                               [--threads 0,2,4] [--cabac auto,on,off] [--reps 3]
                                               [--content smooth|noise]

Printed per setting: ms per 4-frame group (median over the clip's groups and --reps), frames/s,
and the clip's bytes; the machine line says how many cores the encoder had.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo

from benchmarks.machine import describe_machine  # noqa: E402
from service.codecs.fmp4 import FragmentedMP4Writer  # noqa: E402


def frames(n: int, h: int, w: int) -> np.ndarray:
    """Smooth gradients drifting frame to frame (a decoded video's kind of content, not noise,
    which no encoder compresses and which would time the entropy coder alone)."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    out = np.empty((n, h, w, 3), np.uint8)
    for t in range(n):
        for c in range(3):
            out[t, ..., c] = (127.5 + 120 * np.sin((x + 3 * t) / (37 + 11 * c) + (y - 2 * t) / (53 + 7 * c)))
    return out


def noise(n: int, h: int, w: int) -> np.ndarray:
    """Uniform random pixels: the bound for what a random-init decoder gives (the service's GPU
    benchmarks run on random weights), the content x264 compresses worst."""
    return np.random.default_rng(0).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


def run(clip: np.ndarray, preset: str, threads: int, cabac: str = "on") -> tuple[list[float], int]:
    """Seconds per group (the first frame alone, then groups of 4, as a causal video decoder
    gives them) and the clip's bytes."""
    f, h, w, _ = clip.shape
    writer = FragmentedMP4Writer(w, h, 16.0, 90, preset=preset, threads=threads, cabac=cabac)
    bounds = [(0, 1)] + [(s, min(s + 4, f)) for s in range(1, f, 4)]
    times, size = [], 0
    for i, (a, b) in enumerate(bounds):
        t0 = time.perf_counter()
        size += len(writer.add_group(clip[a:b], last=i == len(bounds) - 1))
        times.append(time.perf_counter() - t0)
    return times, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="480x832", help="HxW")
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--presets", default="ultrafast,superfast,veryfast")
    ap.add_argument("--threads", default="0", help="comma-separated x264 thread counts (0: x264's choice)")
    ap.add_argument("--cabac", default="on", help="comma-separated MP4_CABAC values (on: CABAC, the default; off and auto: CAVLC at quality 90)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--content", choices=("smooth", "noise"), default="smooth",
                    help="smooth moving gradients (a decoded video's kind) or uniform noise (a random-init decoder's bound)")
    args = ap.parse_args()
    h, w = (int(v) for v in args.size.split("x"))
    clip = (frames if args.content == "smooth" else noise)(args.frames, h, w)
    print(f"machine: {describe_machine()}")
    print(f"clip {args.frames}x{h}x{w} ({args.content}), groups of 4 frames after the first; median over {args.reps} runs")
    print("| preset | threads | cabac | ms per 4-frame group (median) | ms the last group | frames/s | MB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    settings = [(p, int(t), c) for p in args.presets.split(",") for t in args.threads.split(",") for c in args.cabac.split(",")]
    for preset, threads, cabac in settings:
        groups, lasts, totals, size = [], [], [], 0
        for _ in range(args.reps):
            times, size = run(clip, preset, threads, cabac)
            groups += times[1:-1]
            lasts.append(times[-1])
            totals.append(sum(times))
        total = statistics.median(totals)
        print(f"| {preset} | {threads or 'auto'} | {cabac} | {statistics.median(groups) * 1e3:.1f} "
              f"| {statistics.median(lasts) * 1e3:.1f} | {args.frames / total:.0f} | {size / 1e6:.2f} |")


if __name__ == "__main__":
    main()
