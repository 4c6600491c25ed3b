"""Dynamic batching vs batch-1 serving, over HTTP, same machine, same run.

Starts two real servers (`convserve serve`, NumPy backend, tiny presets): one with
CONVSERVE_MAX_BATCH=8 (the default) and one with CONVSERVE_MAX_BATCH=1. Each gets the same
closed-loop concurrent load (decode image latents; encode small images); after an untimed
warm-up round, the best of --rounds timed rounds is kept. Prints requests/s for both and the
ratio, plus the mean batch size the batched server ran.

  python benchmarks/service/batching.py [--requests 32] [--concurrency 16] [--rounds 3]
"""
from __future__ import annotations

import argparse
import io
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "benchmarks" / "service"), str(REPO)]  # this group's scripts; the repo
from benchmarks.machine import describe_machine  # noqa: E402
from server_process import ServerProcess  # noqa: E402


def start(max_batch: int) -> ServerProcess:
    return ServerProcess(timeout=120, models="tiny-vae,tiny-convnext", backend="numpy", max_batch=max_batch,
                         max_queue=256)


def payloads(kind: str, n: int) -> list[tuple[str, bytes, str]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        if kind == "decode":
            buf = io.BytesIO()
            np.save(buf, rng.standard_normal((1, 4, 8, 8)).astype(np.float32))
            out.append(("/v1/models/tiny-vae/decode", buf.getvalue(), "application/x-npy"))
        else:
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, format="PNG")
            out.append(("/v1/models/tiny-convnext/encode", buf.getvalue(), "image/png"))
    return out


def load(url: str, reqs, concurrency: int) -> float:
    with httpx.Client(timeout=300, limits=httpx.Limits(max_connections=concurrency)) as client:
        def one(r):
            path, body, ctype = r
            resp = client.post(url + path, content=body, headers={"content-type": ctype})
            resp.raise_for_status()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, reqs))
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"machine: {describe_machine()}")
    print(f"load: {args.requests} requests per round, {args.concurrency} concurrent clients, "
          f"best of {args.rounds} rounds after a warm-up round")
    servers = {"batched (max_batch 8)": start(8), "batch-1 (max_batch 1)": start(1)}
    try:
        for kind, model in (("decode", "tiny-vae"), ("encode", "tiny-convnext")):
            reqs = payloads(kind, args.requests)
            best = {}
            for name, srv in servers.items():
                load(srv.url, reqs, args.concurrency)  # warm-up: path choice per batch size
            before = servers["batched (max_batch 8)"].batch_stats(model)
            for _ in range(args.rounds):  # alternate servers so background noise hits both
                for name, srv in servers.items():
                    secs = load(srv.url, reqs, args.concurrency)
                    best[name] = min(best.get(name, float("inf")), secs)
            after = servers["batched (max_batch 8)"].batch_stats(model)
            mean_batch = (after[1] - before[1]) / max(after[0] - before[0], 1)
            rps = {name: args.requests / secs for name, secs in best.items()}
            b, s = rps["batched (max_batch 8)"], rps["batch-1 (max_batch 1)"]
            print(f"{kind:7s} {model:14s} batched {b:7.1f} req/s (mean batch {mean_batch:.1f})   "
                  f"batch-1 {s:7.1f} req/s   ratio {b / s:.2f}x")
    finally:
        for srv in servers.values():
            srv.stop()


if __name__ == "__main__":
    main()
