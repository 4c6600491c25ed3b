"""Encode throughput through the service vs the raw model, same machine, same run (issue #11 asks
the CUDA server for >= 80% of the raw model's throughput at batch saturation).

raw: `model.encode` in a child process on batches of --batch images (pixels from host memory,
embeddings back to host memory), the best of --reps timed calls after a warm-up. A child of its
own, as the server is: with PyTorch imported first (benchmarks/machine.py does), our C kernels
bind to torch's bundled libgomp and ConvNeXt-T b8 ran 990-1160 ms instead of 615-740 ms.
service: a real `convserve serve` (max_batch --batch, the same model) under a closed loop of
--concurrency clients, each sending one image at a time (--format npy: uint8 HxWx3 of --size;
png: the same pixels as PNG). Prints requests/s, latency p50/p99, the mean batch the server ran,
and service/raw.

    python benchmarks/service_throughput.py                                   # CPU: tiny-convnext
    python benchmarks/service_throughput.py --backend cuda --preset convnext-tiny --size 224 \\
        --batch 32 --concurrency 128 --requests 4096
"""
from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_process import ServerProcess  # noqa: E402


def raw_images_per_s(backend: str, preset: str, size: int, batch: int, reps: int) -> float:
    from convkernels import get_backend
    from models import load_model

    model = load_model("enc", preset, get_backend(backend))
    px = np.random.default_rng(0).random((batch, size, size, 3), dtype=np.float32)
    for _ in range(3):  # path choice / plans, then graph capture where enabled
        model.encode(px)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        model.encode(px)
        best = min(best, time.perf_counter() - t0)
    return batch / best


def bodies(n: int, size: int, fmt: str) -> tuple[list[bytes], str]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        img = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        buf = io.BytesIO()
        if fmt == "png":
            Image.fromarray(img).save(buf, format="PNG")
        else:
            np.save(buf, img, allow_pickle=False)
        out.append(buf.getvalue())
    return out, ("image/png" if fmt == "png" else "application/x-npy")


def closed_loop(url: str, data: list[bytes], ctype: str, concurrency: int) -> tuple[float, list[float]]:
    lat: list[float] = []
    with httpx.Client(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:
        def one(body: bytes) -> None:
            t0 = time.perf_counter()
            r = client.post(f"{url}/v1/models/enc/encode", content=body, headers={"content-type": ctype})
            r.raise_for_status()
            lat.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, data))
        return time.perf_counter() - t0, lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--preset", default="tiny-convnext")
    ap.add_argument("--size", type=int, default=64, help="image side sent and encoded")
    ap.add_argument("--batch", type=int, default=8, help="server max_batch and the raw batch")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--format", choices=("npy", "png"), default="npy")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--log", help="server log file")
    ap.add_argument("--raw-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.raw_only:
        print(raw_images_per_s(args.backend, args.preset, args.size, args.batch, args.reps))
        return
    child = subprocess.run([sys.executable, __file__, "--raw-only", "--backend", args.backend, "--preset", args.preset,
                            "--size", str(args.size), "--batch", str(args.batch), "--reps", str(args.reps)],
                           capture_output=True, text=True, check=True)
    raw = float(child.stdout.strip().splitlines()[-1])
    data, ctype = bodies(args.requests, args.size, args.format)
    settings = dict(models=f"enc={args.preset}", backend=args.backend, max_batch=args.batch,
                    max_queue=max(64, 2 * args.concurrency), warmup_sizes=str(args.size), request_timeout_s=600)
    with ServerProcess(log_path=args.log, **settings) as srv:
        closed_loop(srv.url, data[: max(args.concurrency, args.batch) * 2], ctype, args.concurrency)  # warm-up
        b0 = srv.batch_stats("enc")
        secs, lat = closed_loop(srv.url, data, ctype, args.concurrency)
        b1 = srv.batch_stats("enc")
    from machine import describe_machine
    print(f"machine: {describe_machine()}")
    rps = len(data) / secs
    mean_batch = (b1[1] - b0[1]) / max(1.0, b1[0] - b0[0])
    q = statistics.quantiles(lat, n=100)
    print(f"{args.preset} {args.size}x{args.size} {args.format}, backend {args.backend}, max_batch {args.batch}, "
          f"{args.concurrency} clients, {len(data)} requests")
    print("| raw model img/s (batch %d) | service req/s | service / raw | p50 ms | p99 ms | mean batch |" % args.batch)
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| {raw:.1f} | {rps:.1f} | {rps / raw:.2f} | {q[49] * 1e3:.1f} | {q[98] * 1e3:.1f} | {mean_batch:.1f} |")


if __name__ == "__main__":
    main()
