"""Encode throughput through the service vs the raw model, same machine, same run (issue #11 asks
the CUDA server for >= 80% of the raw model's throughput at batch saturation).

raw: `model.encode` in a child process on batches of --batch images (pixels from host memory,
embeddings back to host memory), the best of --reps timed calls after a warm-up. A child of its
own, as the server is: with PyTorch imported first (benchmarks/machine.py does), our C kernels
bind to torch's bundled libgomp and ConvNeXt-T b8 ran 990-1160 ms instead of 615-740 ms.
service: a real `convserve serve` (max_batch --batch, the same model) under a closed loop of
--concurrency clients, each sending one image at a time (--format npy: uint8 HxWx3 of --size;
png: the same pixels as PNG), optionally spread over --client-procs processes so the client is not
the bottleneck. Its idle connections expire (30 s) before the server closes them (75 s). Prints
requests/s answered 200, latency p50/p99, the mean batch the server ran, service/raw, and counts
non-200 answers and transport errors instead of stopping at the first.

    python benchmarks/service_throughput.py                                   # CPU: tiny-convnext
    python benchmarks/service_throughput.py --backend cuda --preset convnext-tiny --size 224 \\
        --batch 32 --concurrency 128 --requests 4096
"""
from __future__ import annotations

import argparse
import io
import multiprocessing
import statistics
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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


#: the server's keep-alive (CONVSERVE_KEEP_ALIVE_S) and the client's pool expiry, shorter than it:
#: a client reusing a connection the server is closing at that moment loses the request
SERVER_KEEP_ALIVE_S = 75.0
CLIENT_KEEPALIVE_EXPIRY_S = 30.0


@dataclass
class LoopResult:
    seconds: float
    latencies: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    transport_errors: Counter = field(default_factory=Counter)


def closed_loop(url: str, data: list[bytes], ctype: str, concurrency: int, start=None) -> LoopResult:
    """`concurrency` clients, each sending its next request when the last one is answered.
    Errors are counted (status codes, transport errors by class), never raised. `start`: a
    barrier to wait on before the clock starts (several client processes start together)."""
    res = LoopResult(0.0)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency,
                          keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S)
    with httpx.Client(timeout=600, limits=limits) as client:
        def one(body: bytes) -> None:
            t0 = time.perf_counter()
            try:
                r = client.post(f"{url}/v1/models/enc/encode", content=body, headers={"content-type": ctype})
            except httpx.TransportError as exc:
                res.transport_errors[exc.__class__.__name__] += 1
                return
            res.statuses[r.status_code] += 1
            if r.status_code == 200:
                res.latencies.append(time.perf_counter() - t0)
        if start is not None:
            start.wait()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, data))
        res.seconds = time.perf_counter() - t0
    return res


def _client_process(url, data, ctype, concurrency, start, results) -> None:
    results.put(closed_loop(url, data, ctype, concurrency, start))


def closed_loop_procs(url: str, data: list[bytes], ctype: str, concurrency: int, procs: int) -> LoopResult:
    """The closed loop split over `procs` client processes (one Python client process tops out
    near a core's worth of requests); they start together and the run lasts until the last ends."""
    if procs <= 1:
        return closed_loop(url, data, ctype, concurrency)
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_client_process, args=(url, data[i::procs], ctype, max(1, concurrency // procs),
                                                         start, results)) for i in range(procs)]
    for w in workers:
        w.start()
    parts = [results.get() for _ in workers]
    for w in workers:
        w.join()
    total = LoopResult(max(p.seconds for p in parts))
    for p in parts:
        total.latencies += p.latencies
        total.statuses.update(p.statuses)
        total.transport_errors.update(p.transport_errors)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--preset", default="tiny-convnext")
    ap.add_argument("--size", type=int, default=64, help="image side sent and encoded")
    ap.add_argument("--batch", type=int, default=8, help="server max_batch and the raw batch")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--format", choices=("npy", "png"), default="npy")
    ap.add_argument("--client-procs", type=int, default=1, help="client processes sharing --concurrency")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--log", help="server log file")
    ap.add_argument("--raw-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.raw_only:
        print(raw_images_per_s(args.backend, args.preset, args.size, args.batch, args.reps))
        return
    def measure_raw() -> float:
        child = subprocess.run([sys.executable, __file__, "--raw-only", "--backend", args.backend, "--preset",
                                args.preset, "--size", str(args.size), "--batch", str(args.batch), "--reps",
                                str(args.reps)], capture_output=True, text=True, check=True)
        return float(child.stdout.strip().splitlines()[-1])

    # raw before and after the service run: on a shared machine the load moves between them
    raw_before = measure_raw()
    data, ctype = bodies(args.requests, args.size, args.format)
    settings = dict(models=f"enc={args.preset}", backend=args.backend, max_batch=args.batch,
                    max_queue=max(64, 2 * args.concurrency), warmup_sizes=str(args.size), request_timeout_s=600,
                    keep_alive_s=SERVER_KEEP_ALIVE_S)
    with ServerProcess(log_path=args.log, **settings) as srv:
        closed_loop(srv.url, data[: max(args.concurrency, args.batch) * 2], ctype, args.concurrency)  # warm-up
        b0 = srv.batch_stats("enc")
        res = closed_loop_procs(srv.url, data, ctype, args.concurrency, args.client_procs)
        b1 = srv.batch_stats("enc")
    raw_after = measure_raw()
    raw = (raw_before + raw_after) / 2
    from machine import describe_machine
    print(f"machine: {describe_machine()}")
    rps = len(res.latencies) / res.seconds  # answered 200
    mean_batch = (b1[1] - b0[1]) / max(1.0, b1[0] - b0[0])
    q = statistics.quantiles(res.latencies, n=100) if len(res.latencies) > 1 else [float("nan")] * 99
    print(f"{args.preset} {args.size}x{args.size} {args.format}, backend {args.backend}, max_batch {args.batch}, "
          f"{args.concurrency} clients in {args.client_procs} process(es), {len(data)} requests")
    errors = sum(res.transport_errors.values())
    print(f"statuses {dict(res.statuses)}; transport errors {errors} {dict(res.transport_errors) or ''}")
    print("| raw model img/s (batch %d) | service req/s | service / raw | p50 ms | p99 ms | mean batch |" % args.batch)
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"raw img/s before {raw_before:.1f}, after {raw_after:.1f}: the ratio uses their mean")
    print(f"| {raw:.1f} | {rps:.1f} | {rps / raw:.2f} | {q[49] * 1e3:.1f} | {q[98] * 1e3:.1f} | {mean_batch:.1f} |")


if __name__ == "__main__":
    main()
